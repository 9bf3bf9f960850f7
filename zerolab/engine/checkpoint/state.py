"""The engine's state, read and written unit by unit: state dicts and what a checkpoint holds (chapters 4-8).

``gather_state_dict(engine, ...)`` all-gathers one unit at a time (the fp32
update targets, or the 16-bit parameters) and cuts it into the model's named
tensors; with ``rank0_only`` the other ranks hold one unit at a time and get
None. ``layout(engine)`` describes the flat padded units (names, shapes,
offsets) as plain JSON, the map a checkpoint is resharded with.
``read_owned`` / ``write_owned`` give a unit's optimizer state on this rank as
``{"fp32": ..., "exp_avg": ..., "exp_avg_sq": ...}`` (``momentum_buffer`` for
SGD) whatever holds it: the device optimizer (views), or the offloaded one
(host chunks, NVMe pieces: copies, one unit at a time).
"""
from __future__ import annotations

import torch

from zerolab.engine.optim import ShardedOptimizer

MOMENTS = {"adam": ("exp_avg", "exp_avg_sq"), "adamw": ("exp_avg", "exp_avg_sq"), "sgd": ("momentum_buffer",)}


@torch.no_grad()
def gather_state_dict(engine, rank0_only: bool = False, sixteen_bit: bool = False,
                      exclude_frozen: bool = False) -> dict | None:
    """The model's state dict with whole parameters (collective): fp32 from the update targets, or
    (``sixteen_bit``) the compute-dtype parameters. ``rank0_only``: other ranks return None."""
    flat, keep = engine.flat, engine.rank == 0 or not rank0_only
    shards = [engine.own(flat.flat, u) for u in flat.units] if sixteen_bit else engine.targets
    dtype = flat.dtype if sixteen_bit else torch.float32
    pieces = {}
    for u, t in zip(flat.units, shards):
        if engine.shards_optimizer:
            full = torch.empty(u.padded, dtype=dtype, device=flat.device)   # one unit, transient
            engine.communicator.all_gather(full, t.contiguous().to(dtype), tag="state-dict")
        else:
            full = t
        if keep:
            for (_, p), off in zip(u.params, u.offsets):
                shape = engine.param_shape(p)
                pieces[id(p)] = full[off: off + shape.numel()].view(shape).to(dtype).clone()
    if not exclude_frozen:
        pieces.update({k: v.to(dtype) for k, v in frozen_pieces(engine, keep).items()})
    if not keep:
        return None
    frozen = frozen_ids(engine)
    out = {}
    for name, t in engine.module.state_dict(keep_vars=True).items():
        if id(t) in pieces:
            out[name] = pieces[id(t)]
        elif exclude_frozen and id(t) in frozen:
            continue
        else:
            value = t.detach().clone()
            out[name] = value.float() if value.is_floating_point() and not sixteen_bit else value
    return out


def frozen_ids(engine) -> set:
    """ids of the frozen parameters: kept whole, or partitioned (stage 3's frozen twins)."""
    fz = getattr(engine, "frozen_flat", None)
    return {id(p) for _, p in engine.flat.frozen} | {id(p) for u in (fz.units if fz else []) for _, p in u.params}


@torch.no_grad()
def frozen_pieces(engine, keep: bool = True) -> dict:
    """Collective: id(param) -> the whole value of each partitioned frozen parameter (stage 3),
    all-gathered one unit at a time (compute dtype); empty where nothing frozen is partitioned
    or (``keep=False``) on a rank that only helps."""
    fz, out = getattr(engine, "frozen_flat", None), {}
    for j, u in enumerate(fz.units if fz is not None else []):
        full = torch.empty(u.padded, dtype=fz.dtype, device=fz.device)   # one unit, transient
        engine.communicator.all_gather(full, fz.shard_view(fz.flat, u), tag="state-dict-frozen")
        if keep:
            for (_, p), off in zip(u.params, u.offsets):
                shape = fz.shapes[id(p)]
                out[id(p)] = full[off: off + shape.numel()].view(shape).clone()
    return out


def consolidated_state_dict(engine, rank0_only: bool = False) -> dict | None:
    """The model's state dict with consolidated fp32 parameters (collective)."""
    return gather_state_dict(engine, rank0_only)


# ---------------------------------------------------------------- layout
def layout(engine) -> dict:
    """The flat padded units as JSON: what a checkpoint's shards are slices of."""
    flat = engine.flat
    names = {id(p): n for u in flat.units for n, p in u.params}
    sd = engine.module.state_dict(keep_vars=True)
    aliases = {k: names[id(t)] for k, t in sd.items() if id(t) in names and names[id(t)] != k}
    frozen = frozen_ids(engine)
    return {
        "world_size": engine.world_size, "numel": flat.numel, "padded": flat.padded,
        "units": [{"name": u.name, "numel": u.numel, "padded": u.padded, "shard": u.shard,
                   "shard_offset": u.shard_offset,
                   "params": [[n, list(engine.param_shape(p)), off] for (n, p), off in zip(u.params, u.offsets)]}
                  for u in flat.units],
        "keys": list(sd), "aliases": aliases,
        "frozen": [k for k, t in sd.items() if id(t) in frozen],
        "buffers": [k for k, _ in engine.module.named_buffers()],
    }


def state_keys(engine) -> list[str]:
    """Names of the per-element state a checkpoint stores: fp32 values, then the optimizer's moments."""
    opt = engine.optimizer
    keys = list(MOMENTS[opt.kind])
    if opt.kind == "sgd" and not (opt.momentum if isinstance(opt, ShardedOptimizer) else opt.math.momentum):
        keys = []
    return ["fp32"] + keys


def owned_start(engine, u) -> int:
    """Where this rank's owned part of unit ``u`` starts, in unit coordinates."""
    return engine.rank * u.shard if engine.shards_optimizer else 0


# ---------------------------------------------------------------- per-unit optimizer state
def read_owned(engine, i: int) -> dict:
    """Unit ``i``'s state on this rank: views (device optimizer) or fresh tensors (offloaded)."""
    opt, keys = engine.optimizer, state_keys(engine)
    if isinstance(opt, ShardedOptimizer):
        return dict(zip(keys, _sharded_views(engine, i)))
    parts = {k: [] for k in keys}
    for (a, b), views in _offload_pieces(engine, i):
        for k, v in zip(keys, views):
            parts[k].append(v.clone())
    return {k: torch.cat(v) if len(v) != 1 else v[0] for k, v in parts.items()}


@torch.no_grad()
def write_owned(engine, i: int, values: dict) -> None:
    """Set unit ``i``'s state on this rank from ``values`` (same keys and lengths as ``read_owned``)."""
    opt, keys = engine.optimizer, state_keys(engine)
    if isinstance(opt, ShardedOptimizer):
        for k, view in zip(keys, _sharded_views(engine, i)):
            view.copy_(values[k])
        return
    for (a, b), views in _offload_pieces(engine, i, write=True):
        for k, v in zip(keys, views):
            v.copy_(values[k][a:b])


def _sharded_views(engine, i: int) -> list:
    opt = engine.optimizer
    start = sum(t.numel() for t in engine.targets[:i])
    n = engine.targets[i].numel()
    return [engine.targets[i]] + [s[start: start + n] for s in opt.state if s.numel()]


def _offload_pieces(engine, i: int, write: bool = False):
    """(range inside the unit's owned part, [fp32, moments...]) per piece of unit ``i``; an NVMe piece
    is read into RAM and, with ``write``, written back after the caller has changed it."""
    opt = engine.optimizer
    for k, (j, a, b) in enumerate(opt.pieces):
        if j != i:
            continue
        chunk = opt.store.read_now(k) if opt.store is not None else opt.chunks[k]
        rows = list(chunk.view(opt.slots, b - a))
        views = rows if opt.has_master else [engine.targets[i][a:b]] + rows
        yield (a, b), views
        if write and opt.store is not None:
            opt.store.write_now(k, chunk)
            opt.store.dirty.pop(k, None)


# ---------------------------------------------------------------- counters, scaler, schedule
class ShiftedSchedule:
    """A schedule read ``shift`` steps away from the optimizer's step count (a schedule restored
    without the optimizer, or an optimizer restored without its schedule)."""

    def __init__(self, schedule, shift: int):
        self.schedule = getattr(schedule, "schedule", schedule)
        self.shift = int(shift)

    def lr(self, t: int) -> float:
        return self.schedule.lr(t + self.shift)

    def __getattr__(self, name):   # the schedule's own settings (warmup_num_steps, ...) read through
        if name == "schedule":
            raise AttributeError(name)
        return getattr(self.schedule, name)


def schedule_position(engine) -> int:
    """The step the schedule is at (what ``get_lr`` reads)."""
    return engine.optimizer.step_count + getattr(engine.scheduler, "shift", 0)
