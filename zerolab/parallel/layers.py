"""Tensor-parallel layers (Megatron-LM's scheme), each built from the plain layer it replaces (chapter 10).

* ``ColumnParallelLinear``: ``nn.Linear``'s weight split by output rows —
  TP rank r keeps rows ``r*out/tp .. (r+1)*out/tp`` and its bias slice. Input
  through f (identity forward, all-reduce backward); output: this rank's
  slice of the features (``gather_output=True``: all-gathered, whole).
* ``RowParallelLinear``: the weight split by input columns; its input is
  already split (a column-parallel layer's output); the partial products are
  summed by g (all-reduce forward). The bias is kept whole on every rank and
  added after the sum, once.
* ``VocabParallelEmbedding``: the embedding table split by vocabulary rows;
  a token outside this rank's rows looks up zeros, and g sums the ranks'
  rows into the full embedding. A ``padding_idx`` row gets no gradient, as
  in ``nn.Embedding`` (on the rank that holds it). Gemma's scaled embedding
  (an ``embed_scale`` buffer) multiplies the lookup by it, as the original.

Each layer records which dimension of each parameter is split in
``tp_dims`` (``{"weight": (dim, parts), ...}``; parts > 1 for a fused
q|k|v); a parameter not listed is replicated. Hugging Face's ``Conv1D``
(GPT-2) is converted as the ``nn.Linear`` it is, transposed.
Sequence parallelism (``sequence_parallel`` set by ``tensor_parallel(...,
sequence_parallel=True)``): a column-parallel layer all-gathers its
sequence-split input (``"gather"``) or reads an input its parent already
gathered (``"gathered"``: an attention module's q, k, v); a row-parallel
layer and the embedding reduce-scatter their sum along the sequence.
Attention heads: split q, k, v column-wise and each rank computes
``n_head/tp`` whole heads; the output projection is row-parallel.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from zerolab.parallel.ops import (copy_to_tp, gather_from_sequence, gather_from_tp, reduce_from_tp,
                                  reduce_scatter_to_sequence)


def shard(t: torch.Tensor, dim: int, comm, parts: int = 1) -> torch.Tensor:
    """This TP rank's contiguous slice of ``t`` along ``dim`` (a copy). ``parts`` > 1: ``t`` is
    ``parts`` blocks side by side (a fused q|k|v), and the rank takes its slice of each block."""
    n, r = comm.world_size, comm.rank
    pieces = [b.chunk(n, dim=dim)[r] for b in t.detach().chunk(parts, dim=dim)]
    return torch.cat(pieces, dim=dim).clone(memory_format=torch.contiguous_format)


def unshard(pieces: list, dim: int, parts: int = 1) -> torch.Tensor:
    """The inverse of ``shard``: every TP rank's piece, in rank order, back into the full tensor."""
    blocks = [p.chunk(parts, dim=dim) for p in pieces]
    return torch.cat([torch.cat([b[j] for b in blocks], dim=dim) for j in range(parts)], dim=dim)


def _split_param(p, dim, comm, memo, parts=1):
    """The slice of parameter ``p`` along ``dim`` as a new Parameter; one parameter used twice (a
    tied weight) split the same way becomes one Parameter again (``memo``)."""
    key = (id(p), dim, parts)
    if key not in memo:   # the memo keeps ``p`` alive: a freed temporary (as_linear's) must not pass its id on
        piece = nn.Parameter(shard(p, dim, comm, parts), requires_grad=p.requires_grad)
        piece.tensor_parallel = True   # a slice, different on each TP rank (the engine's norm counts each)
        memo[key] = (p, piece)
    return memo[key][1]


def as_linear(module) -> nn.Linear:
    """An ``nn.Linear``, or Hugging Face's ``Conv1D`` (GPT-2: the same map with the weight stored
    transposed, in × out) as an ``nn.Linear`` with the same values (out × in)."""
    if isinstance(module, nn.Linear):
        return module
    lin = nn.Linear(module.nx, module.nf, bias=module.bias is not None, device="meta")
    lin.weight = nn.Parameter(module.weight.detach().t(), requires_grad=module.weight.requires_grad)
    lin.bias = module.bias
    return lin


def _check_divides(what, value, comm, name):
    if value % comm.world_size:
        raise ValueError(f"{name}: tp={comm.world_size} does not divide {what}={value}")


class ColumnParallelLinear(nn.Module):
    """``y[..., rows of this rank] = x W_rᵀ + b_r`` (f before it). ``parts=3``: the rows are a fused
    q|k|v and each rank keeps its rows of each (its heads' q, k and v: GPT-2's ``c_attn``)."""

    sequence_parallel = False   # or "gather" / "gathered" (module docstring)

    def __init__(self, linear: nn.Linear, comm, gather_output: bool = False, memo=None, name="linear",
                 parts: int = 1):
        super().__init__()
        self.tp_name = name
        _check_divides("out_features", linear.out_features // parts, comm, name)
        memo = {} if memo is None else memo
        self.comm, self.gather_output, self.parts = comm, gather_output, parts
        self.tp_dims = {"weight": (0, parts), "bias": (0, parts)}
        self.in_features, self.out_features = linear.in_features, linear.out_features // comm.world_size
        self.weight = _split_param(linear.weight, 0, comm, memo, parts)
        self.bias = None if linear.bias is None else _split_param(linear.bias, 0, comm, memo, parts)

    def tp_shapes(self) -> dict:
        """This rank's shape of each split parameter (also once ZeRO-3 has released its values)."""
        return {"weight": (self.out_features, self.in_features), "bias": (self.out_features,)}

    def forward(self, x):
        if self.sequence_parallel == "gather":
            x = gather_from_sequence(x, self.comm, self.tp_name)
        elif not self.sequence_parallel:
            x = copy_to_tp(x, self.comm)
        y = F.linear(x, self.weight, self.bias)
        return gather_from_tp(y, self.comm) if self.gather_output else y

    def extra_repr(self):
        return (f"in_features={self.in_features}, out_features={self.out_features} (of "
                f"{self.out_features * self.comm.world_size}), tp={self.comm.world_size}, "
                f"gather_output={self.gather_output}")


class RowParallelLinear(nn.Module):
    """``y = g(x_r W_rᵀ) + b``: ``x_r`` this rank's slice of the input features."""
    tp_dims = {"weight": (1, 1)}
    sequence_parallel = False   # True: the sum reduce-scattered along the sequence

    def __init__(self, linear: nn.Linear, comm, memo=None, name="linear"):
        super().__init__()
        self.tp_name = name
        _check_divides("in_features", linear.in_features, comm, name)
        memo = {} if memo is None else memo
        self.comm = comm
        self.in_features, self.out_features = linear.in_features // comm.world_size, linear.out_features
        self.weight = _split_param(linear.weight, 1, comm, memo)
        self.bias = linear.bias   # replicated: added once, after the sum

    def tp_shapes(self) -> dict:
        return {"weight": (self.out_features, self.in_features)}

    def forward(self, x):
        y = F.linear(x, self.weight)
        y = reduce_scatter_to_sequence(y, self.comm, self.tp_name) if self.sequence_parallel else \
            reduce_from_tp(y, self.comm)
        return y if self.bias is None else y + self.bias

    def extra_repr(self):
        return (f"in_features={self.in_features} (of {self.in_features * self.comm.world_size}), "
                f"out_features={self.out_features}, tp={self.comm.world_size}")


class VocabParallelEmbedding(nn.Module):
    """An ``nn.Embedding`` whose rows (the vocabulary) are split over the TP ranks."""
    tp_dims = {"weight": (0, 1)}
    sequence_parallel = False   # True: the sum reduce-scattered along the sequence

    def __init__(self, emb: nn.Embedding, comm, memo=None, name="embedding"):
        super().__init__()
        self.tp_name = name
        _check_divides("the vocabulary (num_embeddings)", emb.num_embeddings, comm, name)
        if emb.max_norm is not None or emb.sparse:
            raise ValueError(f"{name}: a vocabulary-parallel embedding supports no max_norm or sparse gradients")
        memo = {} if memo is None else memo
        self.comm = comm
        self.num_embeddings = emb.num_embeddings // comm.world_size
        self.embedding_dim = emb.embedding_dim
        self.start = comm.rank * self.num_embeddings
        self.weight = _split_param(emb.weight, 0, comm, memo)
        # the padding row (its gradient always zero, as nn.Embedding's): on the rank that holds it, local index
        scale = getattr(emb, "embed_scale", None)   # Gemma's scaled embedding: the lookup times embed_scale
        self.register_buffer("embed_scale", None if scale is None else scale.detach().clone(), persistent=False)
        pad = emb.padding_idx
        self.padding_idx = pad - self.start if pad is not None and 0 <= pad - self.start < self.num_embeddings else None

    def tp_shapes(self) -> dict:
        return {"weight": (self.num_embeddings, self.embedding_dim)}

    def forward(self, idx):
        full = self.num_embeddings * self.comm.world_size   # ids are the same on every TP rank: all raise alike
        if bool(((idx < 0) | (idx >= full)).any()):
            bad = idx[(idx < 0) | (idx >= full)]
            raise IndexError(f"{self.tp_name}: token id {bad[0].item()} out of range [0, {full}) (the vocabulary "
                             f"of the embedding; {bad.numel()} such id(s)), as nn.Embedding refuses it")
        local = idx - self.start
        outside = (local < 0) | (local >= self.num_embeddings)
        out = F.embedding(local.masked_fill(outside, 0), self.weight, self.padding_idx)
        out = out.masked_fill(outside.unsqueeze(-1), 0.0)
        if self.embed_scale is not None:
            out = out * self.embed_scale.to(out.dtype)
        if self.sequence_parallel:
            return reduce_scatter_to_sequence(out, self.comm, self.tp_name)
        return reduce_from_tp(out, self.comm)

    def extra_repr(self):
        return (f"rows {self.start}..{self.start + self.num_embeddings} of "
                f"{self.num_embeddings * self.comm.world_size}, dim={self.embedding_dim}, tp={self.comm.world_size}")
