"""Activation memory: what a transformer keeps for backward (chapter 1).

``estimate`` (``zerolab.theory.memory``) counts model states: parameters, gradients,
optimizer state. Activations come on top, grow with sequence length and micro-batch,
and are not partitioned by ZeRO at all: this is why ZeRO alone does not make a model
fit, and why chapter 1's Memory Explorer draws them beside the model states.
Pure arithmetic, no torch; bytes everywhere.
"""
from __future__ import annotations


def activation_memory(layers, hidden, heads, seq_len, micro_batch, checkpointing=False,
                      dtype_bytes=2, flash_attention=False) -> int:
    """Bytes of activations a GPT-like transformer stores for backward, per rank.

    Korthikanti et al. 2022 ("Reducing Activation Recomputation"), no tensor
    or sequence parallelism: one layer keeps sbh(34 + 5as/h) bytes in 16-bit,
    s = seq_len, b = micro_batch, h = hidden, a = heads. Counting tensors:
    16 sbh-sized values (QKV input, Q, K, V, projection input, two LayerNorm
    inputs, fc1 input, GeLU input 4h, GeLU output 4h) at ``dtype_bytes`` each,
    2 sbh-sized 1-byte dropout masks, and per head two s x s score tensors
    (softmax output, dropout output) plus one 1-byte s x s mask:

        per_layer = sbh (16 d + 2) + a s^2 b (2 d + 1)      (d = 2: 34, 5)

    Full checkpointing keeps only each layer's input (d * sbh per layer) and
    recomputes one layer at a time in backward, so its activations exist once:

        checkpointing:  layers * d * sbh + per_layer
        otherwise:      layers * per_layer

    ``flash_attention=True``: a fused attention kernel (FlashAttention) never
    stores the s x s scores; backward recomputes them from Q, K, V and keeps
    only each row's softmax statistic (one fp32 log-sum-exp per head and
    token), and the attention dropout mask is regenerated from the RNG state:

        per_layer = sbh (16 d + 2) + 4 a s b

    so the quadratic term disappears and activations grow linearly in s.

    Embeddings, the final LayerNorm and the logits are left out.
    """
    vals = dict(layers=layers, hidden=hidden, heads=heads, seq_len=seq_len,
                micro_batch=micro_batch, dtype_bytes=dtype_bytes)
    for name, v in vals.items():
        if isinstance(v, bool) or not isinstance(v, int) or v < 1:
            raise ValueError(f"{name} must be an integer >= 1, got {v!r}")
    if dtype_bytes not in (1, 2, 4):
        raise ValueError(f"dtype_bytes must be one of (1, 2, 4), got {dtype_bytes!r}")
    if not isinstance(flash_attention, bool):
        raise ValueError(f"flash_attention must be True or False, got {flash_attention!r}")
    s, b, h, a, d = seq_len, micro_batch, hidden, heads, dtype_bytes
    attention = 4 * a * s * b if flash_attention else a * s * s * b * (2 * d + 1)
    per_layer = s * b * h * (16 * d + 2) + attention
    if checkpointing:
        return layers * d * s * b * h + per_layer
    return layers * per_layer
