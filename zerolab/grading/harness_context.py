"""Helpers for exercise 10 (DeepSpeed-Ulysses' all-to-all, chapter 11): the learner's layout checked
against a real run.

* ``real_layout(cp, tokens, heads)``: ``cp`` real gloo ranks (``zl.launch``) label every (token, head)
  of a ``[1, tokens, heads, 1]`` fp32 grid with ``token * heads + head``, keep their chunk of the
  sequence (``split_sequence``) and run Ulysses' first all-to-all
  (``zerolab.parallel.context_ulysses.seq_to_heads``) over the mesh's "cp" group. Per rank:
  ``{"tokens": [...], "heads": [...], "bytes": n}`` — the sorted tokens and heads it holds afterwards
  and the bytes the ledger booked under "cp" for that one all-to-all.
* ``tiling_problems(sent, held, cp, tokens, heads)``: what is wrong with the learner's ``sent`` blocks
  (empty: fine) — every block a rank receives is part of what it holds, every (token, head) moves once,
  and each rank sends exactly its own tokens.
"""
from __future__ import annotations

import torch

from zerolab.parallel.context import split_sequence
from zerolab.parallel.context_ulysses import seq_to_heads
from zerolab.runtime.launch import launch
from zerolab.runtime.mesh import mesh

__all__ = ["real_layout", "tiling_problems"]


def _held(tokens, heads):
    m = mesh(cp=torch.distributed.get_world_size())
    comm = m.communicator("cp")
    label = (torch.arange(tokens)[:, None] * heads + torch.arange(heads)[None, :]).float()
    after = seq_to_heads(split_sequence(label[None, :, :, None], comm), comm).flatten().long().tolist()
    return {"tokens": sorted({x // heads for x in after}), "heads": sorted({x % heads for x in after}),
            "bytes": m.ledger.total_bytes(group="cp"), "cells": len(after)}


def real_layout(cp: int, tokens: int, heads: int) -> list:
    """Per rank of a real ``cp``-rank run: the tokens and heads it holds after Ulysses' all-to-all."""
    return launch(_held, cp, args=(tokens, heads), timeout=180, threads=1)


def tiling_problems(sent, held, cp: int, tokens: int, heads: int) -> list:
    where = f"cp={cp}, {tokens} tokens, {heads} heads"
    problems, seen = [], {}
    for src in range(cp):
        mine = set()
        for dst in range(cp):
            t, h = sent(cp, tokens, heads, src, dst)
            block = {(a, b) for a in t for b in h}
            ht, hh = held(cp, tokens, heads, dst)
            if not block <= {(a, b) for a in ht for b in hh}:
                problems.append(f"{where}: rank {src} sends rank {dst} cells it will not hold afterwards")
            for cell in block:
                if cell in seen:
                    problems.append(f"{where}: cell (token, head) = {cell} is sent twice (by ranks {seen[cell]} "
                                    f"and {src})")
                    return problems
                seen[cell] = src
            mine |= block
        own = set(range(src * tokens // cp, (src + 1) * tokens // cp))
        if mine != {(a, b) for a in own for b in range(heads)}:
            problems.append(f"{where}: rank {src} must send every head of its own tokens {sorted(own)}, once")
    return problems
