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
        fz = getattr(engine, "frozen_shard", None)   # stage 3: the shard; stages 0-2: the whole tensors
        frozen = fz.untyped_storage().nbytes() if fz is not None else \
            sum(p.untyped_storage().nbytes() for p in model.parameters() if not p.requires_grad)
        out[stage] = {"params": m.params, "grads": m.grads, "optimizer": m.optimizer, "losses": losses,
                      "frozen": frozen}
        engine.close()
    return out


def lora_run(stages=(2, 3), world_size: int = 2, preset: str = "small", r: int = 8, steps: int = 3,
             batch_per_rank: int = 2) -> list:
    """Per rank: {stage: {"params", "grads", "optimizer": bytes the engine holds after ``steps``
    steps, "frozen": of "params", the frozen weights' bytes, "losses": [...]}} — a LoRA model trained in ``world_size`` real processes, bf16 + AdamW."""
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
                     "frozen": m["frozen"], "frozen_model": est.frozen_params, "grads": m["grads"], "grads_model": est.grads,
                     "optimizer": m["optimizer"], "optimizer_model": est.optimizer,
                     "total": m["params"] + m["grads"] + m["optimizer"], "total_model": est.total})
    return rows


def lora_figure(rows, title: str = "A LoRA model's bytes per rank, measured"):
    """Stacked bars, one per stage: frozen weights, trainable weights, gradients, optimizer state
    (rank 0's measured bytes; a tick marks the model's total). Returns ``(fig, alt)``."""
    from matplotlib.figure import Figure
    fig = Figure(figsize=(6.4, 3.2))
    ax = fig.add_subplot()
    parts = [("frozen weights", "frozen", "#9aa5b1"), ("trainable weights", None, "#4c78a8"),
             ("gradients", "grads", "#f58518"), ("optimizer state", "optimizer", "#54a24b")]
    labels = [f"ZeRO-{r['stage']}" for r in rows]
    bottom = [0.0] * len(rows)
    for name, key, color in parts:
        if key is None:
            vals = [r["params"] - r["frozen"] for r in rows]
        else:
            vals = [r[key] for r in rows]
        ax.barh(labels, [v / 1e6 for v in vals], left=[b / 1e6 for b in bottom], color=color, label=name)
        bottom = [b + v for b, v in zip(bottom, vals)]
    for k, r in enumerate(rows):
        ax.plot([r["total_model"] / 1e6] * 2, [k - 0.45, k + 0.45], color="black", lw=1.5)
    ax.set_xlabel("MB per rank (black tick: the model's total)")
    ax.set_title(title)
    ax.legend(fontsize=8, loc="upper center", bbox_to_anchor=(0.5, -0.28), ncol=4, frameon=False)
    fig.tight_layout()
    alt = (f"{title}. " + "; ".join(
        f"ZeRO-{r['stage']}: {r['total'] / 1e6:.2f} MB in all, of which frozen weights "
        f"{r['frozen'] / 1e6:.2f} MB, trainable weights {(r['params'] - r['frozen']) / 1e6:.2f} MB, "
        f"gradients {r['grads'] / 1e6:.2f} MB, optimizer state {r['optimizer'] / 1e6:.2f} MB "
        f"(model: {r['total_model'] / 1e6:.2f} MB)" for r in rows) + ".")
    return fig, alt
