"""The ``fp16``, ``bf16`` and ``data_types`` sections (chapters 1 and 3).

Key tables, defaults and readers side by side; the precision names they map
to ("fp32", "mixed", "mixed_fp32_grads") are the theory's (``zerolab.theory``).
"""
from __future__ import annotations

from dataclasses import dataclass

from zerolab.config.schema import ConfigError, read_bool, read_choice, read_float, read_int, section

FP16_KEYS = ("enabled", "loss_scale", "initial_scale_power", "loss_scale_window", "hysteresis", "min_loss_scale")
FP16_IGNORED = ("auto_cast", "consecutive_hysteresis", "fp16_master_weights_and_grads", "type")
BF16_KEYS = ("enabled",)
BF16_IGNORED = ("immediate_grad_update", "check_grad_overflow", "bf16_master_weights_and_grads",
                "bf16_optimizer_states")
DTYPES = {"fp32": "fp32", "float32": "fp32", "fp16": "fp16", "float16": "fp16", "bf16": "bf16",
          "bfloat16": "bf16"}


@dataclass
class FP16Config:
    enabled: bool = False
    loss_scale: float = 0.0         # 0 = dynamic
    initial_scale_power: int = 16
    loss_scale_window: int = 1000
    hysteresis: int = 2
    min_loss_scale: float = 1.0


def read_fp16(raw, ignored: list) -> FP16Config:
    p, f = "fp16", FP16Config()
    d = section(raw, p, ignored, FP16_KEYS, skip=FP16_IGNORED)
    return FP16Config(enabled=read_bool(d, "enabled", p, False),
                      loss_scale=read_float(d, "loss_scale", p, f.loss_scale),
                      initial_scale_power=read_int(d, "initial_scale_power", p, f.initial_scale_power),
                      loss_scale_window=read_int(d, "loss_scale_window", p, f.loss_scale_window, minimum=1),
                      hysteresis=read_int(d, "hysteresis", p, f.hysteresis, minimum=1),
                      min_loss_scale=read_float(d, "min_loss_scale", p, f.min_loss_scale))


def read_bf16(raw, ignored: list) -> bool:
    return read_bool(section(raw, "bf16", ignored, BF16_KEYS, skip=BF16_IGNORED), "enabled", "bf16", False)


def read_grad_accum_dtype(raw, ignored: list) -> str | None:
    """``data_types.grad_accum_dtype`` normalised to "fp32" | "fp16" | "bf16" (None: not given)."""
    d = section(raw, "data_types", ignored, ("grad_accum_dtype",))
    return DTYPES.get(read_choice(d, "grad_accum_dtype", "data_types", None, tuple(DTYPES)))


def check_precision(fp16: FP16Config, bf16: bool) -> None:
    if fp16.enabled and bf16:
        raise ConfigError("fp16.enabled and bf16.enabled are both true; enable at most one of them")
