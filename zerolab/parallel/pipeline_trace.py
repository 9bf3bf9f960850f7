"""A traced pipeline step: what the replay on modelled GPUs reads (chapter 10; ``theory/replay_pipe.py`` replays it).

``train_batch(..., trace=events)`` (a list, one per rank) appends this rank's step to ``events``:
a ``"trace-meta"`` record first (``"pipeline": True``, the rank, world, ranks per node, pp, chunks
per rank v, this stage, whether it holds the head), then, in the order the rank ran them,

* ``"compute"``: each F, B and W (ZB's weight-gradient pass) of micro-batch i on virtual stage j,
  with its FLOPs counted while it ran (``runtime.trace``'s counter: ``torch.utils.flop_counter``'s
  formulas, op by op) and its start and end;
* ``"p2p"``: each send and receive ``P2P`` made (``op``, payload bytes, ``peer`` global rank,
  ``group`` "pp", ``tag``, the moment it was issued and the moment the rank waited for it: a
  receive at once, a send at the end of the step);
* ``"p2p-drain"``: the end of the step, where the rank waits for its sends in flight.

Records are ``runtime.trace.Record`` tuples (name, index, seconds) with ``.info``, as the DP engine's.
"""
from __future__ import annotations

import time
from contextlib import contextmanager

from zerolab.runtime.trace import Record, _CountFlops
from zerolab.theory.replay_pipe import PHASES   # "F" -> "forward", ...: the names the replay reads back


class PipeTracer:
    """Appends one rank's pipeline step to ``events`` (module docstring)."""

    def __init__(self, events: list, mesh, module, v: int):
        self.events, self.flops, self.seq = events, 0, 0
        p = mesh.pp if mesh is not None else 1
        s = mesh.pp_rank if mesh is not None else 0
        if not events or events[0][0] != "trace-meta":
            events.insert(0, Record("trace-meta", -1, time.perf_counter(), {
                "pipeline": True, "rank": mesh.rank if mesh is not None else 0,
                "world": mesh.world_size if mesh is not None else 1,
                "ranks_per_node": mesh.ranks_per_node if mesh is not None else 1, "pp": p, "v": v, "stage": s,
                "tp": getattr(mesh, "tp", 1), "dp": getattr(mesh, "dp", 1),
                "head": s == p - 1 and hasattr(module, "head")}))

    @contextmanager
    def op(self, op: str, i: int, c: int, j: int):
        """F, B or W of micro-batch ``i``, chunk ``c`` (virtual stage ``j``): FLOPs counted inside."""
        self.flops, start = 0, time.perf_counter()
        with _CountFlops(self):
            yield
        now = time.perf_counter()
        self.events.append(Record("compute", j, now, {"phase": PHASES[op], "micro": i, "chunk": c, "stage": j,
                                                      "flops": int(self.flops), "start": start}))

    def p2p(self, op: str, nbytes: int, peer: int, tag: int, issued: float, waited) -> dict:
        self.seq += 1
        info = {"op": op, "nbytes": int(nbytes), "peer": int(peer), "group": "pp", "tag": int(tag),
                "issued": issued, "waited": waited}
        self.events.append(Record("p2p", self.seq, issued, info))
        return info

    def drained(self) -> None:
        self.events.append(Record("p2p-drain", -1, time.perf_counter()))
