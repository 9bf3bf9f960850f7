"""Modern pipeline schedules (zerolab/parallel/pipeline_interleaved.py, pipeline_zb.py; theory/bubble.py).

* The orders: every operation once, in dependency order; interleaved 1F1B's chunk c of rank r is
  virtual stage c·p + r; ZB-H1 keeps at most p micro-batches between F and W on every stage.
* The bubble by arithmetic: each schedule's orders simulated with exact costs (f = b = w = 1, and
  papers' f = 1, b + w = 2 with other splits) idle exactly the formula's time per rank:
  GPipe/1F1B (p-1)(f+b+w), interleaved (p-1)(f+b+w)/v, ZB-H1 (p-1)(f+b-w).
* Training: TinyGPT (4 layers) on 2 ranks, 3 Adam steps of 4 micro-batches, under interleaved 1F1B
  (pp=2, v=2) and ZB-H1, ends at single-process training's parameters (fp32, ADAM_ATOL); the B/W
  split alone gives autograd's gradients bit for bit.
* The measured timeline (blocks sleeping 0.1 s in F, B and W; 2 ranks, m = 4): 1F1B's bubble is larger
  than interleaved's and ZB-H1's, and none is below its formula by more than 0.03 (the formulas count no
  messages). Ordering only: wall times on a shared laptop are noisy. Measured with a load average of 19 on
  2 cores: 1f1b 0.207, interleaved 0.136, zb-h1 0.085 (formulas 0.2, 0.111, 0.077); at 0.05 s per sleep
  the interleaved schedule's extra messages put it above 1F1B once under that load.
* Bad input refused by name.
"""
from __future__ import annotations

import statistics
import types
from fractions import Fraction

import pytest
import torch
from torch import nn

from zerolab.book import runs_schedules as R
from zerolab.book.models import loss_fn
from zerolab.parallel import pipeline_stage, schedule, train_batch
from zerolab.parallel.pipeline_interleaved import virtual_split
from zerolab.parallel.pipeline_stats import bubble_formula
from zerolab.parallel.pipeline_zb import run_w, split_linears
from zerolab.theory.bubble import bubble_fraction, bubble_time, idle_time, simulate

ADAM_ATOL = 1e-4   # as tests/test_pipeline.py: Adam's near-zero-gradient elements carry ~1e-5 of BLAS rounding


def orders(kind, m, p, v=1):
    return [schedule(kind, m, p, s, v) if v > 1 else schedule(kind, m, p, s) for s in range(p)]


def test_interleaved_order_by_hand_and_its_chunks():
    # p = 2, v = 2, m = 4, rank 0: 4 warm-up forwards (2 micro-batches through chunk 0, then chunk 1)
    assert schedule("interleaved", 4, 2, 0, 2) == [
        ("F", 0, 0), ("F", 1, 0), ("F", 0, 1), ("F", 1, 1), ("F", 2, 0), ("B", 0, 1), ("F", 3, 0), ("B", 1, 1),
        ("F", 2, 1), ("B", 0, 0), ("F", 3, 1), ("B", 1, 0), ("B", 2, 1), ("B", 3, 1), ("B", 2, 0), ("B", 3, 0)]
    for p, v, m in ((2, 2, 4), (4, 2, 8), (3, 3, 6)):
        for s in range(p):
            order = schedule("interleaved", m, p, s, v)
            assert sorted(order) == sorted((op, i, c) for op in "FB" for i in range(m) for c in range(v))
            for c in range(v):
                for op in "FB":
                    assert [i for o, i, cc in order if o == op and cc == c] == list(range(m))
    # chunk c of rank r holds virtual stage c*p + r: 8 blocks, p = 2, v = 2 -> rank 1 holds blocks 2-3 and 6-7
    assert virtual_split(8, 2, 2) == [[(0, 2), (4, 6)], [(2, 4), (6, 8)]]
    mesh = types.SimpleNamespace(pp=2, pp_rank=1)
    stage = pipeline_stage(nn.Sequential(*[nn.Linear(2, 2) for _ in range(8)]), mesh, virtual=2)
    assert stage.virtual == [1, 3] and stage.chunk_blocks == [[2, 3], [6, 7]]
    assert sorted({n.split(".")[0] for n, _ in stage.named_parameters()}) == ["2", "3", "6", "7"]


def test_zb_h1_order_and_memory():
    assert schedule("zb-h1", 4, 2, 1) == [("F", 0), ("B", 0), ("F", 1), ("B", 1), ("W", 0), ("F", 2), ("B", 2),
                                          ("W", 1), ("F", 3), ("B", 3), ("W", 2), ("W", 3)]
    for p, m in ((2, 4), (4, 8), (3, 7)):
        for s in range(p):
            order = schedule("zb-h1", m, p, s)
            assert sorted(order) == sorted((op, i) for op in "FBW" for i in range(m))
            pos = {a: k for k, a in enumerate(order)}
            assert all(pos[("F", i)] < pos[("B", i)] < pos[("W", i)] for i in range(m))
            live = peak = 0
            for op, _ in order:   # micro-batches between F and W: 1F1B's first-stage peak, p, on every stage
                live += (op == "F") - (op == "W")
                peak = max(peak, live)
            assert peak == p


CASES = [("gpipe", 1), ("1f1b", 1), ("interleaved", 2), ("interleaved", 4), ("zb-h1", 1)]


@pytest.mark.parametrize("kind,v", CASES)
@pytest.mark.parametrize("f,b,w", [(1, 1, 1), (2, 1, 1), (3, 2, 1), (1, 2, 0)])
def test_idle_slots_counted_equal_the_formula(kind, v, f, b, w):
    for p in (2, 3, 4, 8):
        for m in (p, 2 * p, 3 * p):
            timeline = simulate(orders(kind, m, p, v), v, f, b, w)
            assert idle_time(timeline) == bubble_time(kind, p, m, v, f, b, w), (p, m)
            step = max(e[4] for ops in timeline for e in ops)
            assert 1 - m * Fraction(f + b + w) / step == bubble_fraction(kind, p, m, v, f, b, w)
    p, m = 4, 8
    print(f"{kind} v={v} (f,b,w)=({f},{b},{w}) p={p} m={m}: idle per rank counted "
          f"{idle_time(simulate(orders(kind, m, p, v), v, f, b, w))}, formula {bubble_time(kind, p, m, v, f, b, w)}")


def test_the_formulas_order_the_schedules():
    p, m = 4, 8
    frac = {k: bubble_formula(p, m, k, v) for k, v in CASES}
    assert frac["gpipe"] == frac["1f1b"] == pytest.approx(3 / 11)
    assert bubble_formula(p, m, "interleaved", 2) == pytest.approx(3 / 19)
    assert bubble_formula(p, m, "zb-h1") == pytest.approx(3 / 27)   # (p-1)(f+b-w) = 3 against 8 x 3 of work
    with pytest.raises(ValueError, match="deadlock"):
        simulate([[("B", 0), ("F", 0)], [("F", 0), ("B", 0)]])


def test_bad_input_refused_by_name():
    with pytest.raises(ValueError, match=r"6 blocks cannot be cut into pp x virtual = 2 x 2 = 4 virtual stages"):
        virtual_split(6, 2, 2)
    with pytest.raises(ValueError, match=r"6 blocks cannot be cut"):
        pipeline_stage(nn.Sequential(*[nn.Linear(2, 2) for _ in range(6)]), types.SimpleNamespace(pp=2, pp_rank=0),
                       virtual=2)
    with pytest.raises(ValueError, match="interleaved 1F1B needs the micro-batches to be a multiple of pp: 3 "
                                         "micro-batches, pp=2"):
        schedule("interleaved", 3, 2, 0, 2)
    with pytest.raises(ValueError, match="ZB-H1 needs at least as many micro-batches as stages: 2 micro-batches, pp=4"):
        schedule("zb-h1", 2, 4, 0)
    with pytest.raises(ValueError, match="virtual=2 chunks per rank need the 'interleaved' schedule, not '1f1b'"):
        schedule("1f1b", 4, 2, 0, 2)
    with pytest.raises(ValueError, match="virtual \\(model chunks per rank\\) must be an int >= 1, got 0"):
        pipeline_stage(nn.Sequential(nn.Linear(2, 2)), types.SimpleNamespace(pp=1, pp_rank=0), virtual=0)
    with pytest.raises(ValueError, match="pipeline schedule must be one of"):
        schedule("zb-h2", 4, 2, 0)
    with pytest.raises(ValueError, match="interleaving needs a pipeline \\(pp >= 2\\), got pp=1"):
        pipeline_stage(nn.Sequential(nn.Linear(2, 2), nn.Linear(2, 2)), types.SimpleNamespace(pp=1, pp_rank=0),
                       virtual=2)
    data = [(torch.randn(2, 2), torch.randn(2, 2))]
    with pytest.raises(ValueError, match="the 'interleaved' schedule runs a stage cut into chunks"):
        train_batch(nn.Sequential(nn.Linear(2, 2)), None, data, nn.functional.mse_loss, "interleaved")
    chunked = pipeline_stage(nn.Sequential(*[nn.Linear(2, 2) for _ in range(4)]), types.SimpleNamespace(pp=2, pp_rank=0),
                             virtual=2)
    with pytest.raises(ValueError, match="this stage holds 2 chunks \\(virtual stages\\): run it with the "
                                         "'interleaved' schedule, not '1f1b'"):
        train_batch(chunked, None, data, nn.functional.mse_loss, "1f1b")
    # an engine (anything with backward, gas, step) runs one whole backward per micro-batch
    engine = types.SimpleNamespace(backward=None, gas=1, step=None, module=nn.Linear(2, 2), keeps_full_grads=True)
    with pytest.raises(ValueError, match="the 'zb-h1' schedule runs on a plain stage module"):
        train_batch(engine, None, data, nn.functional.mse_loss, "zb-h1")


def test_b_then_w_gives_autograd_gradients_bit_for_bit():
    ref, split = R.gpt(), R.gpt()
    data = R.batches(ref, 0, 3)
    (sum(loss_fn(ref(x), y) for x, y in data) / 3).backward()
    stores = [[] for _ in data]
    outs = []
    for store, (x, y) in zip(stores, data):
        with split_linears(store):
            outs.append(loss_fn(split(x), y) / 3)
    for out in outs:   # B: every input gradient, the Linear weights untouched
        out.backward()
    assert all(p.grad is None for n, p in split.named_parameters() if n.endswith(("fc.weight", "head.weight")))
    assert [run_w(s) for s in stores] == [4 * 6 + 1] * 3   # W: 6 Linears per block and the head
    for (n, a), b in zip(ref.named_parameters(), split.parameters()):
        torch.testing.assert_close(b.grad, a.grad, rtol=0, atol=1e-7, msg=lambda m: f"{n}: {m}")


@pytest.fixture(scope="module")
def reference():
    return R.reference(steps=3, m=4)


@pytest.mark.parametrize("kind,v", [("interleaved", 2), ("zb-h1", 1)])
def test_trains_to_single_process_parameters(kind, v, reference):
    run = R.train_run(kind, v, steps=3, m=4)
    diff = R.max_difference(run["state"], reference["state"])
    print(f"{kind} (pp=2, v={v}, m=4, 3 Adam steps): max |parameter - single process| = {diff:.2e}")
    for n, t in reference["state"].items():
        torch.testing.assert_close(run["state"][n], t, rtol=1e-4, atol=ADAM_ATOL, msg=lambda m: f"{n}: {m}")
    assert run["losses"] == pytest.approx(reference["losses"], rel=1e-5)
    # interleaved: every virtual stage but the last sends its activation, every one but the first its
    # input's gradient: 2 (p·v - 1) m sends in all, against 1F1B's 2 (p - 1) m; 3 steps
    assert sum(run["sends"]) == 3 * 2 * (2 * v - 1) * 4
    # ZB-H1's W really holds the weight gradients: one deferred pass per Linear and micro-batch, on each rank
    # (stage 0: 2 blocks of 6 Linears; stage 1: 2 blocks and the head); none without the split
    want = [4 * n for n in run["linears"]] if kind == "zb-h1" else [0, 0]
    assert run["weight_passes"] == want and run["linears"] == [12, 13]


@pytest.fixture(scope="module")
def timelines():
    return {kind: R.timeline_run(kind, v, m=4, secs=0.1, steps=3) for kind, v in
            (("1f1b", 1), ("interleaved", 2), ("zb-h1", 1))}


def test_measured_bubble_orders_as_the_formulas(timelines):
    measured = {k: statistics.median(t["bubbles"]) for k, t in timelines.items()}
    print("measured bubble (median of 3 steps):", {k: round(b, 3) for k, b in measured.items()},
          "formulas:", {k: round(bubble_formula(2, 4, k, 2 if k == "interleaved" else 1), 3) for k in measured})
    assert measured["1f1b"] > measured["interleaved"] and measured["1f1b"] > measured["zb-h1"]
    assert all(b >= bubble_formula(2, 4, k, 2 if k == "interleaved" else 1) - 0.03 for k, b in measured.items())
    for kind, t in timelines.items():
        for rank, st in enumerate(t["stats"]):
            ops = sorted(zip((op for op, *_ in st["trace"]), (i for _, i, *_ in st["trace"]), st["chunks"]))
            v = 2 if kind == "interleaved" else 1
            want = sorted((op, i, c) for op in ("FBW" if kind == "zb-h1" else "FB") for i in range(4) for c in range(v))
            assert ops == want
            # in flight: 1F1B p - s; ZB-H1 counts to W: p on every stage; interleaved per chunk
            if kind == "1f1b":
                assert st["in_flight_max"] == 2 - rank
            if kind == "zb-h1":
                assert st["in_flight_max"] == 2


def test_the_figure_draws_the_simulated_schedules():
    fig, alt = R.schedule_figure(4, 8, 2)
    for ax, (kind, v) in zip(fig.axes, R.KINDS):
        timeline = simulate(orders(kind, 8, 4, v), v)
        assert len(ax.patches) == sum(len(ops) for ops in timeline)   # one box per pass, nothing else
        assert ax.get_title().startswith(kind) and f"idle {float(idle_time(timeline)):g} per rank" in ax.get_title()
    assert fig.axes[-1].get_xlabel().startswith("time (units of one forward pass")
    assert "1f1b: step 33 time units, idle 9 per rank" in alt and "zb-h1: step 27 time units, idle 3 per rank" in alt
