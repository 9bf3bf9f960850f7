"""``deepspeed.ops.adam.FusedAdam`` and ``DeepSpeedCPUAdam``: DeepSpeed's Adam classes, as optimizers to hand
to ``deepspeed.initialize`` (Accelerate builds a ``DeepSpeedCPUAdam`` from a torch AdamW when the optimizer is
offloaded). They hold DeepSpeed's hyper-parameters and defaults (weight decay 0; ``adamw_mode`` / ``adam_w_mode``
True: decoupled weight decay); ``initialize`` reads them into the config and zerolab's engine updates
(``client.py``). Stepping one directly is refused: zerolab's kernels run inside the engine."""
from __future__ import annotations

import torch


class _DeepSpeedAdam(torch.optim.Optimizer):
    def __init__(self, params, lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.0, amsgrad=False,
                 adamw_mode=True, **kwargs):
        if amsgrad:
            raise NotImplementedError(f"{type(self).__name__}(amsgrad=True): not supported (DeepSpeed refuses it too)")
        self.adam_w_mode = bool(adamw_mode)
        super().__init__(params, dict(lr=lr, betas=tuple(betas), eps=eps, weight_decay=weight_decay))

    def step(self, closure=None):
        raise NotImplementedError(f"{type(self).__name__}.step(): zerolab runs the update inside the engine; pass "
                                  f"this optimizer to deepspeed.initialize(optimizer=...) and call engine.step()")


class FusedAdam(_DeepSpeedAdam):
    """DeepSpeed's ``FusedAdam(params, lr, bias_correction, betas, eps, adam_w_mode, weight_decay, amsgrad, ...)``."""

    def __init__(self, params, lr=1e-3, bias_correction=True, betas=(0.9, 0.999), eps=1e-8, adam_w_mode=True,
                 weight_decay=0.0, amsgrad=False, set_grad_none=True):
        super().__init__(params, lr, betas, eps, weight_decay, amsgrad, adam_w_mode)


class DeepSpeedCPUAdam(_DeepSpeedAdam):
    """DeepSpeed's ``DeepSpeedCPUAdam(model_params, lr, bias_correction, betas, eps, weight_decay, amsgrad,
    adamw_mode, fp32_optimizer_states)``."""

    def __init__(self, model_params, lr=1e-3, bias_correction=True, betas=(0.9, 0.999), eps=1e-8, weight_decay=0,
                 amsgrad=False, adamw_mode=True, fp32_optimizer_states=True):
        super().__init__(model_params, lr, betas, eps, weight_decay, amsgrad, adamw_mode)


__all__ = ["FusedAdam", "DeepSpeedCPUAdam"]
