"""zerolab.book.runs: the chapters' training runs (chapters 3-5), in one process and on 2 ranks."""
from __future__ import annotations

import pytest

import zerolab as zl
from zerolab.book import runs as book_runs


def test_one_process_engine_matches_reference_and_reports_exact_memory():
    cfg = book_runs.ds_config(1, optimizer="SGD", lr=0.1, clip=1.0, gas=2)
    run = book_runs.train(cfg, steps=2)                     # no torch.distributed: one rank
    want = book_runs.reference(cfg, world_size=1, steps=2)
    assert book_runs.max_abs_diff(run["state"], want) < 1e-6
    est = zl.estimate(run["padded"], 1, 1, precision="fp32", optimizer="sgd_momentum")
    assert (run["memory"]["params"], run["memory"]["grads"], run["memory"]["optimizer"]) == \
        (est.params, est.grads, est.optimizer)
    assert len(run["records"]) == 2 and len(run["step_seconds"]) == 2


def test_max_abs_diff_sees_a_changed_element():
    a = book_runs.make_model().state_dict()
    b = {k: v.clone() for k, v in a.items()}
    b["ln_f.bias"][3] += 0.25
    assert book_runs.max_abs_diff(a, b) == pytest.approx(0.25)


def test_make_model_accepts_keyword_dict():
    m = book_runs.make_model(dict(vocab=64, n_layer=3, n_head=2, d_model=16, seq_len=8))
    assert len(m.blocks) == 3 and m.vocab == 64


def test_two_ranks_timeline_buckets_and_exposed_comm():
    cfgs = [book_runs.ds_config(s, bucket=1, overlap=o, trace=True) for s in (0, 2) for o in (False, True)]
    runs = zl.launch(book_runs.train_many, world_size=2, args=(cfgs,), kwargs=dict(steps=2, state=False))
    for k, cfg in enumerate(cfgs):
        run = runs[0][k]
        rows = book_runs.timeline(run)
        assert rows[0][0] == "compute" and {kind for kind, _, _ in rows[0][1]} == {"forward", "backward", "optimizer step"}
        grads = [label for label, _ in rows if label.startswith("grads")]
        nu = len(run["units"])                                         # rest (tied wte/head), wpe, the blocks, ln_f
        assert len(grads) == len(run["buckets"]) == nu                  # one bucket per unit
        stage = cfg["zero_optimization"]["stage"]
        assert any(label.startswith("params") for label, _ in rows) == (stage > 0)
        exposed = book_runs.exposed_comm(run, cfg["zero_optimization"]["overlap_comm"])
        assert 0 <= exposed <= run["step_seconds"][-1]
        ops = book_runs.collectives(run)
        assert [op for op, _, _ in ops] == (["all_reduce"] * nu if stage == 0 else
                                             ["reduce_scatter"] * nu + ["all_gather"] * len(run["units"]))
        assert sum(book_runs.bytes_by_op(run).values()) == zl.comm_volume(run["padded"], 2, stage, dtype_bytes=4)
    assert runs[0][0]["params_checksum"] == runs[1][0]["params_checksum"]


def _fake_run(steps):
    """A run dict with hand-written event timelines (one per step) and step times."""
    from zerolab.engine import events as ev
    events = []
    for reductions in steps:
        e = [(book_runs.FORWARD, -1, 0.0), (ev.BACKWARD_START, -1, 1.0), (ev.BACKWARD_END, -1, 2.0),
             (ev.STEP_START, -1, 3.0), (ev.STEP_END, -1, 3.5)]
        for i, (s, t) in enumerate(reductions):
            e += [(ev.REDUCE_ISSUED, i, s), (ev.REDUCE_DONE, i, t)]
        events.append(e)
    return {"events": events, "step_seconds": [3.5] * len(steps)}


def test_exposed_comm_is_the_union_of_blocked_intervals_not_a_sum():
    # two buckets in flight together after backward ends at 2.0: the rank waits 2.0 -> 3.0 once, not twice
    run = _fake_run([[(1.5, 3.0), (1.6, 3.0)]] * 2)
    assert book_runs.exposed_comm(run, overlap=True) == pytest.approx(1.0)
    # without overlap each reduction blocks backward for its whole duration (they do not overlap here)
    run = _fake_run([[(1.1, 1.4), (1.5, 1.9)]] * 2)
    assert book_runs.exposed_comm(run, overlap=False) == pytest.approx(0.7)
    # many concurrent tails never add up to more than the step
    run = _fake_run([[(1.0 + 0.01 * i, 3.0) for i in range(10)]] * 2)
    assert book_runs.exposed_comm(run, overlap=False) <= run["step_seconds"][0]


def test_watch_backward_sees_zero2_staging_buffers():
    cfgs = [book_runs.ds_config(2, bucket=1), book_runs.ds_config(2, bucket=10**9)]
    runs = zl.launch(book_runs.train_many, world_size=2, args=(cfgs,),
                     kwargs=dict(steps=1, watch_backward=True, state=False))
    small, big = runs[0]
    full = 4 * small["padded"]
    # each unit is reduced as soon as its gradients are in, whatever the bucket (no overlap): the shard plus
    # the units being filled, less than the one full gradient stage 1 holds (before: full + the shard)
    assert small["peak_backward"] == big["peak_backward"] < full
    assert big["peak_backward"] > full // 2                            # the shard, and something staged
