"""Shared by the engine tests: run an engine over rank-sliced micro-batches of a global batch."""
from __future__ import annotations

import torch.distributed as dist

from zerolab.book.models import loss_fn, synthetic_batch


def train_rank_slices(engine, model, steps: int, gas: int, mbs: int, seed: int):
    """``steps`` optimizer steps of ``gas`` micro-batches each: micro-batch k of step s is this rank's
    ``mbs`` rows at ``(k * N + rank) * mbs`` of the global batch ``synthetic_batch(seed, step=s)``;
    returns the engine's full state dict (the single-process reference runs the whole global batch)."""
    rank, n = dist.get_rank(), dist.get_world_size()
    for step in range(steps):
        x, y = synthetic_batch(model, n * gas * mbs, seed=seed, step=step)
        for k in range(gas):
            lo = (k * n + rank) * mbs
            engine.backward(loss_fn(engine(x[lo: lo + mbs]), y[lo: lo + mbs]))
            engine.step()
    return engine.full_state_dict()
