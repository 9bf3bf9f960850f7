"""bf16 / fp16 engines vs a single-process fp32-master reference; the fp16 loss scaler (issue 4, items 4 and 6)."""
from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

import zerolab as zl
from zerolab.engine.precision import DynamicLossScaler
from zerolab.book.models import MLP, TinyGPT, loss_fn, synthetic_batch

STEPS, MBS, LR = 4, 2, 1e-3
DT = {"bf16": torch.bfloat16, "fp16": torch.float16}


def make_model(kind):
    return TinyGPT.preset("micro", key_bias=False, seed=1) if kind == "gpt" else MLP(depth=3, seed=3)


def config(stage, prec, gas=2, clip=0.5, fp32_grads=False):
    cfg = {"optimizer": {"type": "Adam", "params": {"lr": LR}}, "gradient_accumulation_steps": gas,
           "gradient_clipping": clip, "zero_optimization": {"stage": stage, "reduce_bucket_size": 3000}}
    if prec == "fp16":
        cfg["fp16"] = {"enabled": True, "initial_scale_power": 8}
    else:
        cfg["bf16"] = {"enabled": True}
    if fp32_grads:
        cfg["data_types"] = {"grad_accum_dtype": "fp32"}
    return cfg


def fp32_master_reference(kind, prec, n, gas, clip):
    """One process: 16-bit model, fp32 master weights and torch.optim.Adam on them."""
    model = make_model(kind).to(DT[prec])
    params = [p for p in model.parameters()]
    master = [p.detach().float().clone().requires_grad_() for p in params]
    opt = torch.optim.Adam(master, lr=LR)
    for step in range(STEPS):
        x, y = synthetic_batch(model, n * gas * MBS, seed=7, step=step)
        x = x.to(DT[prec]) if x.is_floating_point() else x
        model.zero_grad()
        loss_fn(model(x), y).backward()
        for m, p in zip(master, params):
            m.grad = p.grad.float()
        torch.nn.utils.clip_grad_norm_(master, clip)
        opt.step()
        with torch.no_grad():
            for m, p in zip(master, params):
                p.copy_(m)
    names = [n for n, _ in model.named_parameters()]
    return dict(zip(names, master))


def run_cases(cases):
    rank, n = dist.get_rank(), dist.get_world_size()
    out = []
    for kind, cfg in cases:
        model = make_model(kind)
        engine = zl.initialize(model, cfg)
        for step in range(STEPS):
            for k in range(engine.gas):
                x, y = synthetic_batch(model, n * engine.gas * MBS, seed=7, step=step)
                lo = (k * n + rank) * MBS
                engine.backward(loss_fn(engine(x[lo: lo + MBS]), y[lo: lo + MBS]))
                engine.step()
        out.append((engine.full_state_dict(), engine.skipped_steps, str(engine.flat.flat.dtype)))
    return out


@pytest.mark.parametrize("n", [2, 3])
def test_mixed_precision_matches_fp32_master_reference(n):
    cases = [(kind, config(stage, prec, fp32_grads=fg))
             for stage in (0, 1, 2) for kind, prec, fg in
             [("gpt", "bf16", False), ("mlp", "fp16", False), ("gpt", "fp16", True), ("mlp", "bf16", True)]]
    results = zl.launch(run_cases, world_size=n, args=(cases,), timeout=300, threads=1)
    for ci, (kind, cfg) in enumerate(cases):
        prec = "fp16" if "fp16" in cfg else "bf16"
        sd, skipped, dtype = results[0][ci]
        assert skipped == 0 and dtype == str(DT[prec]), (cfg, skipped, dtype)
        want = fp32_master_reference(kind, prec, n, 2, 0.5)
        for name, w in want.items():
            torch.testing.assert_close(sd[name], w.detach(), rtol=0, atol=2 * LR * STEPS,
                                       msg=lambda m: f"n={n} {kind} {cfg} {name}: {m}")
        for r in range(1, n):
            for name in want:
                assert torch.equal(results[r][ci][0][name], sd[name]), (n, r, cfg, name)


def overflow_on_one_rank(stage):
    """fp16, hysteresis 1: rank 1 alone sees an inf in its gradients at step 1."""
    rank, n = dist.get_rank(), dist.get_world_size()
    cfg = {"optimizer": {"type": "Adam", "params": {"lr": LR}}, "zero_optimization": {"stage": stage},
           "fp16": {"enabled": True, "initial_scale_power": 10, "hysteresis": 1, "loss_scale_window": 2}}
    model = MLP(depth=3, seed=3)
    engine = zl.initialize(model, cfg)
    scales, changed = [], []
    for step in range(4):
        x, y = synthetic_batch(model, n * MBS, seed=7, step=step, rank=rank, world_size=n)
        engine.backward(loss_fn(engine(x), y))
        if step == 1 and rank == 1:
            engine.owned_grads()[-1][0] = float("inf")  # an element of rank 1's own shard only
        before = engine.full_state_dict()
        engine.step()
        after = engine.full_state_dict()
        changed.append(any(not torch.equal(before[k], after[k]) for k in before))
        scales.append(engine.loss_scale)
    return engine.skipped_steps, scales, changed, {k: v.sum().item() for k, v in engine.full_state_dict().items()}


@pytest.mark.parametrize("stage", [0, 1, 2])
def test_fp16_overflow_on_one_rank_skips_everywhere(stage):
    results = zl.launch(overflow_on_one_rank, world_size=3, args=(stage,), timeout=120, threads=1)
    for skipped, scales, changed, _ in results:
        assert skipped == 1
        assert changed == [True, False, True, True]
        # 1024; overflow -> 512; clean steps since the overflow: 1, 2 -> doubled at the second
        assert scales == [1024.0, 512.0, 512.0, 1024.0]
    assert results[0][3] == results[1][3] == results[2][3]


def test_dynamic_loss_scaler_follows_deepspeed():
    s = DynamicLossScaler(initial_scale_power=4, loss_scale_window=3, hysteresis=2, min_loss_scale=2)
    seen = []
    for overflow in [False, False, True, True, False, False, False, True, True, True, True]:
        s.update(overflow)
        seen.append(s.scale)
    # window 3 counts from iteration 0 / the last overflow; hysteresis 2: the first overflow of a run
    # only spends hysteresis, later ones halve; hysteresis is restored when the scale grows
    assert seen == [16, 16, 16, 8, 8, 8, 16, 16, 8, 4, 2]
    static = DynamicLossScaler(loss_scale=128)
    static.update(True)
    assert static.scale == 128
