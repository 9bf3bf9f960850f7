"""The pipeline's schedules and its point-to-point link (chapter 10; ``pipeline.py`` is the overview).

``schedule(kind, m, p, s)``: the order stage ``s`` of ``p`` runs ``m`` micro-batches'
forwards and backwards — ``"gpipe"`` (every forward, then every backward: m
micro-batches' activations in flight) or ``"1f1b"`` (p - s - 1 warm-up forwards, then
one forward and one backward in turn: at most p - s in flight); ``"interleaved"``
(``schedule(kind, m, p, s, v)``: ("F" | "B", micro-batch, chunk) over v chunks per rank,
``pipeline_interleaved.py``) and ``"zb-h1"`` (the backward split into "B" and "W",
``pipeline_zb.py``). ``split_blocks``: the
contiguous share of the blocks each stage keeps. ``P2P``: sends and receives between
neighbouring stages (a tensor or a tuple of tensors, any dtype and number of dimensions: a header
says which), each payload booked under ``group="pp"``; a ``tag`` keeps apart the streams that share a
pair of ranks (interleaved: activations and gradients of several chunks; gloo matches by tag — NCCL
ignores tags, so the interleaved schedule is run and tested on gloo's CPU ranks only).
"""
from __future__ import annotations

import time

import torch
import torch.distributed as dist

from zerolab.parallel.pipeline_interleaved import interleaved_order
from zerolab.parallel.pipeline_zb import zb_h1_order
from zerolab.runtime.comm import CommRecord

SCHEDULES = ("1f1b", "gpipe", "interleaved", "zb-h1")


def schedule(kind: str, m: int, p: int, s: int, v: int = 1) -> list:
    """The order stage ``s`` of ``p`` runs ``m`` micro-batches' forwards ("F", i) and backwards ("B", i)
    (module docstring; ``v`` chunks per rank: the interleaved schedule only)."""
    if kind == "interleaved":
        return interleaved_order(m, p, s, v)
    if v != 1:
        raise ValueError(f"virtual={v} chunks per rank need the 'interleaved' schedule, not {kind!r}")
    if kind == "zb-h1":
        return zb_h1_order(m, p, s)
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


# the dtypes a header can name (its code: the index here)
DTYPES = (torch.float32, torch.bfloat16, torch.float16, torch.float64, torch.int64, torch.int32, torch.int16,
          torch.int8, torch.uint8, torch.bool)


class P2P:
    """Sends (non-blocking, waited at the end) and blocking receives to the neighbouring stages.

    What passes is a tensor or a tuple of tensors. Each send is preceded by a header (int64: its
    length, then whether a tuple, the number of tensors, and per tensor its dtype code and number of
    dimensions and shape), so the receiver allocates what was sent, whatever its dtype and number of
    dimensions. Each payload is booked in the mesh's ledger under "pp" (the headers are not). With a
    ``tracer`` (``pipeline_trace.PipeTracer``) each send and receive is also recorded for the replay."""

    def __init__(self, mesh, tracer=None):
        self.mesh, self.ranks, self.pending, self.tracer = mesh, mesh.ranks("pp"), [], tracer
        self.sent = []   # the traced sends' records: their wait is the end of the step

    def _book(self, op, t, peer):
        k = self.mesh.ranks_per_node
        nbytes = t.numel() * t.element_size()
        self.mesh.ledger.records.append(CommRecord(op, nbytes if op == "send" else 0, 0.0, t.numel(),
                                                   str(t.dtype).replace("torch.", ""), 2, "pipeline",
                                                   inter_bytes=nbytes * (op == "send" and peer // k != self.mesh.rank // k),
                                                   group="pp"))

    def send(self, t, stage, tag: int = 0):
        peer, is_tuple = self.ranks[stage], isinstance(t, (tuple, list))
        parts = [q.detach().contiguous() for q in tensors(t, f"what is sent to pipeline stage {stage}")]
        head = [int(is_tuple), len(parts)]
        for q in parts:
            head += [DTYPES.index(q.dtype), q.dim(), *q.shape]
        for h in (torch.tensor([len(head)], dtype=torch.int64), torch.tensor(head, dtype=torch.int64)):
            self.pending.append((dist.isend(h, peer, tag=tag), h))
        for q in parts:
            if q.numel():
                self.pending.append((dist.isend(q, peer, tag=tag), q))
            self._book("send", q, peer)
        if self.tracer is not None:
            self.sent.append(self.tracer.p2p("send", sum(q.numel() * q.element_size() for q in parts), peer, tag,
                                             time.perf_counter(), None))

    def recv(self, stage, tag: int = 0):
        """The tensor (or tuple) the neighbouring ``stage`` sent (with ``tag``), in its dtype and shape."""
        peer, issued = self.ranks[stage], time.perf_counter()
        n = torch.empty(1, dtype=torch.int64)
        dist.recv(n, peer, tag=tag)
        head = torch.empty(int(n), dtype=torch.int64)
        dist.recv(head, peer, tag=tag)
        head, parts, k = head.tolist(), [], 2
        for _ in range(head[1]):
            dtype, ndim = DTYPES[head[k]], head[k + 1]
            q = torch.empty(head[k + 2:k + 2 + ndim], dtype=dtype)
            k += 2 + ndim
            if q.numel():
                dist.recv(q, peer, tag=tag)
            self._book("recv", q, peer)
            parts.append(q)
        if self.tracer is not None:
            self.tracer.p2p("recv", sum(q.numel() * q.element_size() for q in parts), peer, tag, issued,
                            time.perf_counter())
        return tuple(parts) if head[0] else parts[0]

    def wait(self):
        for work, _ in self.pending:
            work.wait()
        self.pending.clear()
        if self.tracer is not None:
            now = time.perf_counter()
            for info in self.sent:
                info["waited"] = now
            self.sent.clear()
            self.tracer.drained()


def tensors(t, what: str) -> list:
    """``t`` (a tensor, or a tuple or list of tensors) as a list; anything else refused by name."""
    parts = list(t) if isinstance(t, (tuple, list)) else [t]
    for q in parts:
        if not isinstance(q, torch.Tensor):
            raise TypeError(f"{what}: a tensor or a tuple of tensors can pass between pipeline stages; got "
                            f"{type(t).__name__}" + (f" holding a {type(q).__name__}" if q is not t else ""))
        if q.dtype not in DTYPES:
            raise TypeError(f"{what}: dtype {q.dtype} cannot pass between pipeline stages (one of "
                            f"{', '.join(str(d).replace('torch.', '') for d in DTYPES)})")
    return parts
