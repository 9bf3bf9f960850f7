"""The engine's surface: clear errors at initialize, buffers and frozen params from rank 0,
single-process use, state dict names, schedules (issue 4, items 5-6)."""
from __future__ import annotations

import math

import pytest
import torch
import torch.distributed as dist
from torch import nn

import zerolab as zl
from zerolab.engine.flat import find_units
from zerolab.engine.buckets import group_units
from zerolab.engine.optim import WarmupDecayLR, WarmupLR
from zerolab.book.models import MLP, TinyGPT, loss_fn, synthetic_batch

ADAM = {"optimizer": {"type": "Adam", "params": {"lr": 1e-3}}}


@pytest.mark.parametrize("extra, match", [
    ({"zero_optimization": {"stage": 2, "offload_param": {"device": "cpu"}}}, "offload_param"),
    ({"zero_optimization": {"stage": 0, "offload_optimizer": {"device": "cpu"}}}, "offload_optimizer"),
    ({"zero_optimization": {"stage": 1, "zero_quantized_gradients": True}}, "ZeRO\\+\\+"),
    ({"optimizer": {"type": "Adam", "params": {"lr": 1e-3, "amsgrad": True}}}, "amsgrad"),
])
def test_unsupported_config_is_refused_before_touching_the_model(extra, match):
    model = MLP(seed=0)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with pytest.raises((zl.ConfigError, ValueError), match=match):
        zl.initialize(model, {**ADAM, **extra})
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())
    assert all(p.grad is None for p in model.parameters())


@pytest.mark.parametrize("model, match", [
    (nn.Sequential(nn.Embedding(10, 4, sparse=True), nn.Linear(4, 2)), "sparse"),
    (nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 2).double()), "one floating dtype"),
    (nn.Linear(4, 2).requires_grad_(False), "no trainable parameters"),
])
def test_unsupported_models_are_refused(model, match):
    with pytest.raises(ValueError, match=match):
        zl.initialize(model, ADAM)


def test_a_model_cannot_be_wrapped_twice():
    model = MLP(seed=0)
    zl.initialize(model, ADAM)
    with pytest.raises(ValueError, match="already wrapped"):
        zl.initialize(model, ADAM)


def test_single_process_without_torch_distributed_matches_torch_optim():
    assert not dist.is_initialized()
    model, ref = MLP(seed=4), MLP(seed=4)
    engine = zl.initialize(model, {"optimizer": {"type": "SGD", "params": {"lr": 0.1, "momentum": 0.9}},
                                   "gradient_clipping": 0.1, "zero_optimization": {"stage": 2}})
    opt = torch.optim.SGD(ref.parameters(), lr=0.1, momentum=0.9)
    for step in range(3):
        x, y = synthetic_batch(model, 8, step=step)
        engine.backward(loss_fn(engine(x), y))
        engine.step()
        opt.zero_grad()
        loss_fn(ref(x), y).backward()
        torch.nn.utils.clip_grad_norm_(ref.parameters(), 0.1)
        opt.step()
    sd = engine.full_state_dict()
    for k, v in ref.state_dict().items():
        torch.testing.assert_close(sd[k], v, rtol=1e-5, atol=1e-6)
    assert engine.comm.total_bytes() == 0 and engine.global_steps == 3


def test_units_tied_weights_and_state_dict_names():
    model = TinyGPT.preset("micro", seed=0)
    # units: the blocks, plus every other module that directly owns parameters ("rest": the root's own)
    assert [name for name, _ in find_units(model)] == ["rest", "wte", "wpe", "blocks.0", "blocks.1", "ln_f", "head"]
    assert [name for name, _ in find_units(model, ["Block"])] == ["rest", "blocks.0", "blocks.1"]  # a wrap policy
    engine = zl.initialize(model, ADAM)
    # the tied embedding/head weight belongs to one unit, above both its users: the root's ("rest")
    assert [u.name for u in engine.flat.units] == ["rest", "wpe", "blocks.0", "blocks.1", "ln_f"]
    owners = [u.name for u in engine.flat.units for _, p in u.params if p is model.wte.weight]
    assert owners == ["rest"]
    assert engine.flat.numel == sum(p.numel() for p in model.parameters())  # counted once
    sd = engine.full_state_dict()
    assert list(sd) == list(model.state_dict())  # the model's own names, tied ones included
    assert torch.equal(sd["wte.weight"], sd["head.weight"])


def test_buckets_never_split_a_unit_and_follow_backward_order():
    model = MLP(depth=4, seed=0)
    engine = zl.initialize(model, ADAM)
    units = engine.flat.units
    buckets = group_units(units, 2 * max(u.padded for u in units))
    assert [u.name for b in reversed(buckets) for u in b] == [u.name for u in units]
    assert all(b[i].offset + b[i].padded == b[i + 1].offset for b in buckets for i in range(len(b) - 1))
    assert [u.name for u in buckets[0]][-1] == units[-1].name  # the last unit (first in backward) first


def broadcast_worker():
    rank = dist.get_rank()
    model = MLP(frozen=True, buffer=True, seed=rank)  # every rank starts different
    engine = zl.initialize(model, {**ADAM, "zero_optimization": {"stage": 1}})
    x, y = synthetic_batch(model, 6, rank=rank, world_size=3)
    engine.backward(loss_fn(engine(x), y))
    engine.step()
    return {k: v.clone() for k, v in engine.full_state_dict().items()}, model.unused.grad if hasattr(model, "unused") else None


def test_params_frozen_params_and_buffers_come_from_rank_0():
    results = zl.launch(broadcast_worker, world_size=3, threads=1)
    want = MLP(frozen=True, buffer=True, seed=0).state_dict()
    for sd, _ in results:
        assert torch.equal(sd["offset"], want["offset"])                    # buffer
        assert torch.equal(sd["blocks.0.scale"], want["blocks.0.scale"])    # frozen, never updated
        for k in sd:
            assert torch.equal(sd[k], results[0][0][k])


def test_unused_parameter_gets_a_zero_gradient_and_stays_put():
    model = MLP(unused=True, seed=0)
    before = model.unused.detach().clone()
    engine = zl.initialize(model, {"optimizer": {"type": "Adam", "params": {"lr": 0.1}},
                                   "zero_optimization": {"stage": 0}})
    x, y = synthetic_batch(model, 4)
    engine.backward(loss_fn(engine(x), y))
    assert torch.equal(model.unused.grad, torch.zeros(7))
    engine.step()
    assert torch.equal(model.unused.detach(), before)


def test_schedules_follow_deepspeed():
    """lr(t): the rate of the step taken after t steps; DeepSpeed's first two steps both run at the
    minimum (its scheduler starts at iteration -1 and the log/linear warm-up is 0 at iteration 0)."""
    w = WarmupLR(warmup_min_lr=0.0, warmup_max_lr=1.0, warmup_num_steps=10)
    assert w.lr(0) == 0.0 and w.lr(1) == 0.0 and w.lr(11) == 1.0 and w.lr(50) == 1.0
    assert math.isclose(w.lr(5), math.log(5) / math.log(10))
    d = WarmupDecayLR(total_num_steps=20, warmup_min_lr=0.1, warmup_max_lr=1.1, warmup_num_steps=10,
                      warmup_type="linear")
    assert math.isclose(d.lr(6), 0.6) and math.isclose(d.lr(11), 1.1) and math.isclose(d.lr(16), 0.6)
    assert math.isclose(d.lr(21), 0.1) and math.isclose(d.lr(31), 0.1)


@pytest.mark.parametrize("kind", ["WarmupLR", "WarmupDecayLR"])
@pytest.mark.parametrize("warmup_type", ["log", "linear"])
def test_schedules_step_for_step_with_deepspeed(kind, warmup_type):
    """The rate of every optimizer step equals what DeepSpeed's own scheduler sets before that step
    (its engine builds the scheduler, then calls ``scheduler.step()`` after each optimizer step)."""
    lr_schedules = pytest.importorskip("deepspeed.runtime.lr_schedules")
    params = {"warmup_min_lr": 0.01, "warmup_max_lr": 0.5, "warmup_num_steps": 4, "warmup_type": warmup_type}
    if kind == "WarmupDecayLR":
        params["total_num_steps"] = 9
    opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=1.0)
    theirs, ds = [], getattr(lr_schedules, kind)(opt, **params)
    for _ in range(12):
        theirs.append(opt.param_groups[0]["lr"])
        ds.step()
    ours = {"WarmupLR": WarmupLR, "WarmupDecayLR": WarmupDecayLR}[kind](**params)
    assert [ours.lr(t) for t in range(12)] == pytest.approx(theirs, abs=1e-12)


def test_scheduler_drives_the_engine_lr():
    model = MLP(seed=0)
    engine = zl.initialize(model, {"optimizer": {"type": "SGD", "params": {"lr": 5.0}},
                                   "scheduler": {"type": "WarmupLR", "params": {
                                       "warmup_min_lr": 0.0, "warmup_max_lr": 0.2, "warmup_num_steps": 4,
                                       "warmup_type": "linear"}}})
    lrs = []
    for step in range(6):
        lrs.append(engine.get_lr())
        x, y = synthetic_batch(model, 4, step=step)
        engine.backward(loss_fn(engine(x), y))
        engine.step()
    assert lrs == pytest.approx([0.0, 0.0, 0.05, 0.1, 0.15, 0.2])   # DeepSpeed's: the first two at the minimum


def test_gathered_parameters_is_a_no_op_below_stage_3():
    model = MLP(seed=0)
    engine = zl.initialize(model, ADAM)
    with zl.gathered_parameters(engine, model.head):
        assert model.head.weight.shape == (4, 32)


def overlap_worker(stage, overlap):
    rank = dist.get_rank()
    model = TinyGPT.preset("micro", seed=0)
    engine = zl.initialize(model, {**ADAM, "zero_optimization": {"stage": stage, "overlap_comm": overlap,
                                                                 "reduce_bucket_size": 100},
                                   "zerolab": {"trace": True}})
    x, y = synthetic_batch(model, 4, rank=rank, world_size=2)
    engine.backward(loss_fn(engine(x), y))
    engine.step()
    return [(name, i) for name, i, _ in engine.events]


@pytest.mark.parametrize("stage", [0, 1, 2])
def test_overlap_comm_issues_buckets_during_backward(stage):
    """Buckets go out while backward still runs; with overlap_comm they complete later: in a later
    gradient hook if the backend already reports them done (Engine.finish_completed), else after
    backward ends, and always before the step."""
    on, off = (zl.launch(overlap_worker, world_size=2, args=(stage, o), threads=1)[0] for o in (True, False))
    nb = 5   # buckets of 100 elements: one per unit (rest: the tied wte/head, wpe, blocks.0, blocks.1, ln_f)
    for ev in (on, off):
        assert [i for name, i in ev if name == "reduce-issued"] == list(range(nb))  # last unit first, in order
        assert ev.index(("reduce-issued", 0)) < ev.index(("backward-end", -1))
    end = on.index(("backward-end", -1))
    assert on.index(("reduce-done", nb - 1)) > end   # the last bucket: issued by the last hook, waited for after it
    assert all(on.index(("reduce-issued", i)) < on.index(("reduce-done", i)) < on.index(("step-start", -1))
               for i in range(nb))
    assert all(off.index(("reduce-done", i)) < off.index(("reduce-issued", i + 1)) for i in range(nb - 1))  # blocking


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_two_backwards_before_one_step_sum_like_torch(stage):
    """Two losses, two engine.backward() calls, one step (accumulate.py): as loss1.backward();
    loss2.backward(); opt.step() in torch (one rank here; 2 ranks in tests/test_hf_models.py)."""
    ref = MLP(seed=0)
    opt = torch.optim.Adam(ref.parameters(), lr=1e-3)
    model = MLP(seed=0)
    engine = zl.initialize(model, {**ADAM, "zero_optimization": {"stage": stage}})
    for step in range(2):
        x1, y1 = synthetic_batch(model, 4, step=2 * step)
        x2, y2 = synthetic_batch(model, 4, step=2 * step + 1)
        engine.backward(loss_fn(engine(x1), y1))
        engine.backward(loss_fn(engine(x2), y2))
        engine.step()
        opt.zero_grad()
        loss_fn(ref(x1), y1).backward()
        loss_fn(ref(x2), y2).backward()
        opt.step()
    got = engine.full_state_dict()
    for k, v in ref.state_dict().items():
        assert torch.allclose(got[k], v, atol=1e-6, rtol=0), k


def test_loss_backward_outside_the_engine_is_refused():
    model = MLP(seed=0)
    engine = zl.initialize(model, ADAM)
    x, y = synthetic_batch(model, 4)
    with pytest.raises(RuntimeError, match="engine.backward"):
        loss_fn(engine(x), y).backward()


def test_reentrant_checkpointing_that_reuses_a_parameter_is_refused():
    import torch.utils.checkpoint as cp

    class Twice(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(4, 4)

        def forward(self, x):
            x = cp.checkpoint(self.lin, x, use_reentrant=True)
            return cp.checkpoint(self.lin, x, use_reentrant=True)

    model = Twice()
    engine = zl.initialize(model, ADAM)
    x = torch.randn(2, 4, requires_grad=True)
    with pytest.raises(RuntimeError, match="use_reentrant=False"):
        engine.backward(engine(x).sum())


def test_parameters_sharing_memory_are_refused():
    model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4))
    model[1].weight = nn.Parameter(model[0].weight.data[:, :])  # a second Parameter over the same memory
    with pytest.raises(ValueError, match="shares memory"):
        zl.initialize(model, ADAM)


def test_a_skipped_fp16_step_counts_in_global_steps_as_in_deepspeed():
    """DeepSpeed's engine advances global_steps on an overflow-skipped step too (its checkpoint tags
    and logs count it); skipped_steps says how many were skipped."""
    model = MLP(seed=0)
    engine = zl.initialize(model, {"optimizer": {"type": "SGD", "params": {"lr": 0.1}},
                                   "fp16": {"enabled": True, "initial_scale_power": 4}})
    x, y = synthetic_batch(model, 4)
    engine.backward(loss_fn(engine(x), y) * float("inf"))   # overflow: the step is skipped
    engine.step()
    engine.backward(loss_fn(engine(x), y))
    engine.step()
    assert (engine.global_steps, engine.skipped_steps, engine.optimizer.step_count) == (2, 1, 1)
