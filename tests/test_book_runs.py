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
        assert book_runs.exposed_comm(run, cfg["zero_optimization"]["overlap_comm"]) >= 0
        ops = book_runs.collectives(run)
        assert [op for op, _, _ in ops] == (["all_reduce"] * nu if stage == 0 else
                                             ["reduce_scatter"] * nu + ["all_gather"] * len(run["units"]))
        assert sum(book_runs.bytes_by_op(run).values()) == zl.comm_volume(run["padded"], 2, stage, dtype_bytes=4)
    assert runs[0][0]["params_checksum"] == runs[1][0]["params_checksum"]


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
