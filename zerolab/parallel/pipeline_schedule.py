"""The pipeline's schedules and its point-to-point link (chapter 10; ``pipeline.py`` is the overview).

``schedule(kind, m, p, s)``: the order stage ``s`` of ``p`` runs ``m`` micro-batches'
forwards and backwards — ``"gpipe"`` (every forward, then every backward: m
micro-batches' activations in flight) or ``"1f1b"`` (p - s - 1 warm-up forwards, then
one forward and one backward in turn: at most p - s in flight). ``split_blocks``: the
contiguous share of the blocks each stage keeps. ``P2P``: sends and receives between
neighbouring stages, each payload booked under ``group="pp"``.
"""
from __future__ import annotations

import torch
import torch.distributed as dist

from zerolab.runtime.comm import CommRecord

SCHEDULES = ("1f1b", "gpipe")


def schedule(kind: str, m: int, p: int, s: int) -> list:
    """The order stage ``s`` of ``p`` runs ``m`` micro-batches' forwards ("F", i) and backwards ("B", i)."""
    if kind == "gpipe":
        return [("F", i) for i in range(m)] + [("B", i) for i in range(m)]
    if kind != "1f1b":
        raise ValueError(f"pipeline schedule must be one of {SCHEDULES}, got {kind!r}")
    if m < p:
        raise ValueError(f"1F1B needs at least as many micro-batches as stages: {m} micro-batches, pp={p}")
    warm = p - s - 1
    out = [("F", i) for i in range(warm)]
    for i in range(m - warm):
        out += [("F", warm + i), ("B", i)]
    return out + [("B", i) for i in range(m - warm, m)]


def split_blocks(n_blocks: int, pp: int) -> list:
    """(first, last + 1) block index of each of ``pp`` stages: contiguous, sizes differing by at most one."""
    if pp > n_blocks:
        raise ValueError(f"pp={pp} is larger than the number of blocks ({n_blocks}): every stage needs a block")
    q, r = divmod(n_blocks, pp)
    bounds, lo = [], 0
    for s in range(pp):
        bounds.append((lo, lo + q + (s < r)))
        lo = bounds[-1][1]
    return bounds


class P2P:
    """Sends (non-blocking, waited at the end) and blocking receives to the neighbouring stages;
    each payload booked in the mesh's ledger under "pp" (a 4-int64 header with the shape is not)."""

    def __init__(self, mesh):
        self.mesh, self.ranks, self.pending = mesh, mesh.ranks("pp"), []

    def _book(self, op, t, peer):
        k = self.mesh.ranks_per_node
        nbytes = t.numel() * t.element_size()
        self.mesh.ledger.records.append(CommRecord(op, nbytes if op == "send" else 0, 0.0, t.numel(),
                                                   str(t.dtype).replace("torch.", ""), 2, "pipeline",
                                                   inter_bytes=nbytes * (op == "send" and peer // k != self.mesh.rank // k),
                                                   group="pp"))

    def send(self, t, stage):
        peer, t = self.ranks[stage], t.detach().contiguous()
        head = torch.tensor(list(t.shape) + [0] * (4 - t.dim()) + [t.dim()], dtype=torch.int64)
        self.pending += [(dist.isend(head, peer), head), (dist.isend(t, peer), t)]
        self._book("send", t, peer)

    def recv(self, stage, dtype):
        peer = self.ranks[stage]
        head = torch.empty(5, dtype=torch.int64)
        dist.recv(head, peer)
        t = torch.empty(head[:int(head[4])].tolist(), dtype=dtype)
        dist.recv(t, peer)
        self._book("recv", t, peer)
        return t

    def wait(self):
        for work, _ in self.pending:
            work.wait()
        self.pending.clear()
