"""Interleaved 1F1B: v model chunks per rank, Megatron-LM's virtual stages (chapter 10; ``pipeline.py`` is the overview).

Narayanan et al. 2021 ("Efficient Large-Scale Language Model Training on GPU Clusters Using
Megatron-LM", section 2.2.2) cut the blocks into V = p·v *virtual stages* of equal size and
give rank r the chunks c = 0..v-1 holding virtual stage c·p + r: rank 0 holds the 1st and the
(p+1)-th slices, rank 1 the 2nd and (p+2)-th, ... A micro-batch travels around the ranks v
times, each chunk's pass costs 1/v of a stage's, and the fill and drain, p - 1 of them, are
paid in chunks: the bubble falls to (p-1)/(v·m + p-1), for v times more point-to-point
messages.

``virtual_split(n_blocks, p, v)``: per rank, per chunk, its (first, last + 1) block index;
blocks % (p·v) != 0 is refused by name. ``chunked_stage(model, mesh, v)``: this rank's
``ChunkedStage`` (its blocks under their original names; ``forward_chunk(c, x)``; with v = 1
it is the contiguous stage). ``interleaved_order(m, p, s, v)``: Megatron's order of
("F" | "B", micro-batch, chunk) on rank s — the forwards go through micro-batches in groups of p,
chunk by chunk (the k-th forward is chunk (k mod p·v) // p of micro-batch (k // p·v)·p + k mod p),
backwards the same with the chunks reversed; (p - s - 1)·2 + (v - 1)·p warm-up forwards, then
one forward and one backward in turn, then the remaining backwards. It needs m a multiple of p.
"""
from __future__ import annotations

from collections import OrderedDict

import torch
from torch import nn

from zerolab.parallel.pipeline_blocks import as_sequential


def virtual_split(n_blocks: int, p: int, v: int) -> list:
    """``out[r][c]``: the (first, last + 1) block indices of chunk c of rank r (virtual stage c·p + r)."""
    if v < 1 or p < 1:
        raise ValueError(f"virtual_split: pp and the chunks per rank (virtual) must be >= 1, got pp={p}, virtual={v}")
    if n_blocks % (p * v):
        raise ValueError(f"interleaved pipeline: {n_blocks} blocks cannot be cut into pp x virtual = {p} x {v} = "
                         f"{p * v} virtual stages of equal size (blocks % (pp*virtual) must be 0)")
    q = n_blocks // (p * v)
    return [[((c * p + r) * q, (c * p + r + 1) * q) for c in range(v)] for r in range(p)]


def interleaved_order(m: int, p: int, s: int, v: int) -> list:
    """Rank ``s``'s ("F" | "B", micro-batch, chunk) under interleaved 1F1B (module docstring)."""
    if m % p:
        raise ValueError(f"interleaved 1F1B needs the micro-batches to be a multiple of pp: {m} micro-batches, pp={p}")
    total = m * v
    warm = min((p - s - 1) * 2 + (v - 1) * p, total)

    def action(op, k):
        c = (k % (p * v)) // p
        return op, (k // (p * v)) * p + k % p, (c if op == "F" else v - 1 - c)

    out = [action("F", k) for k in range(warm)]
    for j in range(total - warm):
        out += [action("F", warm + j), action("B", j)]
    return out + [action("B", k) for k in range(total - warm, total)]


class ChunkedStage(nn.Module):
    """Rank r's v chunks: each a run of blocks (virtual stage c·p + r), plus the embeddings on virtual
    stage 0 and the final LayerNorm and head on the last (a GPT-shaped model), under the original names."""

    def __init__(self, model, bounds, p, r, gpt):
        super().__init__()
        self.v, self.gpt = len(bounds), gpt
        self.virtual = [c * p + r for c in range(self.v)]            # each chunk's virtual stage
        self.n_virtual = p * self.v
        self.chunk_blocks = [list(range(lo, hi)) for lo, hi in bounds]
        self.tied, self.tied_copies = [], []
        first, last = r == 0, r == p - 1
        if gpt:
            if first:
                self.wte, self.wpe = model.wte, model.wpe
            self.blocks = nn.ModuleDict(OrderedDict((str(i), model.blocks[i]) for b in self.chunk_blocks for i in b))
            if last:
                self.ln_f, self.head = model.ln_f, model.head
        else:
            for b in self.chunk_blocks:
                for i in b:
                    self.add_module(str(i), model[i])

    def forward_chunk(self, c: int, x):
        """Chunk ``c``'s forward: its blocks in order (the embedding first on virtual stage 0, the head
        last on virtual stage p·v - 1)."""
        j = self.virtual[c]
        if self.gpt and j == 0:
            x = self.wte(x) + self.wpe(torch.arange(x.shape[1], device=x.device))
        for i in self.chunk_blocks[c]:
            x = (self.blocks[str(i)] if self.gpt else getattr(self, str(i)))(x)
        if self.gpt and j == self.n_virtual - 1:
            x = self.head(self.ln_f(x))
        return x

    def forward(self, x):
        raise TypeError(f"ChunkedStage holds {self.v} chunks: call forward_chunk(c, x) (train_batch does, under "
                        f"the 'interleaved' schedule)")


def chunked_stage(model, mesh, v: int) -> ChunkedStage:
    """This rank's v chunks of ``model`` (an ``nn.Sequential`` or list of blocks, or a GPT-shaped model
    with ``wte, wpe, blocks, ln_f, head``); ``pipeline_stage(model, mesh, virtual=v)`` calls it."""
    p, r = mesh.pp, mesh.pp_rank
    if p < 2:
        raise ValueError(f"pipeline_stage(virtual={v}): interleaving needs a pipeline (pp >= 2), got pp={p}")
    gpt = all(hasattr(model, a) for a in ("wte", "wpe", "blocks", "ln_f", "head"))
    if gpt:
        if p > 1 and model.head.weight is model.wte.weight:
            raise ValueError("pipeline_stage(virtual > 1): a head tied to the embedding is not implemented with "
                             "virtual stages; build the model with tie_weights=False")
        n = len(model.blocks)
    else:
        model = as_sequential(model)
        n = len(model)
    bounds = virtual_split(n, p, v)
    if not gpt:
        mine = {id(q) for lo, hi in bounds[r] for i in range(lo, hi) for q in model[i].parameters()}
        others = {id(q) for k in range(p) if k != r for lo, hi in bounds[k] for i in range(lo, hi)
                  for q in model[i].parameters()}
        if mine & others:
            raise ValueError("pipeline_stage: a parameter is shared between blocks of different ranks; only a GPT's "
                             "embedding tied to its head may cross stages")
    stage = ChunkedStage(model, bounds[r], p, r, gpt)
    stage.pipeline_position = (r, p)
    return stage
