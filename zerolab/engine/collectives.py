"""Which collectives a ZeRO step issues on which backend: a tuning, not the algorithm (chapters 4-5).

The algorithm of ZeRO-1/2 is the ring pair: reduce-scatter the gradients so
rank r receives the sum of its shard, all-gather the updated parameters so
every rank has all of them. That is what the stage files say and what NCCL
runs fastest. gloo (the CPU backend the book runs on) is different, measured
in docs/MEASUREMENTS.md:

    reduce-scatter  gloo has none: it all-reduces and keeps a slice (the wire carries an all-reduce anyway)
    all-gather      slower than N broadcasts of the same shards
    a small call    costs about as much as a large one (a synchronous call waits for every rank)

So on gloo (``{"zerolab": {"collectives": "per_backend"}}``, the default) the
engines all-reduce each gradient unit or bucket in place and keep their own
slice, each rank broadcasts its updated shard of each unit in place, and at
stage 2 a unit smaller than an eighth of the largest shares the next unit's
all-reduce. The bytes on the ledger say what these calls send (3Ψ(N-1)/N for
the pair instead of 2Ψ(N-1)/N). Nothing here changes *what* is computed:
every choice trains to the same parameters (tests/test_engine_collectives.py).
"""
from __future__ import annotations

import torch


def pick_collectives(choice: str, backend: str) -> str:
    """The pair of collectives a ZeRO-1/2 step runs: "reduce_scatter" (reduce-scatter the gradients,
    all-gather the parameters) or "all_reduce" (all-reduce the gradients, each rank broadcasts its
    shard). "per_backend": "all_reduce" on gloo, where it is faster (docs/MEASUREMENTS.md), else
    "reduce_scatter"."""
    if choice == "per_backend":
        return "all_reduce" if backend == "gloo" else "reduce_scatter"
    return choice


def plan_collectives(cfg, backend: str, partitions_params: bool) -> tuple[str, str]:
    """``(gradient collective, parameter collective)`` of an engine: ("reduce_scatter" | "all_reduce",
    "all_gather" | "broadcast"). Stage 3 gathers before use, never after the step: it keeps the ring
    pair. DeepSpeed's ``"reduce_scatter": false`` all-reduces whatever the pair."""
    pair = "reduce_scatter" if partitions_params else pick_collectives(cfg.collectives, backend)
    grads = "reduce_scatter" if pair == "reduce_scatter" and cfg.zero.reduce_scatter else "all_reduce"
    return grads, "all_gather" if pair == "reduce_scatter" else "broadcast"


def gather_unit(comm, full: torch.Tensor, mine: torch.Tensor, shard: int, world_size: int, how: str,
                async_op: bool, tag: str):
    """Fill ``full`` (one unit: its N shards in rank order) with every rank's shard. "all_gather": one
    all-gather from a copy of this rank's shard ``mine`` (S elements); "broadcast" (gloo): rank r sends
    shard r in place, no copy, the N calls running concurrently. Returns (handles, the input to keep
    alive while the call is in flight, or None)."""
    if how == "broadcast":
        return [comm.broadcast(full[r * shard: (r + 1) * shard], src=r, async_op=True, tag=tag)
                for r in range(world_size)], None
    inp = mine.clone()   # (S,) this rank's updated shard, a copy
    return [comm.all_gather(full, inp, async_op=async_op, tag=tag)], inp


def all_reduce_own_slices(comm, staging: torch.Tensor, views: list, units: list, rank: int, async_op: bool,
                          tag: str):
    """gloo's stand-in for a reduce-scatter of one or more units' staging (``views``: each unit's part of
    ``staging``): all-reduce it in place and read this rank's slice of each unit. Returns (handle, the
    slices, the tensors to keep alive)."""
    outs = [v[rank * u.shard: (rank + 1) * u.shard] for v, u in zip(views, units)]
    return comm.all_reduce(staging, async_op=async_op, tag=tag), outs, (staging,)


def reduce_groups(units: list, order: list[int], bucket_of_unit: dict, grad_collective: str) -> list[list[int]]:
    """Which units share one gradient collective, in backward ``order``: each unit alone, except on the
    all-reduce path (gloo), where a unit smaller than 1/8 of the largest joins the next unit of its
    bucket (a synchronous gloo call costs about the same whatever its size)."""
    small = max(u.padded for u in units) / 8
    groups, cur = [], []
    for k, j in enumerate(order):
        cur.append(j)
        nxt = order[k + 1] if k + 1 < len(order) else None
        if grad_collective != "all_reduce" or units[j].padded >= small or nxt is None \
                or bucket_of_unit[nxt] != bucket_of_unit[j]:
            groups.append(cur)
            cur = []
    return groups
