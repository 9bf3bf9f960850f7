"""What a rank's peak holds beyond the model states, modelled for the bench's TinyGPT (the sweep).

The peak of a training step is the model states (``zl.estimate``) plus what the step
itself allocates. For the bench's fp32 TinyGPT (no dropout, ``scaled_dot_product_attention``,
tied embedding and head, cross-entropy over the vocabulary) that is, in bytes, with
s = seq_len, b = micro batch, h = d_model, a = heads, V = vocab, L = layers:

    acts      = activation_memory(L, h, a, s, b, dtype_bytes=4, flash_attention=True)
                - L * 2sbh                  (Korthikanti et al.'s two 1-byte dropout masks: none here)
                + 4 * (2sbh + sbV)          (final LayerNorm's input and output, the log-softmax the loss keeps)
    early     = acts + 4 * (Vh + 3sbh)      (backward has begun: the head's weight gradient, held by autograd
                                             until the embedding's arrives, and the first sbh-sized gradients)
    late      = 3 * 4Vh                     (end of backward: the tied weight's two gradients and their sum)
    rest      = max(early, late)

Stages 0 and 1 add nothing to this (the sweep's ``rest_ratio``, measured ÷ modelled, is printed
for every point; tests/test_bench_sweep.py holds it within 10% at the small size). Stages 2
and 3 add the engine's working set of full-size units: gradient staging (stage 2 and 3) and
gathered parameters (stage 3). ``engine_bytes`` models it as the designed bound in units of the
largest unit; the engine frees a unit's staging when it sees the unit's collective complete, so
how many are alive at the peak varies from run to run, and the sweep prints the ratio.
"""
from __future__ import annotations

from zerolab.book.models import PRESETS
from zerolab.theory.activations import activation_memory
from zerolab.theory.memory import gathered_working_set


def _shape(model: str) -> tuple[int, int, int, int, int]:
    p = PRESETS[model]
    return p["n_layer"], p["d_model"], p["n_head"], p["seq_len"], p["vocab"]


def activation_bytes(model: str, micro_batch: int) -> int:
    """``acts`` above: what forward leaves for backward, the loss's log-softmax included."""
    L, h, a, s, V = _shape(model)
    korthikanti = activation_memory(L, h, a, s, micro_batch, dtype_bytes=4, flash_attention=True)
    sbh = s * micro_batch * h
    return korthikanti - L * 2 * sbh + 4 * (2 * sbh + s * micro_batch * V)


def step_bytes(model: str, micro_batch: int) -> int:
    """``rest`` above: the most a step holds beyond the model states, engine buffers left out."""
    L, h, a, s, V = _shape(model)
    sbh = s * micro_batch * h
    return max(activation_bytes(model, micro_batch) + 4 * (V * h + 3 * sbh), 3 * 4 * V * h)


def largest_unit(model: str) -> int:
    """Parameters of the largest unit the engines partition and gather: a block, or the embeddings
    (token + position; the head is tied to the token embedding)."""
    L, h, a, s, V = _shape(model)
    return max(12 * h * h + 13 * h, V * h + s * h)


def engine_bytes(model: str, stage: int) -> int:
    """The engine's working set beside the step's tensors, modelled in fp32 units of the largest
    unit: stage 2, two full unit gradients (one being filled, one reduced); stage 3 (one unit
    prefetched, a unit's gradients reduced while the next fills: ``sweep.stage3_knobs``), twice
    ``zl.gathered_working_set``: the parameters of the unit computing and of the one prefetched,
    and the gradients of the unit filling and of the one in flight; stages 0-1: none."""
    unit = largest_unit(model)
    return {2: 2 * 4 * unit, 3: 2 * gathered_working_set(unit, "fp32")}.get(stage, 0)


def rest_model(model: str, micro_batch: int, world_size: int, stage: int) -> int:
    """The modelled rest of the peak above the model states: the step's tensors plus the engine's."""
    return step_bytes(model, micro_batch) + engine_bytes(model, stage)
