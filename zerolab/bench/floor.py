"""The floor of a data-parallel step, measured in the bench's own run (chapter 12, README's bench table).

No data-parallel engine can take less time per step than one rank's
micro-batch computed alone (forward, backward, and the optimizer step on the
parameters that rank must update, no communication) plus the collective its
bytes need. Both are timed in the same rank processes, interleaved with the
contenders' rounds:

    compute   ``FloorCompute``: plain torch on this rank's micro-batch, torch.optim.Adam
              over the whole model (its optimizer step is timed on its own too)
    comm      ``BareAllReduce``: one all-reduce of Ψ fp32 elements on the same backend

A contender's floor is ``compute - optimizer x (1 - its share) + comm x its bytes /
the bare all-reduce's bytes``: a stage-0 contender updates every parameter (share 1),
a sharded one (stage >= 1) only its 1/N. The scalings by share and by bytes (the
ring bytes of both) are modelled, the three times are measured. Its *efficiency* is
floor / its median step time: 1.0 would be an engine with no overhead at all and no
overlap; above 1.0, overlap hides communication behind compute.
"""
from __future__ import annotations

import statistics
import time

import torch

from zerolab.bench import peers as bp
from zerolab.book.models import loss_fn
from zerolab.theory.network import ring_bytes


class FloorCompute:
    """One rank's micro-batch alone: forward, backward, Adam step; nothing sent."""

    def __init__(self, preset: str):
        self.model = bp.build_model(preset)
        self.opt = torch.optim.Adam(self.model.parameters(), lr=1e-3, fused=True)   # as the peers and ours
        self.steps, self.optimizer_s = 0, []   # per step: seconds in the optimizer step alone

    def step(self, x, y):
        self.opt.zero_grad(set_to_none=True)
        loss_fn(self.model(x), y).backward()
        t0 = time.perf_counter()
        self.opt.step()
        self.optimizer_s.append(time.perf_counter() - t0)
        self.steps += 1


class BareAllReduce:
    """An all-reduce of Ψ fp32 elements and nothing else (sum; the values do not matter)."""

    def __init__(self, psi: int, world_size: int):
        import torch.distributed as dist
        self.dist, self.buf = dist, torch.ones(psi, dtype=torch.float32)
        self.bytes = ring_bytes("all_reduce", psi * 4, world_size)
        self.steps = 0

    def step(self, x=None, y=None):
        self.dist.all_reduce(self.buf)
        self.steps += 1


def floor_ms(per_rank_floor: list[dict]) -> dict:
    """Medians of the slowest rank's times: compute, its optimizer step and the bare all-reduce (ms),
    and the all-reduce's bytes."""
    def slowest(key):
        return 1e3 * statistics.median(max(ts) for ts in zip(*(f[key] for f in per_rank_floor)))
    return dict(compute_ms=slowest("compute"), optimizer_ms=slowest("optimizer"), comm_ms=slowest("comm"),
                comm_bytes=per_rank_floor[0]["comm_bytes"])


def with_floor(row: dict, floor: dict, world_size: int = 1) -> dict:
    """Add ``floor_ms`` and ``efficiency`` (floor / median step) to a contender's row: a sharded
    contender (``row["stage"]`` >= 1) needs only 1/N of the optimizer step."""
    comm = floor["comm_ms"] * row["bytes_per_step"] / floor["comm_bytes"] if floor["comm_bytes"] else 0.0
    share = 1.0 if row.get("stage", 0) == 0 else 1.0 / world_size
    row["floor_ms"] = floor["compute_ms"] - floor["optimizer_ms"] * (1.0 - share) + comm
    row["efficiency"] = row["floor_ms"] / row["median_ms"]
    return row
