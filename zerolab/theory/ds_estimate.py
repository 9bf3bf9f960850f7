"""DeepSpeed's own memory estimators, reproduced (chapter 1 compares them with ours).

DeepSpeed ships ``estimate_zero2_model_states_mem_needs`` and its ZeRO-3 twin;
``deepspeed_estimate`` gives the same figures from the same inputs, so the book can
put them beside ``estimate`` (``zerolab.theory.memory``) and say where and why the two
differ. Pure arithmetic, no torch; bytes everywhere.
"""
from __future__ import annotations

from dataclasses import dataclass

from zerolab.theory.checks import check_psi_n
from zerolab.theory.checks import choice as _choice


@dataclass(frozen=True)
class DeepSpeedEstimate:
    gpu: int   # bytes per GPU
    cpu: int   # bytes per node (host RAM), including the buffer factor


def deepspeed_estimate(psi, n_gpus, stage, largest_layer=None, gpus_per_node=None,
                       offload_optimizer=False, offload_param=False, zero_init=True,
                       buffer_factor=1.5) -> DeepSpeedEstimate:
    """DeepSpeed's ``estimate_zero{2,3}_model_states_mem_needs`` figures (v0.19).

    ZeRO-2, no offload: gpu = 2Ψ + 18Ψ/N (2 fp16 params; 18 = 2 fp16 grads +
    4 fp32 grads + 4 fp32 master + 8 Adam moments, per its comment), cpu =
    4Ψ·gpus_per_node·factor. ZeRO-2 + cpu offload: gpu = 2Ψ, cpu =
    Ψ·max(4N, 16)·factor. ZeRO-3 (``largest_layer`` params needed):
    gpu = 4·largest_layer + 18Ψ/N; + optimizer offload: 4·largest + 2Ψ/N;
    + param offload: 4·largest. The 1.5 buffer factor scales only the CPU
    figure, which is per node and the larger of the start-up peak (every local
    process holds the full fp32 model on the host, 4Ψ each) and the steady state.
    Ours differs without offload: 2Ψ + 14Ψ/N for ZeRO-2 (no separate fp32
    gradient), 16Ψ/N for ZeRO-3 (the gathered layers are ``gathered_working_set``,
    beside ``.total``); with offload the device figures agree (chapters 1, 7).
    """
    psi, n = check_psi_n(psi, n_gpus)
    _choice("stage", stage, (2, 3))
    gpn = n if gpus_per_node is None else gpus_per_node
    if not isinstance(gpn, int) or gpn < 1 or n % gpn:
        raise ValueError(f"gpus_per_node must be an integer >= 1 dividing n_gpus={n}, got {gpus_per_node!r}")
    nodes = n // gpn
    if stage == 2:
        if offload_param:
            raise ValueError("offload_param needs stage 3 (got stage=2)")
        if offload_optimizer:
            return DeepSpeedEstimate(2 * psi, int(psi * max(4 * n, 16) * buffer_factor))
        return DeepSpeedEstimate(2 * psi + int(18 * psi / n), int(psi * 4 * gpn * buffer_factor))
    if largest_layer is None or largest_layer <= 0:
        raise ValueError(f"largest_layer (parameters of the largest layer) must be > 0 for stage 3, got {largest_layer!r}")
    largest = 4 * int(largest_layer)
    if offload_param and not offload_optimizer:
        raise ValueError("DeepSpeed's estimator offloads params only together with the optimizer")
    if offload_optimizer:
        k, gpu = (18, largest) if offload_param else (16, largest + int(2 * psi / n))
        per_node = k / nodes if zero_init else max(4 * gpn, k / nodes)
        return DeepSpeedEstimate(gpu, int(psi * per_node * buffer_factor))
    cpu = (int(largest_layer) if zero_init else psi) * 4 * gpn * buffer_factor
    return DeepSpeedEstimate(largest + int(18 * psi / n), int(cpu))
