"""Tensor-parallel layers (Megatron-LM's scheme), each built from the plain layer it replaces (chapter 11).

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
  rows into the full embedding.

Each layer records which dimension of each parameter is split in
``tp_dims`` (``{"weight": 0, ...}``); a parameter not listed is replicated.
Attention heads: split q, k, v column-wise and each rank computes
``n_head/tp`` whole heads; the output projection is row-parallel.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from zerolab.parallel.ops import copy_to_tp, gather_from_tp, reduce_from_tp


def shard(t: torch.Tensor, dim: int, comm) -> torch.Tensor:
    """This TP rank's contiguous slice of ``t`` along ``dim`` (a copy)."""
    return t.detach().chunk(comm.world_size, dim=dim)[comm.rank].clone()


def _split_param(p, dim, comm, memo):
    """The slice of parameter ``p`` along ``dim`` as a new Parameter; one parameter used twice (a
    tied weight) split the same way becomes one Parameter again (``memo``)."""
    key = (id(p), dim)
    if key not in memo:
        memo[key] = nn.Parameter(shard(p, dim, comm), requires_grad=p.requires_grad)
    return memo[key]


def _check_divides(what, value, comm, name):
    if value % comm.world_size:
        raise ValueError(f"{name}: tp={comm.world_size} does not divide {what}={value}")


class ColumnParallelLinear(nn.Module):
    """``y[..., rows of this rank] = x W_rᵀ + b_r`` (f before it)."""
    tp_dims = {"weight": 0, "bias": 0}

    def __init__(self, linear: nn.Linear, comm, gather_output: bool = False, memo=None, name="linear"):
        super().__init__()
        _check_divides("out_features", linear.out_features, comm, name)
        memo = {} if memo is None else memo
        self.comm, self.gather_output = comm, gather_output
        self.in_features, self.out_features = linear.in_features, linear.out_features // comm.world_size
        self.weight = _split_param(linear.weight, 0, comm, memo)
        self.bias = None if linear.bias is None else _split_param(linear.bias, 0, comm, memo)

    def forward(self, x):
        y = F.linear(copy_to_tp(x, self.comm), self.weight, self.bias)
        return gather_from_tp(y, self.comm) if self.gather_output else y

    def extra_repr(self):
        return (f"in_features={self.in_features}, out_features={self.out_features} (of "
                f"{self.out_features * self.comm.world_size}), tp={self.comm.world_size}, "
                f"gather_output={self.gather_output}")


class RowParallelLinear(nn.Module):
    """``y = g(x_r W_rᵀ) + b``: ``x_r`` this rank's slice of the input features."""
    tp_dims = {"weight": 1}

    def __init__(self, linear: nn.Linear, comm, memo=None, name="linear"):
        super().__init__()
        _check_divides("in_features", linear.in_features, comm, name)
        memo = {} if memo is None else memo
        self.comm = comm
        self.in_features, self.out_features = linear.in_features // comm.world_size, linear.out_features
        self.weight = _split_param(linear.weight, 1, comm, memo)
        self.bias = linear.bias   # replicated: added once, after the sum

    def forward(self, x):
        y = reduce_from_tp(F.linear(x, self.weight), self.comm)
        return y if self.bias is None else y + self.bias

    def extra_repr(self):
        return (f"in_features={self.in_features} (of {self.in_features * self.comm.world_size}), "
                f"out_features={self.out_features}, tp={self.comm.world_size}")


class VocabParallelEmbedding(nn.Module):
    """An ``nn.Embedding`` whose rows (the vocabulary) are split over the TP ranks."""
    tp_dims = {"weight": 0}

    def __init__(self, emb: nn.Embedding, comm, memo=None, name="embedding"):
        super().__init__()
        _check_divides("the vocabulary (num_embeddings)", emb.num_embeddings, comm, name)
        if emb.padding_idx is not None or emb.max_norm is not None or emb.sparse:
            raise ValueError(f"{name}: a vocabulary-parallel embedding supports no padding_idx, max_norm or "
                             f"sparse gradients")
        memo = {} if memo is None else memo
        self.comm = comm
        self.num_embeddings = emb.num_embeddings // comm.world_size
        self.embedding_dim = emb.embedding_dim
        self.start = comm.rank * self.num_embeddings
        self.weight = _split_param(emb.weight, 0, comm, memo)

    def forward(self, idx):
        local = idx - self.start
        outside = (local < 0) | (local >= self.num_embeddings)
        out = F.embedding(local.masked_fill(outside, 0), self.weight)
        out = out.masked_fill(outside.unsqueeze(-1), 0.0)
        return reduce_from_tp(out, self.comm)

    def extra_repr(self):
        return (f"rows {self.start}..{self.start + self.num_embeddings} of "
                f"{self.num_embeddings * self.comm.world_size}, dim={self.embedding_dim}, tp={self.comm.world_size}")
