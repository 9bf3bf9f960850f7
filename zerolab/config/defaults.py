"""zerolab's defaults beside DeepSpeed's, read from the code (chapter 12's defaults table).

    from zerolab.config.defaults import defaults_table
    for row in defaults_table(): print(row["key"], row["zerolab"], row["deepspeed"], row["why"])

The zerolab column is read from the config dataclasses and the optimizer's
defaults, so it cannot drift from what runs. The DeepSpeed column is cited from
DeepSpeed 0.19.8 (``runtime/constants.py``, ``runtime/zero/config.py``,
``runtime/zero/offload_config.py``, ``runtime/precision_config.py`` and
FusedAdam's signature); ``tests/test_defaults.py`` checks it against the
installed package when DeepSpeed is installed. Where the two differ, ``why``
says why zerolab keeps its own.
"""
from __future__ import annotations

from zerolab.config.core import Config
from zerolab.config.optimizer import OPTIMIZER_DEFAULTS, TORCH_ADAMW_WEIGHT_DECAY
from zerolab.config.zero import ZeroConfig

DEEPSPEED_VERSION = "0.19.8"
# key -> DeepSpeed's default (cited; checked by tests/test_defaults.py when deepspeed is installed)
DEEPSPEED_DEFAULTS = {
    "gradient_clipping": 1.0,
    "gradient_accumulation_steps": 1,
    "optimizer.type \"Adam\"": "AdamW (adam_w_mode true)",
    "optimizer.params.lr": 1e-3,
    "optimizer.params.betas": (0.9, 0.999),
    "optimizer.params.eps": 1e-8,
    "optimizer.params.weight_decay (Adam, AdamW)": 0.0,
    "optimizer.params.weight_decay (AdamW, torch_adam true)": 0.01,
    "fp16.loss_scale": 0.0,
    "fp16.initial_scale_power": 16,
    "fp16.loss_scale_window": 1000,
    "fp16.hysteresis": 2,
    "fp16.min_loss_scale": 1.0,
    "zero_optimization.stage": 0,
    "zero_optimization.reduce_bucket_size": 500_000_000,
    "zero_optimization.allgather_bucket_size": 500_000_000,
    "zero_optimization.overlap_comm (stage 0-2)": False,
    "zero_optimization.overlap_comm (stage 3)": True,
    "zero_optimization.contiguous_gradients": True,
    "zero_optimization.reduce_scatter": True,
    "zero_optimization.stage3_prefetch_bucket_size": 50_000_000,
    "zero_optimization.stage3_param_persistence_threshold": 100_000,
    "zero_optimization.stage3_max_live_parameters": 1_000_000_000,
    "zero_optimization.stage3_max_reuse_distance": 1_000_000_000,
    "zero_optimization.sub_group_size": 1_000_000_000,
    "zero_optimization.offload_optimizer.pin_memory": True,
    "zero_optimization.offload_optimizer.buffer_count": 4,
    "zero_optimization.offload_param.pin_memory": True,
    "zero_optimization.offload_param.buffer_count": 5,
    "zero_optimization.offload_param.buffer_size": 100_000_000,
}
# where zerolab differs on purpose: key -> why
WHY = {
    "gradient_clipping": "zerolab keeps 0 (off): a default that clips changes the update silently, and the "
                         "chapters compare the engines with plain torch training, which does not clip; write "
                         "\"gradient_clipping\": 1.0 to match DeepSpeed 0.19",
}


def zerolab_defaults() -> dict:
    """key -> zerolab's default, read from the dataclasses and the optimizer's defaults."""
    c, z, z3 = Config(), ZeroConfig(), ZeroConfig(stage=3)
    adam, adamw = OPTIMIZER_DEFAULTS["adam"], OPTIMIZER_DEFAULTS["adamw"]
    out = {"gradient_clipping": c.gradient_clipping,
           "gradient_accumulation_steps": c.gradient_accumulation_steps,
           "optimizer.type \"Adam\"": {"adamw": "AdamW (adam_w_mode true)", "adam": "Adam (L2)"}[
               Config.from_deepspeed({"optimizer": {"type": "Adam"}}).optimizer.type],
           "optimizer.params.lr": adam["lr"], "optimizer.params.betas": adam["betas"],
           "optimizer.params.eps": adam["eps"],
           "optimizer.params.weight_decay (Adam, AdamW)": adamw["weight_decay"] if adam["weight_decay"] ==
           adamw["weight_decay"] else (adam["weight_decay"], adamw["weight_decay"]),
           "optimizer.params.weight_decay (AdamW, torch_adam true)": TORCH_ADAMW_WEIGHT_DECAY}
    out.update({f"fp16.{k}": getattr(c.fp16, k) for k in
                ("loss_scale", "initial_scale_power", "loss_scale_window", "hysteresis", "min_loss_scale")})
    for k in ("stage", "reduce_bucket_size", "allgather_bucket_size", "contiguous_gradients", "reduce_scatter",
              "stage3_prefetch_bucket_size", "stage3_param_persistence_threshold", "stage3_max_live_parameters",
              "stage3_max_reuse_distance", "sub_group_size"):
        out[f"zero_optimization.{k}"] = getattr(z, k)
    out["zero_optimization.overlap_comm (stage 0-2)"] = z.overlap_comm
    out["zero_optimization.overlap_comm (stage 3)"] = z3.overlap_comm
    for name in ("offload_optimizer", "offload_param"):
        off = getattr(z, name)
        out[f"zero_optimization.{name}.pin_memory"] = off.pin_memory
        out[f"zero_optimization.{name}.buffer_count"] = off.buffer_count
    out["zero_optimization.offload_param.buffer_size"] = z.offload_param.buffer_size
    return out


def defaults_table() -> list[dict]:
    """One row per key: key, zerolab, deepspeed, same (bool) and why (where they differ)."""
    ours = zerolab_defaults()
    rows = []
    for key, ds in DEEPSPEED_DEFAULTS.items():
        mine = ours[key]
        same = mine == ds
        rows.append({"key": key, "zerolab": mine, "deepspeed": ds, "same": same,
                     "why": "" if same else WHY.get(key, "")})
    return rows


def defaults_markdown() -> str:
    """The table as Markdown (chapter 12 displays it)."""
    lines = [f"| key | zerolab | DeepSpeed {DEEPSPEED_VERSION} | |", "|---|---|---|---|"]
    for r in defaults_table():
        lines.append(f"| `{r['key']}` | {r['zerolab']!r} | {r['deepspeed']!r} | "
                     f"{'same' if r['same'] else 'differs: ' + r['why']} |")
    return "\n".join(lines)
