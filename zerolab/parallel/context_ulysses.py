"""DeepSpeed-Ulysses: context parallelism by two all-to-alls around attention (chapter 11).

Jacobs et al. 2023 ("DeepSpeed Ulysses"). Each of the cp ranks of a ``"cp"`` group
holds s/cp consecutive tokens of every sequence. Everything but attention works
token by token, so the q, k, v projections run on the local tokens as they are:
q is ``[b, s/cp, H, d]`` on each rank. Attention needs every token of a head, so
an all-to-all trades the split: rank r sends its j-th group of H/cp heads to
rank j and receives, from every rank i, the i-th chunk of the sequence for its
own heads. Afterwards rank r holds ``[b, s, H/cp, d]``: the whole sequence,
heads ``r·H/cp .. (r+1)·H/cp - 1``. Plain (causal) attention runs per head, and a
second all-to-all turns ``[b, s, H/cp, d]`` back into ``[b, s/cp, H, d]``::

    sequence-split, all heads  --all-to-all-->  all of the sequence, H/cp heads
    (q, k, v: 3 all-to-alls)       attention         (the output: 1 all-to-all back)

The backward of an all-to-all is the inverse all-to-all (the same exchange with
the roles of the two dimensions swapped), so a layer costs 4 all-to-alls forward
and 4 backward, each of one rank's q-, k-, v- or output-sized tensor
(``theory/context.py`` has the bytes). H and the key/value heads (grouped-query
attention) must divide by cp: a head is never cut.

Every all-to-all goes through the ``"cp"`` group's ``Communicator`` (``zl.mesh(cp=)``),
so the ledger books it under ``group="cp"``.
"""
from __future__ import annotations

import torch

SEQ, HEADS = 1, 2   # the dimensions of a [b, s, H, d] tensor


def check_heads(q, k, cp: int, where: str = "Ulysses") -> None:
    """Query and key/value heads must divide by cp (a head is never cut): a named ``ValueError``."""
    for what, t in (("query", q), ("key/value", k)):
        if t.dim() != 4:
            raise ValueError(f"{where}: q, k, v must be [batch, sequence, heads, head_dim] tensors; the {what} "
                             f"tensor has shape {tuple(t.shape)}")
        if t.shape[HEADS] % cp:
            raise ValueError(f"{where}: cp={cp} does not divide the {t.shape[HEADS]} {what} heads; Ulysses gives "
                             f"each rank heads/cp whole heads — choose cp dividing both the query and key/value "
                             f"heads, or ring attention (method='ring'), which splits only the sequence")


def _exchange(x, comm, scatter: int, gather: int, tag: str):
    """One all-to-all: ``x`` cut in cp pieces along ``scatter`` (piece j to rank j); the pieces received
    (from rank i: piece i) joined along ``gather``."""
    n = comm.world_size
    send = torch.stack(x.chunk(n, dim=scatter)).contiguous()   # [cp, ...]: row j goes to rank j
    recv = torch.empty_like(send)                               # row i: what rank i sent this rank
    comm.all_to_all(recv.view(-1), send.view(-1), tag=tag)
    return torch.cat(recv.unbind(0), dim=gather)


class AllToAll(torch.autograd.Function):
    """Forward: split ``scatter``, join ``gather``; backward: the inverse (split ``gather``, join ``scatter``)."""

    @staticmethod
    def forward(ctx, x, comm, scatter, gather, tag):
        ctx.comm, ctx.dims, ctx.tag = comm, (scatter, gather), tag
        return _exchange(x, comm, scatter, gather, tag)

    @staticmethod
    def backward(ctx, grad):
        scatter, gather = ctx.dims
        return _exchange(grad.contiguous(), ctx.comm, gather, scatter, ctx.tag + "-bwd"), None, None, None, None


def seq_to_heads(x, comm, tag: str = "ulysses-in"):
    """``[b, s/cp, H, d]`` (this rank's tokens, every head) -> ``[b, s, H/cp, d]`` (every token, this
    rank's heads)."""
    return AllToAll.apply(x, comm, HEADS, SEQ, tag) if comm.world_size > 1 else x


def heads_to_seq(x, comm, tag: str = "ulysses-out"):
    """The inverse: ``[b, s, H/cp, d]`` -> ``[b, s/cp, H, d]``."""
    return AllToAll.apply(x, comm, SEQ, HEADS, tag) if comm.world_size > 1 else x


def expand_kv(t, heads: int):
    """``[b, Hkv, s, d]`` key/value heads repeated for ``heads`` query heads (query head i reads
    key/value head i // (heads/Hkv), grouped-query attention); as it is when Hkv == heads."""
    return t if t.shape[1] == heads else t.repeat_interleave(heads // t.shape[1], dim=1)


def attention(q, k, v, causal: bool = True):
    """Plain softmax attention on ``[b, s, H, d]`` q and ``[b, s, Hkv, d]`` k, v (Hkv dividing H):
    the single-process reference, and what Ulysses runs between its all-to-alls."""
    if q.shape[HEADS] % k.shape[HEADS]:
        raise ValueError(f"attention: {k.shape[HEADS]} key/value heads do not divide {q.shape[HEADS]} query heads")
    q, k, v = (t.transpose(1, 2) for t in (q, k, v))   # [b, H, s, d]
    k, v = expand_kv(k, q.shape[1]), expand_kv(v, q.shape[1])
    scores = q @ k.transpose(-1, -2) * q.shape[-1] ** -0.5
    if causal:
        s = scores.shape[-1]
        scores = scores.masked_fill(torch.ones(s, s, dtype=torch.bool, device=q.device).triu(1), float("-inf"))
    return (scores.softmax(-1) @ v).transpose(1, 2)


def ulysses_attention(q, k, v, comm, causal: bool = True):
    """Attention over the whole sequence from this rank's ``[b, s/cp, H, d]`` q, k, v (k, v may have
    fewer heads: grouped-query attention); returns this rank's ``[b, s/cp, H, d]`` output."""
    check_heads(q, k, comm.world_size)
    q, k, v = (seq_to_heads(t, comm, f"ulysses-{n}") for t, n in ((q, "q"), (k, "k"), (v, "v")))
    return heads_to_seq(attention(q, k, v, causal), comm, "ulysses-out")
