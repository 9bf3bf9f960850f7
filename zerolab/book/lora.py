"""LoRA fine-tuning under ZeRO: the frozen + trainable memory split, measured (chapter 6).

A LoRA model (``models.add_lora``) is a big frozen base plus small trainable
adapters. Per rank, in mixed precision with Adam, the model states are

    stages 0-2   2·Ψ_frozen        + what the stage keeps of 16·Ψ_trainable
    stage 3      2·Ψ_frozen / N    + 16·Ψ_trainable / N

because a frozen weight has no gradient, no fp32 master copy and no optimizer
moments: only its 16-bit value. ``lora_run`` trains such a model for a few
steps at the given stages in real processes and returns what each rank's
engine holds; ``lora_rows`` sets it beside ``zl.estimate(..., frozen=...)``.
"""
from __future__ import annotations

import torch

from zerolab.book.models import TinyGPT, add_lora, loss_fn, synthetic_batch

TARGETS = ("q", "v", "fc", "out")


def lora_model(preset: str = "small", r: int = 8, targets=TARGETS, seed: int = 1, meta: bool = False):
    """TinyGPT ``preset`` with an untied head, every weight frozen, LoRA adapters of rank ``r``
    on ``targets``; on the meta device with ``meta=True`` (shapes only, for counting)."""
    if meta:
        with torch.device("meta"):
            return lora_model(preset, r, targets, seed)
    return add_lora(TinyGPT.preset(preset, tie_weights=False, seed=seed), r=r, targets=targets, seed=seed)


def counts(model) -> tuple[int, int]:
    """(Ψ_trainable, Ψ_frozen) of ``model``."""
    t = sum(p.numel() for p in model.parameters() if p.requires_grad)
    return t, sum(p.numel() for p in model.parameters()) - t


def _worker(stages, preset, r, steps, batch_per_rank):
    import torch.distributed as dist
    from zerolab.engine import initialize
    rank, n = dist.get_rank(), dist.get_world_size()
    out = {}
    for stage in stages:
        model = lora_model(preset, r)
        cfg = {"optimizer": {"type": "AdamW", "params": {"lr": 3e-3}}, "bf16": {"enabled": True},
               "zero_optimization": {"stage": stage, "stage3_param_persistence_threshold": 0}}
        engine = initialize(model, cfg)
        losses = []
        for step in range(steps):
            x, y = synthetic_batch(model, n * batch_per_rank, seed=5, step=step, rank=rank, world_size=n)
            loss = loss_fn(engine(x), y)
            engine.backward(loss)
            engine.step()
            losses.append(loss.item())
        m = engine.memory()
        out[stage] = {"params": m.params, "grads": m.grads, "optimizer": m.optimizer, "losses": losses,
                      "frozen_whole": sum(p.numel() for p in model.parameters() if not p.requires_grad)}
        engine.close()
    return out


def lora_run(stages=(2, 3), world_size: int = 2, preset: str = "small", r: int = 8, steps: int = 3,
             batch_per_rank: int = 2) -> list:
    """Per rank: {stage: {"params", "grads", "optimizer": bytes the engine holds after ``steps``
    steps, "losses": [...]}} — a LoRA model trained in ``world_size`` real processes, bf16 + AdamW."""
    from zerolab.runtime.launch import launch
    return launch(_worker, world_size=world_size, args=(tuple(stages), preset, r, steps, batch_per_rank),
                     timeout=600)


def lora_rows(results, psi_trainable: int, psi_frozen: int, world_size: int) -> list[dict]:
    """One row per stage: rank 0's measured bytes beside ``zl.estimate(..., frozen=Ψ_frozen)``."""
    from zerolab.theory.memory import estimate
    rows = []
    for stage, m in results[0].items():
        est = estimate(psi_trainable, world_size, stage, "mixed", "adamw", frozen=psi_frozen)
        rows.append({"stage": stage, "params": m["params"], "params_model": est.params,
                     "frozen_model": est.frozen_params, "grads": m["grads"], "grads_model": est.grads,
                     "optimizer": m["optimizer"], "optimizer_model": est.optimizer,
                     "total": m["params"] + m["grads"] + m["optimizer"], "total_model": est.total})
    return rows
