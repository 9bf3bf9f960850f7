"""The vocabulary-parallel cross-entropy (Megatron-LM; chapter 10), with ``F.cross_entropy``'s options.

The logits are split along the vocabulary (TP rank r holds columns ``r*V/tp ..
(r+1)*V/tp``, as a column-parallel head gives them); the loss is taken without
gathering them: the max, the target's logit and the sum of exponentials are
each all-reduced over the TP group (3 small all-reduces of b·s elements
instead of an all-gather of b·s·V). With ``label_smoothing`` ε the mean logit
over the whole vocabulary rides in the sum's all-reduce. Per token:

    loss = log Σ_j e^{z_j} − (1 − ε)·z_target − ε·mean_j z_j

and its gradient, on this rank's columns: softmax − (1 − ε)·onehot − ε/V.

``ignore_index`` (default −100, Hugging Face's label padding, as
``F.cross_entropy``): those tokens add nothing, get no gradient and are not
counted by ``reduction="mean"``. A target outside ``[0, V)`` (other than
``ignore_index``) raises ``IndexError`` on every TP rank alike: the check is
folded into the max's all-reduce (a bad token's max is set to +inf), so no
rank raises while another waits in a collective.
"""
from __future__ import annotations

import torch

REDUCTIONS = ("mean", "sum", "none")


class VocabParallelCE(torch.autograd.Function):
    """Per-token cross-entropy of logits split along the vocabulary (this rank: columns
    ``start .. start + V/tp``); ignored tokens give 0. Backward: the formula of the module docstring."""

    @staticmethod
    def forward(ctx, logits, target, comm, start, ignore_index, smoothing):
        v, full = logits.shape[-1], logits.shape[-1] * comm.world_size
        keep = target != ignore_index
        bad = keep & ((target < 0) | (target >= full))
        m = logits.detach().max(dim=-1).values
        m = m.masked_fill(bad, float("inf"))   # every TP rank sees a bad target after the all-reduce
        comm.all_reduce(m, op="max", tag="tp-ce-max")
        flagged = torch.isinf(m) & keep
        if bool(flagged.any()):
            t = target[flagged]
            raise IndexError(f"vocab_parallel_cross_entropy: target {t[0].item()} out of range [0, {full}) (the "
                             f"vocabulary; {int(flagged.sum())} such target(s), or an infinite logit); use "
                             f"ignore_index={ignore_index} for positions without a target")
        z = logits - m.unsqueeze(-1)
        local = target - start
        mine = keep & (local >= 0) & (local < v)
        local = local.clamp(0, v - 1)
        picked = z.gather(-1, local.unsqueeze(-1)).squeeze(-1) * mine
        comm.all_reduce(picked, tag="tp-ce-target")
        e = z.exp()
        if smoothing:
            sums = torch.stack([e.sum(dim=-1), z.sum(dim=-1)])
            comm.all_reduce(sums, tag="tp-ce-sum")
            total, zmean = sums[0], sums[1] / full
        else:
            total, zmean = e.sum(dim=-1), None
            comm.all_reduce(total, tag="tp-ce-sum")
        ctx.save_for_backward(e.div_(total.unsqueeze(-1)), local, mine, keep)
        ctx.smoothing, ctx.full = smoothing, full
        loss = total.log() - picked if not smoothing else total.log() - (1 - smoothing) * picked - smoothing * zmean
        return loss * keep

    @staticmethod
    def backward(ctx, grad):
        softmax, local, mine, keep = ctx.saved_tensors
        eps = ctx.smoothing
        g = softmax.clone()
        if eps:
            g.sub_(eps / ctx.full)
        g.scatter_add_(-1, local.unsqueeze(-1), -(1 - eps) * mine.unsqueeze(-1).to(g.dtype))
        return g * (grad * keep).unsqueeze(-1), None, None, None, None, None


def vocab_parallel_cross_entropy(logits, target, mesh_or_comm, ignore_index: int = -100,
                                 reduction: str = "mean", label_smoothing: float = 0.0):
    """Cross-entropy of ``logits`` (..., V/tp) — this TP rank's slice of the vocabulary, as a
    column-parallel head gives it — against ``target`` (...) token ids in the full vocabulary;
    equals ``F.cross_entropy(full_logits.view(-1, V), target.view(-1), ignore_index=...,
    reduction=..., label_smoothing=...)`` on the gathered logits (``"none"``: ``target``'s shape).
    ``mesh_or_comm``: a ``zl.mesh`` (its TP group) or a TP ``Communicator``."""
    if reduction not in REDUCTIONS:
        raise ValueError(f"vocab_parallel_cross_entropy: reduction={reduction!r}; choose from {list(REDUCTIONS)}")
    if not 0.0 <= label_smoothing <= 1.0:
        raise ValueError(f"vocab_parallel_cross_entropy: label_smoothing={label_smoothing} must be in [0, 1]")
    comm = mesh_or_comm.communicator("tp") if hasattr(mesh_or_comm, "communicator") else mesh_or_comm
    v = logits.shape[-1]
    if target.numel() * v != logits.numel():
        raise ValueError(f"vocab_parallel_cross_entropy: {target.numel()} targets for logits of shape "
                         f"{tuple(logits.shape)} ({logits.numel() // v} tokens)")
    shape = target.shape
    target = target.reshape(logits.shape[:-1])
    loss = VocabParallelCE.apply(logits.float(), target, comm, comm.rank * v, ignore_index, float(label_smoothing))
    if reduction == "none":
        return loss.reshape(shape)
    if reduction == "sum":
        return loss.sum()
    return loss.sum() / (target != ignore_index).sum()
