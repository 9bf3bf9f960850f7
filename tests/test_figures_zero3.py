"""zerolab.book.figures_zero3 (chapter 6): the gather -> compute -> release figures replay a real trace right.

A real stage-3 engine on 2 ranks records its events; hooks that run after the engine's own record,
at every module's forward and every gradient, which units really have storage (``engine.flat.full``)
and the engine's ``live_elements``. The replay the figures draw from must agree at every one of
those moments; a replay that ignored releases (planted) must not.
"""
import hashlib
import types

import pytest

import zerolab as zl
from zerolab.book import figures_zero3 as fz, plots
from zerolab.engine import events as ev

PARTITION_ALL = {"stage3_param_persistence_threshold": 0, "stage3_max_reuse_distance": 0}


def traced_step(zero, lora=False):
    """On each rank: two steps; in the last, the truth at each hook: (event position, units with storage, live).
    ``lora``: a frozen base with trainable adapters (the frozen twins are units too)."""
    import torch.distributed as dist
    from zerolab.book.models import TinyGPT, add_lora, loss_fn, synthetic_batch
    model = TinyGPT.preset("micro", seed=0)
    if lora:
        add_lora(model, b_std=0.02)
    engine = zl.initialize(model, {"optimizer": {"type": "Adam", "params": {"lr": 1e-3}},
                                   "zero_optimization": {"stage": 3, **PARTITION_ALL, **zero},
                                   "zerolab": {"trace": True}})
    truth = []

    def sample(*_):
        full = list(engine.flat.full) + (list(engine.frozen_flat.full) if engine.frozen_flat is not None else [])
        held = {i for i, b in enumerate(full) if b.untyped_storage().nbytes() > 0}
        truth.append((len(engine.events) - 1, held, engine.live_elements))
    for m in model.modules():
        m.register_forward_pre_hook(sample)
    for p in model.parameters():
        if p.requires_grad:
            p.register_post_accumulate_grad_hook(sample)
    for step in range(2):
        engine.events.clear()
        truth.clear()
        x, y = synthetic_batch(model, 4, seed=0, step=step, rank=dist.get_rank(), world_size=dist.get_world_size())
        engine.backward(loss_fn(engine(x), y))
        engine.step()
    return {"events": list(engine.events), "table": fz.unit_table(engine), "truth": truth,
            "peak_live": engine.peak_live_elements}


@pytest.fixture(scope="module")
def runs():
    cases = (("no prefetch", {"stage3_prefetch_bucket_size": 0}, False), ("prefetch", {}, False),
             ("LoRA, no prefetch", {"stage3_prefetch_bucket_size": 0}, True))
    return {name: zl.launch(traced_step, world_size=2, args=(zero, lora), timeout=300) for name, zero, lora in cases}


def mismatches(run):
    """Moments where the replay disagrees with the engine's storage or its live_elements counter."""
    curve = fz.held_elements(run["events"], run["table"])
    return [(pos, held, fz.gathered_at(run["events"], pos)) for pos, held, live in run["truth"]
            if fz.gathered_at(run["events"], pos) != held or curve[pos] != live]


@pytest.mark.parametrize("name", ["no prefetch", "prefetch", "LoRA, no prefetch"])
def test_replay_matches_the_engine_at_every_hook(runs, name):
    for run in runs[name]:
        assert len(run["truth"]) > 10 and mismatches(run) == []
        assert max(fz.held_elements(run["events"], run["table"])) == run["peak_live"]


def test_planted_replay_that_ignores_releases_is_caught(runs, monkeypatch):
    run = runs["no prefetch"][0]
    monkeypatch.setattr(fz, "ev", types.SimpleNamespace(**{**vars(ev), "RELEASE": "never-emitted"}))
    assert mismatches(run)


def test_without_prefetch_every_unit_is_gathered_twice(runs):
    run = runs["no prefetch"][0]
    life = fz.lifetimes(run["events"])
    assert sorted(life) == list(range(len(run["table"]))) and all(len(s) == 2 for s in life.values())
    assert all(issued <= done <= released for spans in life.values() for issued, done, released in spans)


def test_step_figure_says_what_the_trace_says(runs):
    run = runs["no prefetch"][0]
    fig, alt = fz.step_figure(run["events"], run["table"], rank=0)
    peak = max(fz.held_elements(run["events"], run["table"]))
    assert f"At most {peak:,} elements" in alt and "gathered twice" in alt and "nothing is held whole" in alt
    assert len(fig.axes) == 2
    other, alt2 = fz.step_figure(runs["prefetch"][0]["events"], run["table"], rank=0)
    assert alt2 != alt and digest(other) != digest(fig)


def test_moment_figure_names_the_units_held(runs):
    ranks = runs["no prefetch"]
    table = ranks[0]["table"]
    b1 = [n for n, *_ in table].index("blocks.1")
    fig, alt = fz.moment_figure([r["events"] for r in ranks], table,
                                [("between steps", ev.STEP_START, -1), ("forward", ev.UNIT_FWD_START, b1)])
    assert "between steps: only the shard" in alt and "forward: rest and blocks.1 whole" in alt
    assert "ranks differ" not in alt and len(fig.axes) == 2


def test_a_missing_event_is_a_clear_error(runs):
    with pytest.raises(ValueError, match=r"occurs 0 time\(s\)"):
        fz.position(runs["no prefetch"][0]["events"], ev.UNIT_FWD_START, 99)


def digest(fig):
    return hashlib.sha256(plots.figure_png(fig)).hexdigest()


def test_frozen_twins_are_drawn_as_units_of_their_own(runs):
    run = runs["LoRA, no prefetch"][0]
    names = [n for n, *_ in run["table"]]
    assert any(n.endswith(" (frozen)") for n in names)
    assert set(fz.lifetimes(run["events"])) <= set(range(len(names)))       # every event's unit has a row
    _, alt = fz.step_figure(run["events"], run["table"])
    assert "(frozen)" in alt


def test_packed_lanes_give_concurrent_gathers_rows_of_their_own():
    from zerolab.book.figures_zero3 import packed_lanes
    from zerolab.engine import events as ev
    trace = [(ev.GATHER_ISSUED, 0, 0.0), (ev.GATHER_ISSUED, 1, 0.1), (ev.GATHER_DONE, 0, 0.5),
             (ev.GATHER_DONE, 1, 0.6), (ev.GATHER_ISSUED, 2, 0.7), (ev.GATHER_DONE, 2, 0.8)]
    rows, labels = packed_lanes([trace])
    gathers = [row for row, label in zip(rows, labels) if "all-gather" in label]
    assert [len(r) for r in gathers] == [2, 1] and sum(map(len, gathers)) == 3   # 0 and 2 share a row, 1 its own
    for row in gathers:
        assert all(a[2] <= b[1] for a, b in zip(row, row[1:]))                # no two bars of a row overlap
