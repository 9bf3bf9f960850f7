"""What stage 3 holds, gathers and sends, measured, against theory; gathered_parameters,
the debug guard and the prefetch timeline (issue 5, items 1-3, 5, 6)."""
from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

import zerolab as zl
from test_engine_measured import PRECISIONS, settled_census
from zerolab.book.models import TinyGPT, loss_fn, synthetic_batch
from zerolab.theory.network import ring_bytes
from zerolab.theory import bytes_per_param, comm_breakdown

ADAM = {"type": "Adam", "params": {"lr": 1e-3}}


BLOCKS = ["Block"]   # the wrap policy "rest + one unit per block": the prefetch tests reason in those units


def engine_for(zero, prec="fp32", preset="micro", **extra):
    model = TinyGPT.preset(preset, seed=1)
    cfg = {"optimizer": ADAM, "zero_optimization": {"stage": 3, **zero}, **PRECISIONS[prec], **extra}
    return model, zl.initialize(model, cfg)


def memory_worker(cases):
    import gc
    rank, n = dist.get_rank(), dist.get_world_size()
    gc.collect()
    gc.freeze()
    out = []
    for prec, threshold in cases:
        base = settled_census()
        model, engine = engine_for({"stage3_param_persistence_threshold": threshold, "reduce_bucket_size": 2000}, prec)
        x, y = synthetic_batch(model, 2 * n, seed=3, rank=rank, world_size=n)
        loss = loss_fn(engine(x), y)
        engine.backward(loss)
        del x, y, loss
        mem = engine.memory()
        held = settled_census() - base
        units = {u.name: u.padded for u in engine.flat.units}
        out.append((mem.as_dict(), held, engine.flat.padded, units, [tuple(p.shape) for p in model.parameters()]))
        engine.step()
        del engine, model
    gc.unfreeze()
    return out


@pytest.mark.parametrize("n", [2, 3])
def test_memory_is_16psi_over_n_plus_persistent(n):
    cases = [(p, t) for p in PRECISIONS for t in (0, 100)]
    for rank_results in zl.launch(memory_worker, world_size=n, args=(cases,), timeout=300, threads=1):
        for (prec, threshold), (mem, held, padded, units, shapes) in zip(cases, rank_results):
            exact = zl.estimate(padded, n, 3, precision=prec)   # 16Ψ/N (mixed), 16Ψ/N fp32 too, on padded Ψ
            whole = units.get("persistent", 0) * bytes_per_param(prec)[0]   # persistent params stay whole
            assert (threshold == 0) == (whole == 0)
            assert (mem["params"], mem["grads"], mem["optimizer"]) == (exact.params + whole, exact.grads,
                                                                       exact.optimizer), (n, prec, mem, exact)
            assert mem["buffers"] == 0                            # every unit released after backward
            assert held == mem["total"] + mem["buffers"], (n, prec, threshold, held, mem)  # census agrees
            assert all(s == (0,) for s in shapes if threshold == 0)   # released parameters are empty


def comm_worker(cases):
    rank, n = dist.get_rank(), dist.get_world_size()
    out = []
    for prec, gas, zero in cases:
        model, engine = engine_for({"reduce_bucket_size": 1500, **zero}, prec, gradient_accumulation_steps=gas)
        for step in range(2):   # the second step: prefetch and reuse follow the first one's trace
            engine.comm.reset()
            for k in range(gas):
                x, y = synthetic_batch(model, 2 * n * gas, seed=3, step=step * gas + k, rank=rank, world_size=n)
                engine.backward(loss_fn(engine(x), y))
                engine.step()
        out.append((engine.comm.by_op(), engine.flat.padded, {u.name: u.padded for u in engine.flat.units}))
    return out


def by_kind(padded, n, dtype_bytes, gas) -> dict:
    """comm_breakdown summed by op (stage 3 all-gathers twice: forward and backward)."""
    out = {}
    for o in comm_breakdown(padded, n, 3, dtype_bytes, gas):
        out[o.op] = out.get(o.op, 0) + o.bytes
    return out


@pytest.mark.parametrize("n", [2, 4])
def test_ledger_bytes_are_3psi(n):
    # nothing persistent or reused; no prefetch either (it keeps units whose next use is in its window)
    plain = {"stage3_param_persistence_threshold": 0, "stage3_max_reuse_distance": 0, "stage3_prefetch_bucket_size": 0}
    cases = [("fp32", 1, plain), ("mixed", 2, plain), ("mixed_fp32_grads", 1, plain),
             ("fp32", 1, {"stage3_param_persistence_threshold": 0}),     # reuse: forward's gathers kept
             ("fp32", 1, {**plain, "stage3_prefetch_bucket_size": 10**9}),   # a window covering everything too
             ("fp32", 1, {**plain, "stage3_param_persistence_threshold": 500})]
    for rank_results in zl.launch(comm_worker, world_size=n, args=(cases,), timeout=300, threads=1):
        for (prec, gas, zero), (by_op, padded, units) in zip(cases, rank_results):
            pb, gb = (4, 4) if prec == "fp32" else (2, 2) if prec == "mixed" else (2, 4)
            theory, grads = by_kind(padded, n, pb, gas), by_kind(padded, n, gb, gas)
            if zero is plain:
                assert by_op == {"all_gather": theory["all_gather"], "reduce_scatter": grads["reduce_scatter"]}
                if pb == gb:   # 3Ψ(N-1)/N per micro-batch: 1.5x DDP's 2Ψ(N-1)/N
                    assert sum(by_op.values()) == zl.comm_volume(padded, n, 3, pb, gas) \
                        == 3 * gas * padded * pb * (n - 1) // n
            elif zero.get("stage3_param_persistence_threshold", 0) == 0:   # each unit gathered once, kept
                assert by_op["all_gather"] == theory["all_gather"] // 2
            else:   # persistent params: never gathered per unit, all-gathered once after the step
                pers = units["persistent"]
                assert by_op["all_gather"] == ring_bytes("all_gather", (padded - pers) * pb, n) * 2 \
                    + ring_bytes("all_gather", pers * pb, n)
                assert by_op["reduce_scatter"] == grads["reduce_scatter"]


def live_worker(budgets):
    rank, n = dist.get_rank(), dist.get_world_size()
    out = []
    for prefetch, max_live in budgets:
        model, engine = engine_for({"stage3_param_persistence_threshold": 0, "stage3_max_reuse_distance": 0,
                                    "stage3_prefetch_bucket_size": prefetch, "stage3_max_live_parameters": max_live},
                                   preset="tiny", zerolab={"units": BLOCKS})
        seen = []   # gathered-unit bytes right after each unit's gather (and prefetch): real storage sizes
        hooks = [b.register_forward_pre_hook(lambda *_: seen.append(engine.memory().buffers)) for b in model.blocks]
        for step in range(2):
            x, y = synthetic_batch(model, 2 * n, seed=3, step=step, rank=rank, world_size=n)
            engine.backward(loss_fn(engine(x), y))
            engine.step()
        for h in hooks:
            h.remove()
        out.append((engine.peak_live_elements, max(seen), {u.name: u.padded for u in engine.flat.units}))
    return out


def test_max_live_parameters_bounds_the_gathered_units():
    budgets = [(0, 10**9), (10**9, None), (10**9, 1000), (10**9, 10**9), ("block", 10**9)]  # None: rest + 2 blocks
    n = 2
    units = zl.launch(live_worker, world_size=n, args=([(0, 10**9)],), threads=1)[0][0][2]
    rest, block = units["rest"], units["blocks.0"]
    budgets = [(block if p == "block" else p, rest + 2 * block + (m if m == 1000 else 0) if m in (None, 1000) else m)
               for p, m in budgets]
    # rest (embeddings + head) is live through the forward; each block joins it while it computes.
    # Prefetch adds whole units, in order, while they fit both budgets.
    predicted = [rest + block, rest + 2 * block, rest + 2 * block, sum(units.values()), rest + 2 * block]
    for rank_results in zl.launch(live_worker, world_size=n, args=(budgets,), timeout=120, threads=1):
        for (prefetch, max_live), want, (peak, seen, _) in zip(budgets, predicted, rank_results):
            assert peak == want, (prefetch, max_live, peak, want)
            assert seen == want * 4, (prefetch, max_live, seen, want)   # fp32 bytes really allocated


def gathered_worker(debug):
    rank = dist.get_rank()
    model, engine = engine_for({"stage3_param_persistence_threshold": 0}, zerolab={"debug": debug})
    full = engine.full_state_dict()
    head = model.blocks[1].fc.weight
    out = {"empty": tuple(head.shape)}
    with zl.gathered_parameters(engine, model.blocks[1]):
        out["read"] = torch.equal(head.detach().float(), full["blocks.1.fc.weight"])
    with zl.gathered_parameters(engine, [model.blocks[1].fc], modifier_rank=1):
        with torch.no_grad():
            head.fill_(0.25 if rank == 1 else -1.0)    # only rank 1's edit counts
    out["after"] = engine.full_state_dict()["blocks.1.fc.weight"].unique().tolist()
    x, y = synthetic_batch(model, 4, seed=3, rank=rank, world_size=2)
    engine.backward(loss_fn(engine(x), y))   # trains on from the edited weights
    engine.step()
    try:
        head.sum()
        out["error"] = ""
    except RuntimeError as e:
        out["error"] = str(e)
    return out


@pytest.mark.parametrize("debug", [False, True])
def test_gathered_parameters_and_debug_guard(debug):
    for r in zl.launch(gathered_worker, world_size=2, args=(debug,), threads=1):
        assert r["empty"] == (0,) and r["read"] and r["after"] == [0.25]
        if debug:
            assert "blocks.1.fc.weight" in r["error"] and "zl.gathered_parameters" in r["error"]
        else:
            assert r["error"] == ""   # an empty tensor, as in DeepSpeed: sums to 0


def timeline_worker(prefetch):
    rank = dist.get_rank()
    model, engine = engine_for({"stage3_param_persistence_threshold": 0, "stage3_max_reuse_distance": 0,
                                "stage3_prefetch_bucket_size": prefetch}, zerolab={"trace": True, "units": BLOCKS})
    for step in range(2):
        engine.events.clear()
        x, y = synthetic_batch(model, 4, seed=3, step=step, rank=rank, world_size=2)
        engine.backward(loss_fn(engine(x), y))
        engine.step()
    return [(name, i) for name, i, _ in engine.events]


def test_prefetch_issues_the_next_unit_before_it_is_needed():
    off, on = (zl.launch(timeline_worker, world_size=2, args=(p,), threads=1)[0] for p in (0, 10**9))
    blocks = sorted({i for name, i in on if name == "unit-fwd-start"})
    assert len(blocks) == 2
    for i in blocks:   # no prefetch: each unit gathered for forward, released, gathered for backward, released
        assert [name for name, j in off if j == i and name in ("gather-issued", "release")] == \
            ["gather-issued", "release"] * 2
    # prefetch with a window covering the whole step: every next use is seen, nothing released until the end
    assert [name for name, j in on if j == blocks[0] and name in ("gather-issued", "release")] == \
        ["gather-issued", "release"]
    first, second = blocks
    # prefetch on: the second block's all-gather goes out before the first block computes
    assert on.index(("gather-issued", second)) < on.index(("unit-fwd-start", first))
    assert off.index(("gather-issued", second)) > off.index(("unit-fwd-end", first))
    # no prefetch: the first block's backward gather waits until the second block's backward is done
    last = lambda ev, name, i: max(k for k, e in enumerate(ev) if e == (name, i))
    assert last(off, "gather-issued", first) > last(off, "unit-bwd-end", second)


def window_worker():
    rank = dist.get_rank()
    model, engine = engine_for({"stage3_param_persistence_threshold": 0, "stage3_max_reuse_distance": 0,
                                "stage3_prefetch_bucket_size": 1}, preset="tiny",
                               zerolab={"trace": True, "units": BLOCKS})
    block = engine.flat.units[1].padded
    engine.prefetch_elements = block   # one block ahead
    for step in range(2):
        engine.events.clear()
        x, y = synthetic_batch(model, 4, seed=3, step=step, rank=rank, world_size=2)
        engine.backward(loss_fn(engine(x), y))
        engine.step()
    return [(name, i) for name, i, _ in engine.events], [u.name for u in engine.flat.units]


def test_prefetch_one_block_ahead_in_forward_and_backward():
    ev, names = zl.launch(window_worker, world_size=2, threads=1)[0]
    b = [names.index(f"blocks.{k}") for k in range(4)]
    for k in range(3):   # forward: block k+1's gather is issued once block k starts, before it computes
        assert ev.index(("gather-done", b[k])) < ev.index(("gather-issued", b[k + 1])) < ev.index(("unit-fwd-start", b[k]))
    # the last block's backward use is beyond a one-block window (rest comes first): released, gathered again
    assert [n for n, i in ev if i == b[3] and n in ("gather-issued", "release")] == ["gather-issued", "release"] * 2
    # backward: block k-1 is gathered again while block k computes its backward
    last = lambda name, i: max(k for k, e in enumerate(ev) if e == (name, i))
    for k in (3, 2, 1):
        assert last("gather-done", b[k]) < last("gather-issued", b[k - 1]) < last("unit-bwd-end", b[k])


def test_timeline_spans_pair_events_into_lanes():
    from zerolab.engine import events as ev
    events = [("gather-issued", 1, 0.0), ("gather-issued", 2, 0.1), ("gather-done", 1, 0.2),
              ("unit-fwd-start", 1, 0.2), ("gather-done", 2, 0.3), ("unit-fwd-end", 1, 0.5), ("release", 1, 0.5),
              ("reduce-issued", 0, 0.6), ("backward-end", -1, 0.7), ("reduce-done", 0, 0.8)]
    assert ev.spans(events) == [("all-gather", 0.0, 0.2, "all-gather"), ("all-gather", 0.1, 0.3, "all-gather"),
                                      ("forward", 0.2, 0.5, "compute"), ("reduce-scatter", 0.6, 0.8, "reduce-scatter")]
    rows, labels = ev.lanes([events, []])
    assert labels == ["rank 0 compute", "rank 0 all-gather", "rank 0 reduce-scatter",
                      "rank 1 compute", "rank 1 all-gather", "rank 1 reduce-scatter"]
    assert rows[0] == [("forward", 0.2, 0.5)] and rows[3:] == [[], [], []]
