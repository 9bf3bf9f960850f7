"""The conjugate operators of tensor parallelism, and the vocabulary-parallel cross-entropy (chapter 10).

Megatron-LM (Shoeybi et al. 2019, section 3) makes a transformer layer
tensor-parallel with two operators that are each other's transpose:

* **f** — identity in forward, all-reduce in backward. It stands before a
  column-parallel layer: every TP rank reads the same input, and the input's
  gradient is the sum of what each rank's slice of the weight sends back.
* **g** — all-reduce in forward, identity in backward. It stands after a
  row-parallel layer: each rank has a partial sum of the output; the output's
  gradient reaches every rank whole.

So an MLP or attention block costs one all-reduce of the activations (b·s·h
elements) in forward (g) and one in backward (f). ``gather`` (all-gather
along the last dimension; backward: keep this rank's slice) gives a
column-parallel layer's full output when a later layer needs it whole.

``vocab_parallel_cross_entropy`` (``cross_entropy.py``, re-exported here): the
loss over logits split along the vocabulary without gathering them.

Sequence parallelism (Korthikanti et al. 2022, Megatron-LM): between the TP
regions the activations are split along the sequence (dimension ``SEQ`` = -2:
``(B, T, C)`` and a position table's ``(T, C)``), so LayerNorm and dropout run
on T/tp tokens per rank. f and g become their sequence forms, each one half of
an all-reduce (an all-reduce = a reduce-scatter + an all-gather):

* ``gather_from_sequence`` (replaces f) — all-gather along the sequence
  forward; reduce-scatter backward;
* ``reduce_scatter_to_sequence`` (replaces g) — reduce-scatter along the
  sequence forward; all-gather backward;
* ``scatter_to_sequence`` — keep this rank's T/tp rows forward (no
  communication); all-gather backward (a position embedding's output).

Every collective goes through the mesh's TP ``Communicator``, so the ledger
books it under ``group="tp"``.
"""
from __future__ import annotations

import torch

from zerolab.parallel.cross_entropy import vocab_parallel_cross_entropy  # noqa: F401  (re-exported)


class CopyToTP(torch.autograd.Function):
    """f: identity forward, all-reduce (sum) of the gradient over the TP group backward."""

    @staticmethod
    def forward(ctx, x, comm):
        ctx.comm = comm
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        grad = grad.contiguous().clone()
        ctx.comm.all_reduce(grad, tag="tp-f")
        return grad, None


class ReduceFromTP(torch.autograd.Function):
    """g: all-reduce (sum) over the TP group forward, identity backward."""

    @staticmethod
    def forward(ctx, x, comm):
        y = x.contiguous().clone()
        comm.all_reduce(y, tag="tp-g")
        return y

    @staticmethod
    def backward(ctx, grad):
        return grad, None


class GatherFromTP(torch.autograd.Function):
    """All-gather along the last dimension in TP rank order forward; backward: this rank's slice."""

    @staticmethod
    def forward(ctx, x, comm):
        ctx.comm, n = comm, comm.world_size
        x = x.contiguous()
        out = torch.empty(n * x.numel(), dtype=x.dtype, device=x.device)
        comm.all_gather(out, x.view(-1), tag="tp-gather")
        return torch.cat(out.view(n, *x.shape).unbind(0), dim=-1)

    @staticmethod
    def backward(ctx, grad):
        return grad.chunk(ctx.comm.world_size, dim=-1)[ctx.comm.rank].contiguous(), None


SEQ = -2   # the sequence dimension of (B, T, C) activations and of a (T, C) position table


def check_sequence(x, comm, where: str = "") -> None:
    """A sequence length tp does not divide cannot be split: a ``ValueError`` naming both."""
    t = x.shape[SEQ] if x.dim() >= 2 else None
    if t is None or t % comm.world_size:
        raise ValueError(f"sequence parallelism{' at ' + repr(where) if where else ''}: tp={comm.world_size} does not "
                         f"divide the sequence length {t} (dimension {SEQ} of a {tuple(x.shape)} tensor); use a "
                         f"sequence length divisible by tp, or sequence_parallel=False")


def _seq_gather(x, comm, tag):
    n, xt = comm.world_size, x.movedim(SEQ, 0).contiguous()
    out = torch.empty((n * xt.shape[0],) + tuple(xt.shape[1:]), dtype=x.dtype, device=x.device)
    comm.all_gather(out.view(-1), xt.view(-1), tag=tag)
    return out.movedim(0, SEQ)


def _seq_reduce_scatter(x, comm, tag):
    xt = x.movedim(SEQ, 0).contiguous()
    out = torch.empty((xt.shape[0] // comm.world_size,) + tuple(xt.shape[1:]), dtype=x.dtype, device=x.device)
    comm.reduce_scatter(out.view(-1), xt.view(-1), tag=tag)
    return out.movedim(0, SEQ)


class ScatterToSequence(torch.autograd.Function):
    """This rank's T/tp rows forward; all-gather of the gradient along the sequence backward."""

    @staticmethod
    def forward(ctx, x, comm):
        ctx.comm = comm
        return x.chunk(comm.world_size, dim=SEQ)[comm.rank].contiguous()

    @staticmethod
    def backward(ctx, grad):
        return _seq_gather(grad, ctx.comm, "sp-scatter-bwd"), None


class GatherFromSequence(torch.autograd.Function):
    """All-gather along the sequence forward (entering a column-parallel region); reduce-scatter backward."""

    @staticmethod
    def forward(ctx, x, comm):
        ctx.comm = comm
        return _seq_gather(x, comm, "sp-gather")

    @staticmethod
    def backward(ctx, grad):
        return _seq_reduce_scatter(grad, ctx.comm, "sp-gather-bwd"), None


class ReduceScatterToSequence(torch.autograd.Function):
    """Reduce-scatter along the sequence forward (leaving a row-parallel region); all-gather backward."""

    @staticmethod
    def forward(ctx, x, comm):
        ctx.comm = comm
        return _seq_reduce_scatter(x, comm, "sp-reduce-scatter")

    @staticmethod
    def backward(ctx, grad):
        return _seq_gather(grad, ctx.comm, "sp-reduce-scatter-bwd"), None


def scatter_to_sequence(x, comm, where: str = ""):
    """This rank's rows of the sequence (see the module docstring)."""
    check_sequence(x, comm, where)
    return ScatterToSequence.apply(x, comm) if comm.world_size > 1 else x


def gather_from_sequence(x, comm, where: str = ""):
    """The whole sequence from every rank's rows (f's sequence form)."""
    return GatherFromSequence.apply(x, comm) if comm.world_size > 1 else x


def reduce_scatter_to_sequence(x, comm, where: str = ""):
    """The sum over the TP group, this rank's rows of the sequence (g's sequence form)."""
    check_sequence(x, comm, where)
    return ReduceScatterToSequence.apply(x, comm) if comm.world_size > 1 else x


def copy_to_tp(x, comm):
    """f (see the module docstring)."""
    return CopyToTP.apply(x, comm) if comm.world_size > 1 else x


def reduce_from_tp(x, comm):
    """g (see the module docstring)."""
    return ReduceFromTP.apply(x, comm) if comm.world_size > 1 else x


def gather_from_tp(x, comm):
    """The full last dimension from every TP rank's slice."""
    return GatherFromTP.apply(x, comm) if comm.world_size > 1 else x
