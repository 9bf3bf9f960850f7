"""FP8 training's bytes: what an FP8 recipe keeps per parameter, and what its gathers send (chapter 1).

Pure arithmetic, no torch. ``zl.estimate(psi, n, stage, fp8=True)`` (``theory.memory``) uses
``memory.FP8_WEIGHT_BYTES``; ``fp8_comm_breakdown`` / ``fp8_comm_volume`` / ``fp8_step_comm_time`` are
``theory.comm``'s formulas with the parameter all-gathers at one byte per element.

Sources, and what each says (read for facts; numbers copied, no text):

[Playbook] Hugging Face, "The Ultra-Scale Playbook: Training LLMs on Large GPU Clusters" (2025),
    section "Mixed precision training", subsection "FP8 pretraining", the table of known FP8 training
    approaches, https://huggingface.co/spaces/nanotron/ultrascale-playbook : the bytes per parameter of
    six recipes (``PLAYBOOK_RECIPES``: master weights, accumulated gradients, model weights, gradients,
    optimizer states and their total). It says DeepSeek-V3 was the first very large training run in FP8
    reported publicly, and that, as in BF16 mixed precision, master weights and some aggregations stay
    in higher precision while the operations run in FP8.
[TE] NVIDIA Transformer Engine, ``transformer_engine.pytorch.fp8_model_init`` (API reference,
    https://docs.nvidia.com/deeplearning/transformer-engine/user-guide/api/pytorch.html): modules created
    inside it hold only FP8 copies of their parameters instead of both a higher-precision and an FP8 copy,
    meant for full training with an optimizer that keeps master weights (the high-precision copy is
    already there).
[torchao] torchtitan's float8 guide (https://github.com/pytorch/torchtitan/blob/main/docs/float8.md), for
    torchao's ``Float8LinearConfig(enable_fsdp_float8_all_gather=True)``: the weight is cast from high
    precision to float8 *before* FSDP2's all-gather, so the gather moves float8 (one byte per element,
    half of bf16's two); optionally ``precompute_float8_dynamic_scale_for_fsdp`` computes the scales for all
    parameters in one all-reduce after the optimizer step.
[DeepSeek-V3] DeepSeek-AI, "DeepSeek-V3 Technical Report", section 3.3, https://arxiv.org/abs/2412.19437:
    activations are cached and dispatched in FP8 and the optimizer states stored in BF16. The Playbook's
    DeepSeek-V3 row adds the rest: master weights and accumulated gradients FP32, weights FP8, gradients
    BF16, moments BF16 + BF16: 4 + 4 + 1 + 2 + 2 + 2 = 15 bytes.

This book's FP8 model (``estimate(..., fp8=True)``), byte by byte:

    state                      bytes  whose
    weights the GEMMs read       1    [TE] fp8_model_init: only the FP8 copy is held (no 16-bit copy beside it)
    gradients                    2    our choice, the precision's (bf16 as in "mixed"; 4 with
                                      "mixed_fp32_grads"); the Playbook's DeepSeek-V3 row has BF16 too
    fp32 master                  4    [TE] (the optimizer's master weights) and [Playbook]
    Adam's m and v               8    our choice: fp32 as in "mixed" (DeepSeek-V3 keeps them in BF16: 4)
                                ---
                                15    per parameter, against 16 for bf16 mixed precision

ZeRO shards them as it shards the 16-bit states (weights at stage 3, gradients from stage 2, master and
moments from stage 1), so FP8 saves Ψ bytes per GPU at stages 0-2 and Ψ/N at stage 3: 1/16 of the model
states at most. The master and the moments (12 of 15 bytes) are what it does not touch.

Communication: the parameter all-gathers move the FP8 weights — stage 3's forward and backward gathers
([torchao]; FSDP2's float8 all-gather) and, our choice by the same logic, stages 1-2's gather of the
updated weights (the rank holds FP8 weights, so it sends FP8). The gradient reductions stay 16-bit. The
per-tensor scales (4 bytes a tensor) are not counted. Activations are counted in 16-bit: recipes differ
in what they cache in FP8 ([DeepSeek-V3] caches some Linear inputs in FP8, others in higher precision),
so the book claims no activation saving.
"""
from __future__ import annotations

from zerolab.theory.comm import comm_breakdown, op_link
from zerolab.theory.memory import FP8_WEIGHT_BYTES, bytes_per_param
from zerolab.theory.nodes import get_node

GRAD_REDUCE_BYTES = 2    # the gradient reductions stay bf16 (16-bit)

PLAYBOOK_URL = "https://huggingface.co/spaces/nanotron/ultrascale-playbook"
PLAYBOOK_COLUMNS = ("master", "accumulated grads", "weights", "grads", "optimizer states")
# [Playbook] "FP8 pretraining" table: bytes per parameter by column (0 where it says n/a), and its total
PLAYBOOK_RECIPES = {
    "BF16 with FP32 mixed precision baseline": ((4, 4, 2, 2, 4 + 4), 20),
    "the above without FP32 grad accumulation": ((4, 0, 2, 2, 4 + 4), 16),
    "Transformer Engine": ((0, 0, 4, 4, 4 + 4), 16),
    "FP8-LM's O3 level": ((2, 2, 1, 1, 1 + 2), 9),
    "DeepSeek-V3": ((4, 4, 1, 2, 2 + 2), 15),
    "Nanotron's FP8": ((2, 4, 1, 1, 1 + 1), 10),
}


def fp8_recipe_table(precision="mixed", optimizer="adam") -> list[tuple]:
    """Rows (recipe, master, accumulated grads, weights, grads, optimizer states, total, whose) in bytes per
    parameter: the Playbook's six recipes (cited) and ``zl.estimate``'s two, without and with ``fp8=True``."""
    rows = [(name, *parts, sum(parts), f"cited: the Playbook (total {total})")
            for name, (parts, total) in PLAYBOOK_RECIPES.items()]
    for fp8, whose in ((False, "zl.estimate: the Playbook's row without FP32 grad accumulation"),
                       (True, "zl.estimate(fp8=True): weights 1 (TE's fp8_model_init), the rest our choice")):
        p, g, k = bytes_per_param(precision, optimizer, fp8=fp8)
        master = 4                               # the mixed modes' fp32 master copy, inside K
        rows.append((f"{'FP8 weights' if fp8 else 'bf16 mixed'} ({precision}, {optimizer})",
                     master, 0, p, g, k - master, p + g + k, whose))
    return rows


def fp8_comm_breakdown(psi, n_gpus, stage, grad_accum=1, gpus_per_node=None):
    """``theory.comm_breakdown`` with FP8 weights: every parameter all-gather at one byte per element (stage 3's
    forward and backward gathers, stages 1-2's gather after the step), the gradient collectives at two."""
    grads = comm_breakdown(psi, n_gpus, stage, GRAD_REDUCE_BYTES, grad_accum, gpus_per_node)
    weights = comm_breakdown(psi, n_gpus, stage, FP8_WEIGHT_BYTES, grad_accum, gpus_per_node)
    return [w if g.what.startswith("params") else g for g, w in zip(grads, weights)]


def fp8_comm_volume(psi, n_gpus, stage, grad_accum=1, gpus_per_node=None) -> int:
    """Bytes one rank sends per step with FP8 weight gathers (``fp8_comm_breakdown``)."""
    return sum(op.bytes for op in fp8_comm_breakdown(psi, n_gpus, stage, grad_accum, gpus_per_node))


def fp8_step_comm_time(psi, n_gpus, stage, node, grad_accum=1) -> float:
    """Seconds of communication per step with FP8 weight gathers on ``node`` (alpha-beta, no overlap), as
    ``theory.step_comm_time(..., node=)`` times each collective."""
    nd = get_node(node)
    ops = fp8_comm_breakdown(psi, n_gpus, stage, grad_accum, nd.gpus)
    return sum(op.count * op_link(op, nd).time(op.op, op.nbytes, op.group) for op in ops)
