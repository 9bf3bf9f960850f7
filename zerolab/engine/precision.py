"""Precision: which dtype computes, which accumulates gradients, and the fp16 loss scaler (chapter 3).

Three modes, one name each everywhere in zerolab (config ``precision``):

    mode               params (compute)  gradients (accumulated AND reduced)  optimizer
    "fp32"             fp32              fp32                                  the fp32 params themselves
    "mixed"            bf16 / fp16       bf16 / fp16                           fp32 master + moments
    "mixed_fp32_grads" bf16 / fp16       fp32                                  fp32 master + moments

Gradients are reduced across ranks in the dtype they are accumulated in:
16-bit in "mixed" (half the bytes on the wire), fp32 in "mixed_fp32_grads".

fp16 needs loss scaling: small gradients underflow in fp16, so the loss is
multiplied by a scale S before backward and the gradients divided by S before
the step. ``DynamicLossScaler`` follows DeepSpeed's keys: ``loss_scale`` 0 means
dynamic; the scale starts at 2**initial_scale_power, is halved on an overflow
(after ``hysteresis`` overflows in a row) but never below ``min_loss_scale``,
and doubled after ``loss_scale_window`` clean steps. Each rank sees only its
shard of the gradients, so the overflow flag is all-reduced with MAX: every
rank skips the step and lowers the scale together.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@dataclass
class Precision:
    name: str                   # "fp32" | "mixed" | "mixed_fp32_grads"
    compute_dtype: torch.dtype  # params and activations
    grad_dtype: torch.dtype     # gradient accumulation and reduction

    @property
    def has_master(self) -> bool:
        """An fp32 master copy exists unless the params are fp32 already."""
        return self.compute_dtype != torch.float32


def precision_of(cfg) -> Precision:
    compute = DTYPES[cfg.compute_dtype]
    grad = torch.float32 if cfg.precision in ("fp32", "mixed_fp32_grads") else compute
    return Precision(cfg.precision, compute, grad)


class DynamicLossScaler:
    """DeepSpeed's dynamic loss scaling (``loss_scale: 0``); a static scale when ``loss_scale > 0``."""

    def __init__(self, loss_scale=0.0, initial_scale_power=16, loss_scale_window=1000,
                 hysteresis=2, min_loss_scale=1.0):
        self.dynamic = not loss_scale
        self.scale = float(2 ** initial_scale_power if self.dynamic else loss_scale)
        self.window, self.min_scale = int(loss_scale_window), float(min_loss_scale)
        self.hysteresis = self._hysteresis_left = int(hysteresis)
        self.iteration = 0
        self.last_overflow = -1

    def update(self, overflow: bool) -> None:
        """After each optimizer step (taken or skipped)."""
        if self.dynamic:
            if overflow:
                if self.hysteresis == 1 or self._hysteresis_left == 1:
                    self.scale = max(self.scale / 2, self.min_scale)
                else:
                    self._hysteresis_left -= 1
                self.last_overflow = self.iteration
            elif (self.iteration - self.last_overflow) % self.window == 0:
                self._hysteresis_left = self.hysteresis
                self.scale *= 2
        self.iteration += 1

    def state_dict(self) -> dict:
        """What a checkpoint keeps: the scale and where the scaler is in its windows."""
        return {"scale": self.scale, "iteration": self.iteration, "last_overflow": self.last_overflow,
                "hysteresis_left": self._hysteresis_left}

    def load_state_dict(self, state: dict) -> None:
        self.scale, self.iteration = float(state["scale"]), int(state["iteration"])
        self.last_overflow, self._hysteresis_left = int(state["last_overflow"]), int(state["hysteresis_left"])

    @classmethod
    def from_config(cls, fp16) -> "DynamicLossScaler":
        return cls(fp16.loss_scale, fp16.initial_scale_power, fp16.loss_scale_window,
                   fp16.hysteresis, fp16.min_loss_scale)


def local_overflow(tensors: list[torch.Tensor]) -> bool:
    """True if any element of this rank's gradients is inf or nan (one fused reduction)."""
    if not tensors:
        return False
    amax = torch.stack(torch._foreach_norm(tensors, float("inf")))  # max |g| per tensor, nan stays nan
    return not bool(torch.isfinite(amax).all())


def cast_floats(x, dtype):
    """``x`` (a tensor or nested list/tuple/dict) with floating tensors cast to ``dtype`` (the forward's inputs)."""
    if isinstance(x, torch.Tensor):
        return x.to(dtype) if x.is_floating_point() else x
    if isinstance(x, (list, tuple)):
        return type(x)(cast_floats(v, dtype) for v in x)
    if isinstance(x, dict):
        return {k: cast_floats(v, dtype) for k, v in x.items()}
    return x
