"""``engine.backward(loss, allreduce_gradients=False)`` and ``engine.allreduce_gradients()`` (DeepSpeed's
names): at the accumulation boundary the gradients stay this rank's own until the caller reduces them,
so it can change them first -- what the pipeline does for a weight tied across stages (parallel/pipeline_run.py).

Checked on two ranks, stages 0 and 1: deferring then reducing trains bit-identically to the plain backward;
what is written into ``engine.local_grad(p)`` before the reduction is what gets reduced; a step without the
reduction, a second reduction, and stages that keep no whole local gradient are refused by name.
"""
from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

import zerolab as zl
from zerolab.book.models import MLP, loss_fn, synthetic_batch

GAS, MBS, STEPS = 2, 4, 3


def config(stage):
    return {"optimizer": {"type": "SGD", "params": {"lr": 0.1}}, "gradient_accumulation_steps": GAS,
            "zero_optimization": {"stage": stage, "reduce_bucket_size": 300}}


def run(stage, mode):
    """mode: "plain" | "deferred" | "written" (rank r writes r + 1 into the first weight's local
    gradient before reducing: the step must see the ranks' mean, 1.5)."""
    rank, n = dist.get_rank(), dist.get_world_size()
    model = MLP(depth=3, seed=2)
    engine = zl.initialize(model, config(stage))
    first = next(model.parameters())
    seen = []
    for step in range(STEPS):
        x, y = synthetic_batch(model, n * GAS * MBS, seed=5, step=step)
        for k in range(GAS):
            lo = (k * n + rank) * MBS
            loss = loss_fn(engine(x[lo: lo + MBS]), y[lo: lo + MBS])
            if mode == "plain" or not engine.is_gradient_accumulation_boundary():
                engine.backward(loss)
            else:
                engine.backward(loss, allreduce_gradients=False)
                seen.append(engine.local_grad(first).clone())   # this rank's own sum, not reduced
                if mode == "written":
                    engine.local_grad(first).fill_(rank + 1.0)
                engine.allreduce_gradients()
            engine.step()
    return engine.full_state_dict(), seen


def ranks(stages):
    out = {}
    for stage in stages:
        for mode in ("plain", "deferred", "written"):
            out[(stage, mode)] = run(stage, mode)
    return out


def refusals():
    rank = dist.get_rank()
    errors = {}
    model = MLP(depth=2, seed=2)
    engine = zl.initialize(model, config(1))
    x, y = synthetic_batch(model, 8, seed=5)
    engine.backward(loss_fn(engine(x), y))                 # not the boundary: nothing to defer
    engine.step()
    engine.backward(loss_fn(engine(x), y), allreduce_gradients=False)
    try:
        engine.step()
    except RuntimeError as e:
        errors["step"] = str(e)
    engine.allreduce_gradients()
    try:
        engine.allreduce_gradients()
    except RuntimeError as e:
        errors["twice"] = str(e)
    engine.step()
    model2 = MLP(depth=2, seed=2)
    e2 = zl.initialize(model2, config(2))
    try:
        e2.backward(loss_fn(e2(x), y), allreduce_gradients=False)
    except ValueError as e:
        errors["stage2"] = str(e)
    try:
        e2.local_grad(next(model2.parameters()))
    except ValueError as e:
        errors["local_grad"] = str(e)
    return errors if rank == 0 else None


@pytest.fixture(scope="module")
def results():
    return zl.launch(ranks, world_size=2, args=((0, 1),), timeout=300, threads=1)


@pytest.mark.parametrize("stage", [0, 1])
def test_deferred_reduction_trains_like_the_plain_backward(results, stage):
    plain, _ = results[0][(stage, "plain")]
    deferred, seen = results[0][(stage, "deferred")]
    for name in plain:
        assert torch.equal(plain[name], deferred[name]), name
    # what was seen before the reduction is each rank's own gradient: the two ranks' differ
    _, seen1 = results[1][(stage, "deferred")]
    assert len(seen) == STEPS and not torch.equal(seen[0], seen1[0])


@pytest.mark.parametrize("stage", [0, 1])
def test_what_is_written_before_the_reduction_is_what_is_reduced(results, stage):
    """Plain SGD: the first weight moves by lr x the ranks' mean of what they wrote, every step. Had the
    reduction run before the write, each rank would step by its own value (rank 0: 1.0)."""
    written, _ = results[0][(stage, "written")]
    first = next(iter(written))
    init = MLP(depth=3, seed=2).state_dict()[first]
    torch.testing.assert_close(written[first], init - STEPS * 0.1 * 1.5, rtol=0, atol=1e-6)


def test_refusals_name_the_problem():
    errors = zl.launch(refusals, world_size=2, timeout=120, threads=1)[0]
    assert "allreduce_gradients()" in errors["step"]
    assert "allreduce_gradients" in errors["twice"] and "backward" in errors["twice"]
    assert "stage 2" in errors["stage2"] and "allreduce_gradients=False" in errors["stage2"]
    assert "stage 2" in errors["local_grad"]
