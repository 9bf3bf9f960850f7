"""Activation recomputation, full and selective (chapter 10; Korthikanti et al. 2022).

    zl.recompute(model, "full")        each transformer block keeps only its input for backward;
                                       the block's forward runs again in backward (one extra forward)
    zl.recompute(model, "selective")   only attention's core — scores, softmax, attention dropout and
                                       the weighted sum — is recomputed: the s x s tensors are never kept
    zl.recompute(model, "none")        everything autograd saves is kept (the default)

The names are Megatron-LM's ``--recompute-granularity``. DeepSpeed's own
``activation_checkpointing`` config section chooses no layers (a DeepSpeed model
calls ``deepspeed.checkpointing.checkpoint`` in its own code), so this is the one
switch: the model declares where it can recompute and ``recompute`` sets it.
A module class opts in with ``recompute_modes`` (TinyGPT: ``("full",)``, its
``Attention``: ``("selective",)``) and reads ``self.recompute`` in its forward,
running the part through ``checkpoint`` below.

What is kept, per layer (s, b, h, a; d bytes per value): ``none`` sbh(16d + 2) +
as²b(2d + 1); ``selective`` sbh(16d + 2); ``full`` d·sbh, plus one layer's whole
working set while that layer is recomputed in backward. What it costs, in forward
FLOPs added to a step (``recompute_flops``): ``full`` one more forward of every
block, 24bsh² + 4bs²h per layer; ``selective`` only attention's two s x s matrix
products, 2·2bs²h per layer. ``saved_bytes`` measures the first: the bytes of the
distinct storages autograd saves for backward while a function runs.
"""
from __future__ import annotations

import torch
import torch.utils.checkpoint

MODES = ("none", "selective", "full")


def checkpoint(fn, *args):
    """``fn(*args)``, keeping only ``args`` for backward and running ``fn`` again there.

    torch's non-reentrant checkpoint (it works with ZeRO-3's gather hooks and with inputs that need no
    gradient) with the random state put back before the recomputation, so that a dropout inside ``fn``
    draws the same mask twice: without that the gradient belongs to a different mask than the forward.
    The recomputation runs all of ``fn``, as Megatron-LM's and DeepSpeed's checkpoints do, so that its
    cost is ``recompute_flops``: torch's early stop would end it once the last tensor backward needs is
    rebuilt, skipping a final product whose output backward never reads (measured on TinyGPT: the
    weighted sum in selective, 2bs²h of 4bs²h; the MLP's second product in full, without dropout)."""
    with torch.utils.checkpoint.set_checkpoint_early_stop(False):
        return torch.utils.checkpoint.checkpoint(fn, *args, use_reentrant=False, preserve_rng_state=True)


def recompute(model: torch.nn.Module, mode: str = "full") -> torch.nn.Module:
    """Set ``model``'s recomputation to ``mode`` ("none" | "selective" | "full"); returns the model.

    Every submodule whose class lists ``mode`` in ``recompute_modes`` runs that part under ``checkpoint``;
    the others are set to "none". A Hugging Face model: "full" is its ``activation_checkpointing_enable``
    (non-reentrant: each decoder layer recomputed), "selective" is refused by name. Call it before or after
    ``zl.initialize`` (the engine runs the model's own forward)."""
    if mode not in MODES:
        raise ValueError(f"recompute: mode must be one of {MODES}, got {mode!r}")
    if not isinstance(model, torch.nn.Module):
        raise TypeError(f"recompute: expected a torch.nn.Module (the model), got {type(model).__name__}")
    able = [m for m in model.modules() if getattr(type(m), "recompute_modes", None)]
    if not able and getattr(model, "supports_gradient_checkpointing", False) and mode != "selective":
        new = hasattr(model, "activation_checkpointing_enable")   # transformers 5's name; 4's below
        if mode == "full":   # a Hugging Face model: its own layer checkpointing, non-reentrant (ZeRO-3's hooks)
            kw = {"use_reentrant": False}
            model.activation_checkpointing_enable(kw) if new else model.gradient_checkpointing_enable(kw)
        else:
            model.activation_checkpointing_disable() if new else model.gradient_checkpointing_disable()
        return model
    if mode != "none" and not any(mode in m.recompute_modes for m in able):
        raise ValueError(f"recompute={mode!r}: {type(model).__name__} has no module that can recompute {mode!r} "
                         f"(a module opts in with a class attribute recompute_modes and runs that part through "
                         f"zerolab.parallel.recompute.checkpoint; TinyGPT: 'full', its Attention: 'selective'; a "
                         f"Hugging Face model: 'full')")
    if mode != "none" and getattr(model, "tp_rng", None) is not None:
        raise ValueError(f"recompute={mode!r} under tensor parallelism's RNG tracker is not supported: the "
                         f"tracker's hooks would advance its random states again during the recomputation")
    for m in able:
        m.recompute = mode if mode in m.recompute_modes else "none"
    return model


def recompute_flops(layers: int, hidden: int, seq_len: int, micro_batch: int, mode: str) -> int:
    """Forward FLOPs recomputation adds to one training step (a multiply-add = 2 FLOPs), a GPT block of
    4h² attention and 8h² MLP weights: "full" 24bsh² + 4bs²h per layer, "selective" 4bs²h, "none" 0."""
    if mode not in MODES:
        raise ValueError(f"recompute_flops: mode must be one of {MODES}, got {mode!r}")
    s, b, h = seq_len, micro_batch, hidden
    attention_core = 2 * 2 * b * s * s * h          # q kᵀ and (softmax) v: two s x s x h products
    block = 2 * b * s * 12 * h * h + attention_core  # the weights' products, then the core
    return layers * {"none": 0, "selective": attention_core, "full": block}[mode]


def saved_bytes(fn, *args, exclude=()) -> tuple:
    """``(bytes, fn(*args))``: the bytes autograd keeps for backward while ``fn`` runs, measured with
    ``saved_tensors_hooks``: each saved tensor's storage counted once (views share it), the storages of
    ``exclude`` (the parameters: model states, not activations) left out."""
    skip = {t.untyped_storage().data_ptr() for t in exclude}
    seen: dict = {}

    def pack(t):
        st = t.untyped_storage()
        if st.data_ptr() not in skip:
            seen[st.data_ptr()] = st.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = fn(*args)
    return sum(seen.values()), out
