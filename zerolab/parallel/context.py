"""Context parallelism: one sequence split over the ranks of a ``"cp"`` group (chapter 11).

Long sequences fill memory with activations (``zl.activation_memory``: linear in s,
and s² for the attention scores unless they are recomputed), which neither ZeRO
(model states) nor tensor parallelism (per-token work split, every token on every
rank) shrinks for the tokens themselves. Context parallelism gives each of cp ranks
s/cp consecutive tokens of every sequence. Everything token-wise (embeddings,
LayerNorm, the MLP, the q, k, v and output projections) runs on the local tokens
unchanged; only attention needs other ranks' tokens, in one of two ways:

* ``method="ulysses"`` (``context_ulysses.py``): all-to-all to full sequence and
  heads/cp per rank, plain attention, all-to-all back. Heads must divide by cp.
* ``method="ring"`` (``context_ring.py``): K/V chunks passed around the ring,
  combined by the online softmax; backward a second ring pass. Any head count.

The parameters are the same on every cp rank and each sees different tokens, so
their gradients are averaged over the cp ranks too: ``zl.initialize(..., mesh=m)``
with cp > 1 averages over the ``"dp_cp"`` group (``Mesh.grad_group``), dp·cp ranks.
Each rank's loss is the mean over its own tokens; with equal chunks the mean over
dp·cp ranks of those is the mean over the whole batch.

``ContextParallelAttention`` is a causal self-attention block whose attention is
either (``comm=None``: plain, the single-process reference); ``ContextParallelLM``
a small language model around it for the chapter and the tests.
"""
from __future__ import annotations

import torch
from torch import nn

from zerolab.parallel.context_ring import ring_attention
from zerolab.parallel.context_ulysses import attention, check_heads, ulysses_attention

METHODS = ("ulysses", "ring")

__all__ = ["attention", "ulysses_attention", "ring_attention", "context_attention", "split_sequence",
           "ContextParallelAttention", "ContextParallelLM", "METHODS"]


def _check_method(method):
    if method not in METHODS:
        raise ValueError(f"context parallelism: method must be one of {METHODS}, got {method!r}")


def context_attention(q, k, v, comm=None, method: str = "ulysses", causal: bool = True):
    """Causal attention of this rank's ``[b, s/cp, H, d]`` q, k, v over the whole sequence held by the
    ranks of ``comm`` (the mesh's ``"cp"`` communicator); plain attention without one (or with cp = 1)."""
    _check_method(method)
    if comm is None or comm.world_size == 1:
        return attention(q, k, v, causal)
    return (ulysses_attention if method == "ulysses" else ring_attention)(q, k, v, comm, causal)


def split_sequence(x, comm, dim: int = 1):
    """This cp rank's chunk of the whole sequence ``x`` (dimension ``dim``): chunk ``comm.rank`` of cp.
    A sequence cp does not divide is refused by name."""
    n = 1 if comm is None else comm.world_size
    if x.shape[dim] % n:
        raise ValueError(f"context parallelism: cp={n} does not divide the sequence length {x.shape[dim]} "
                         f"(dimension {dim} of a {tuple(x.shape)} tensor); pad the sequence to a multiple of cp")
    return x if n == 1 else x.chunk(n, dim=dim)[comm.rank].contiguous()


class ContextParallelAttention(nn.Module):
    """Causal self-attention on ``[b, s/cp, C]`` (this rank's tokens): q, k, v projected locally,
    attention over the whole sequence by ``method``, the output projection locally. ``n_kv_head``:
    grouped-query attention (default ``n_head``)."""

    def __init__(self, n_embd: int, n_head: int, n_kv_head: int | None = None, comm=None, method: str = "ulysses"):
        super().__init__()
        _check_method(method)
        n_kv_head = n_head if n_kv_head is None else n_kv_head
        if n_embd % n_head or n_head % n_kv_head:
            raise ValueError(f"ContextParallelAttention: n_head={n_head} must divide n_embd={n_embd} and "
                             f"n_kv_head={n_kv_head} must divide n_head")
        self.n_head, self.n_kv_head, self.d = n_head, n_kv_head, n_embd // n_head
        cp = 1 if comm is None else comm.world_size
        if method == "ulysses" and cp > 1:   # refused at construction, before any collective
            check_heads(torch.empty(1, 1, n_head, 1), torch.empty(1, 1, n_kv_head, 1), cp,
                        "ContextParallelAttention(method='ulysses')")
        self.comm, self.method = comm, method
        self.q = nn.Linear(n_embd, n_embd, bias=False)
        self.k = nn.Linear(n_embd, n_kv_head * self.d, bias=False)
        self.v = nn.Linear(n_embd, n_kv_head * self.d, bias=False)
        self.proj = nn.Linear(n_embd, n_embd, bias=False)

    def forward(self, x):
        b, s, _ = x.shape
        # heads from the projections' widths: under tensor parallelism q, k, v hold 1/tp of them (chapter 10)
        q = self.q(x).view(b, s, -1, self.d)
        k = self.k(x).view(b, s, -1, self.d)
        v = self.v(x).view(b, s, -1, self.d)
        return self.proj(context_attention(q, k, v, self.comm, self.method).reshape(b, s, -1))


class ContextParallelLM(nn.Module):
    """A small causal language model whose attention is context-parallel: token and position
    embeddings, ``layers`` pre-LayerNorm blocks (attention, MLP), a head. ``forward(idx)`` takes this
    rank's ``[b, s/cp]`` tokens (``split_sequence``) and returns their logits; positions start at
    ``comm.rank · s/cp``. With ``comm=None`` it is the plain model on whole sequences."""

    def __init__(self, vocab=64, n_embd=32, n_head=4, n_kv_head=None, layers=2, max_seq=64, comm=None,
                 method="ulysses", seed=0):
        super().__init__()
        torch.manual_seed(seed)
        self.comm = comm
        self.wte, self.wpe = nn.Embedding(vocab, n_embd), nn.Embedding(max_seq, n_embd)
        self.blocks = nn.ModuleList(nn.ModuleDict({
            "ln1": nn.LayerNorm(n_embd), "attn": ContextParallelAttention(n_embd, n_head, n_kv_head, comm, method),
            "ln2": nn.LayerNorm(n_embd), "mlp": nn.Sequential(nn.Linear(n_embd, 4 * n_embd), nn.GELU(),
                                                              nn.Linear(4 * n_embd, n_embd))}) for _ in range(layers))
        self.ln_f, self.head = nn.LayerNorm(n_embd), nn.Linear(n_embd, vocab, bias=False)

    def forward(self, idx):
        s = idx.shape[1]
        start = 0 if self.comm is None else self.comm.rank * s
        x = self.wte(idx) + self.wpe(torch.arange(start, start + s, device=idx.device))
        for blk in self.blocks:
            x = x + blk["attn"](blk["ln1"](x))
            x = x + blk["mlp"](blk["ln2"](x))
        return self.head(self.ln_f(x))
