"""Stages 1-2's collectives per backend (``zerolab.collectives``, engine/stage1.py; chapter 4), and stage 2
reducing unit by unit (engine/stage2.py; chapter 5).

gloo's "per_backend" pair is an all-reduce of the gradients and one broadcast per rank and unit of the
updated parameters; the ring pair (NCCL's) is reduce-scatter + all-gather. Both must reach the
same parameters (tests/test_engine_equivalence.py runs both against single-process training), the
ledger must book what each sends, and a broadcast that misses a rank's shard must be caught.
"""
from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

import zerolab as zl
from zerolab.book.models import TinyGPT, loss_fn, synthetic_batch
from zerolab.engine.collectives import pick_collectives
from zerolab.engine.stage1 import Stage1Engine

import test_engine_equivalence as eq


def test_auto_picks_all_reduce_on_gloo_only():
    assert pick_collectives("per_backend", "gloo") == "all_reduce"
    assert pick_collectives("per_backend", "nccl") == "reduce_scatter"
    assert pick_collectives("per_backend", "local") == "reduce_scatter"
    assert pick_collectives("reduce_scatter", "gloo") == "reduce_scatter"
    assert pick_collectives("all_reduce", "nccl") == "all_reduce"


def test_bad_collectives_value_is_named():
    with pytest.raises(zl.ConfigError, match=r"zerolab.collectives: 'ring' is not allowed.*'all_reduce'"):
        zl.Config.from_deepspeed({"zerolab": {"collectives": "ring"}})


def ledger_worker(cases):
    rank, n = dist.get_rank(), dist.get_world_size()
    out = []
    for stage, gas, collectives in cases:
        model = TinyGPT.preset("micro", seed=1)
        engine = zl.initialize(model, {"optimizer": {"type": "SGD", "params": {"lr": 1e-2}},
                                       "gradient_accumulation_steps": gas, "zerolab": {"collectives": collectives},
                                       "zero_optimization": {"stage": stage, "reduce_bucket_size": 1500,
                                                             "allgather_bucket_size": 1500}})
        engine.comm.reset()
        for k in range(gas):
            x, y = synthetic_batch(model, 2 * n * gas, seed=3, step=k, rank=rank, world_size=n)
            engine.backward(loss_fn(engine(x), y))
            engine.step()
        out.append(([(r.op, r.bytes) for r in engine.comm.records], engine.flat.padded, len(engine.flat.units),
                    len(engine.buckets), engine.grad_collective, engine.param_collective))
    return out


@pytest.mark.parametrize("n", [2, 3])
def test_gloo_pair_ledger_books_all_reduce_and_broadcasts(n):
    """per_backend on gloo: 2Ψ(N-1)/N all-reduced per reduction round, and each rank sends (N-1) of the N
    broadcasts of every unit's shard, (N-1)/N of Ψ in all: 1.5x the ring pair's algorithm bytes."""
    cases = [(1, 1, "per_backend"), (1, 2, "per_backend"), (1, 1, "reduce_scatter")]
    for rank_results in zl.launch(ledger_worker, world_size=n, args=(cases,), threads=1):
        for (stage, gas, collectives), (recs, padded, units, buckets, gop, pop) in zip(cases, rank_results):
            by_op = {}
            for op, nbytes in recs:
                by_op[op] = by_op.get(op, 0) + nbytes
            if collectives == "per_backend":
                assert (gop, pop) == ("all_reduce", "broadcast")
                assert by_op == {"all_reduce": 2 * 4 * padded * (n - 1) // n,
                                 "broadcast": 4 * padded * (n - 1) // n}, (stage, gas, by_op)
                assert sum(op == "broadcast" for op, _ in recs) == n * units   # one per rank and unit
                assert sum(op == "all_reduce" for op, _ in recs) == buckets    # one per bucket, in place
            else:
                assert (gop, pop) == ("reduce_scatter", "all_gather")
                assert sum(by_op.values()) == zl.comm_volume(padded, n, stage, 4, gas)


def sgd_case(stage: int) -> dict:
    return {"model": "gpt", "config": {"optimizer": {"type": "SGD", "params": {"lr": 0.1}},
                                       "zero_optimization": {"stage": stage}}}


def assert_plant_is_caught(monkeypatch, cls, name, planted, case, n=2):
    """Against single-process training the engine passes as it is and fails with ``cls.name = planted``."""
    want = eq.reference(case, n)
    for plant in (False, True):
        if plant:
            monkeypatch.setattr(cls, name, planted)
        got = zl.launch(eq.run_cases, world_size=n, args=([case],), threads=1)[0][0]
        close = all(torch.allclose(got[k], want[k].float(), rtol=1e-4, atol=1e-5) for k in want)
        assert close != plant, plant


def test_planted_broadcast_that_skips_a_shard_is_caught(monkeypatch):
    """Plant the bug: the last rank never broadcasts its shard (the others keep stale values).
    The single-process comparison must fail with it and pass without."""
    real = Stage1Engine._issue_gather

    def planted(self, i):
        comm, bc = self.communicator, self.communicator.broadcast

        def skip_last(tensor, src=0, async_op=False, tag=""):
            if src == self.world_size - 1:
                tensor = tensor.clone()   # received into a copy: the flat buffer keeps its stale shard
            return bc(tensor, src=src, async_op=async_op, tag=tag)
        comm.broadcast = skip_last
        try:
            real(self, i)
        finally:
            del comm.broadcast
    assert_plant_is_caught(monkeypatch, Stage1Engine, "_issue_gather", planted, sgd_case(1))


def test_planted_stage2_unit_never_reduced_is_caught(monkeypatch):
    """Plant the bug: stage 2 skips one unit's collective (every rank alike, so nothing hangs): that
    unit's gradient shard stays zero. The single-process comparison must fail with it."""
    from zerolab.engine.stage2 import Stage2Engine
    real = Stage2Engine.reduce_units

    def planted(self, g):
        if g == 2:   # a block's collective
            self.staging.pop(g)
            return
        real(self, g)
    assert_plant_is_caught(monkeypatch, Stage2Engine, "reduce_units", planted, sgd_case(2))


def backward_peak(engine, model, n, rank) -> int:
    """One step; the largest grads + buffers the engine holds after any gradient hook of its backward."""
    seen = []
    for p in engine.flat.params():
        p.register_post_accumulate_grad_hook(lambda _: seen.append(engine.memory().grads + engine.memory().buffers))
    x, y = synthetic_batch(model, 2 * n, seed=3, rank=rank, world_size=n)
    engine.backward(loss_fn(engine(x), y))
    engine.step()
    return max(seen)


def peak_worker():
    """Stage 2, DeepSpeed's default bucket (the whole model), no overlap: the largest grads + buffers
    seen after any gradient hook during backward, and the full fp32 gradient's bytes."""
    from zerolab.engine.stage2 import Stage2Engine   # noqa: F401 (monkeypatched in the parent)
    rank, n = dist.get_rank(), dist.get_world_size()
    model = TinyGPT.preset("micro", seed=1)
    engine = zl.initialize(model, {"optimizer": {"type": "SGD", "params": {"lr": 1e-2}},
                                   "zero_optimization": {"stage": 2}})
    return backward_peak(engine, model, n, rank), 4 * engine.flat.padded, max(u.padded for u in engine.flat.units)


def test_stage2_holds_units_not_the_bucket_during_backward(monkeypatch):
    """With one bucket for the whole model, the gradient bytes held during backward stay below one
    full gradient (the shard plus the units being filled); staging the bucket whole (the planted
    bug, and the old design) holds the full gradient plus the shard."""
    import zerolab.engine
    from zerolab.engine.stage2 import Stage2Engine
    from zerolab.engine.whole_buckets import WholeBucketStaging
    for plant in (False, True):
        if plant:
            monkeypatch.setitem(zerolab.engine.ENGINES, 2, type("Whole", (WholeBucketStaging, Stage2Engine), {}))
        peak, full, largest = zl.launch(peak_worker, world_size=2, threads=1)[0]
        if plant:
            assert peak == full + full // 2
        else:   # shard + the tied embedding's unit (filled from first to last) + one more unit
            assert full // 2 < peak <= full // 2 + 4 * 2 * largest < full + full // 2


def overlap_peak_worker(buckets):
    """Stage 2 with overlap_comm: the largest grads + buffers held during one backward, per bucket size."""
    rank, n = dist.get_rank(), dist.get_world_size()
    out = []
    for bucket in buckets:
        model = TinyGPT.preset("micro", seed=1)
        engine = zl.initialize(model, {"optimizer": {"type": "SGD", "params": {"lr": 1e-2}},
                                       "zero_optimization": {"stage": 2, "overlap_comm": True,
                                                             "reduce_bucket_size": bucket},
                                       # gloo's reduce-scatter reports completion only when waited for
                                       "zerolab": {"collectives": "reduce_scatter"}})
        out.append(backward_peak(engine, model, n, rank))
    return out


def test_overlap_keeps_within_the_bucket_and_a_planted_unbounded_overlap_is_caught(monkeypatch):
    """With overlap_comm, reduce_bucket_size bounds what is staged or in flight (gloo's reduce-scatter
    reports completion only when waited for, so without the bound every unit stays in flight until
    backward ends)."""
    from zerolab.engine.stage2 import Stage2Engine
    for plant in (False, True):
        if plant:
            monkeypatch.setattr(Stage2Engine, "bound_in_flight", lambda self: None)
        small, big = zl.launch(overlap_peak_worker, world_size=2, args=([1, 10**9],), threads=1)[0]
        assert (small < big) != plant, (plant, small, big)


def groups_worker(cases):
    """Stage 2, one backward per case: which units share a collective, and the ledger's calls."""
    rank, n = dist.get_rank(), dist.get_world_size()
    out = []
    for collectives, bucket in cases:
        model = TinyGPT.preset("small", seed=1)
        zero = {"stage": 2} if bucket is None else {"stage": 2, "reduce_bucket_size": bucket}
        engine = zl.initialize(model, {"optimizer": {"type": "SGD", "params": {"lr": 1e-2}},
                                       "zero_optimization": zero, "zerolab": {"collectives": collectives}})
        x, y = synthetic_batch(model, 2 * n, seed=3, rank=rank, world_size=n)
        engine.comm.reset()
        engine.backward(loss_fn(engine(x), y))
        grads = [(r.op, r.bytes) for r in engine.comm.records]
        out.append(([[engine.flat.units[j].padded for j in g] for g in engine._groups],
                    [engine._bucket_of_unit[j] for j in engine._order], grads, engine.flat.padded))
    return out


def test_stage2_on_gloo_gives_small_units_no_collective_of_their_own():
    """gloo's path (all-reduce): a unit under 1/8 of the largest (TinyGPT's final norm, its position
    embedding) is all-reduced together with the next unit of its bucket: 5 calls instead of 7 for
    TinyGPT small, the same bytes. The ring pair (reduce-scatter) keeps one collective per unit,
    and so does a small unit that is the last of its bucket."""
    cases = [("per_backend", None), ("reduce_scatter", None), ("per_backend", 200_000)]
    n = 2
    for (groups, buckets, grads, padded), (collectives, bucket) in zip(
            zl.launch(groups_worker, world_size=n, args=(cases,), threads=1)[0], cases):
        sizes = [u for g in groups for u in g]
        largest = max(sizes)
        if collectives == "reduce_scatter":
            assert all(len(g) == 1 for g in groups) and len(groups) == 7
            assert [op for op, _ in grads] == ["reduce_scatter"] * 7
            continue
        assert [op for op, _ in grads] == ["all_reduce"] * len(groups)
        assert [b for _, b in grads] == [2 * 4 * sum(g) * (n - 1) // n for g in groups]   # same bytes in all
        assert sum(b for _, b in grads) == 2 * 4 * padded * (n - 1) // n
        for g in groups:            # only a small unit leads a group, and then with one more unit
            assert len(g) == 1 or (len(g) == 2 and g[0] < largest / 8 <= g[1]), groups
        if bucket is None:          # one bucket: final norm + last block, position + token embedding
            assert [len(g) for g in groups] == [2, 1, 1, 1, 2], groups
        else:                       # buckets of 200k elements: every unit in a bucket of its own
            assert len(set(buckets)) == len(buckets) and all(len(g) == 1 for g in groups), (buckets, groups)


def test_planted_group_that_keeps_only_its_first_unit_is_caught(monkeypatch):
    """Plant the bug: after a group's all-reduce only the first unit's slice reaches the gradient shard
    (the small unit's partner keeps zeros): the comparison with single-process training must fail."""
    from zerolab.engine.stage2 import Stage2Engine
    real = Stage2Engine.reduce_units

    def planted(self, g):
        js = self._groups[g]
        if len(js) > 1:
            self._groups[g] = js[:1]
            try:
                real(self, g)
            finally:
                self._groups[g] = js
            self._units_left[self._bucket_of_unit[js[0]]] -= len(js) - 1
            return
        real(self, g)
    assert_plant_is_caught(monkeypatch, Stage2Engine, "reduce_units", planted, sgd_case(2))
