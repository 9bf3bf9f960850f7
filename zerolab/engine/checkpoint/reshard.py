"""Resharding: a checkpoint saved by N ranks read into any other layout, one unit at a time (chapter 8).

A saved rank r holds, for every unit U, the slice ``[r*S_U, (r+1)*S_U)`` of
the unit's padded flat buffer (S_U = padded_U / N), for each state key
("fp32", "exp_avg", ...). Reading parameter p's elements ``[lo, hi)`` is
arithmetic on those slices: p starts at ``q = offset of p in U``, so element
e = q + x of U lies in saved rank ``e // S_U`` at position ``e % S_U``. A new
rank at M ranks (another stage, another unit layout: stage 3's persistent
unit) asks, unit by unit, for the elements it owns; ``SavedCheckpoint``
opens each saved file once, memory-mapped, so only the pages of the slices
it copies are read, and no rank ever materialises the whole optimizer state.
"""
from __future__ import annotations

import math

import torch

from zerolab.engine.checkpoint.files import CheckpointError, MANIFEST, model_file, optim_file, read_checked


class SavedCheckpoint:
    """One tag of a zerolab checkpoint, read lazily: files are opened (checked, mmap'd) on first use."""

    def __init__(self, tag_dir: str, manifest: dict, verify: bool = True):
        self.dir, self.manifest, self.verify = tag_dir, manifest, verify
        self.layout, self.engine = manifest["layout"], manifest["engine"]
        self.world_size = self.engine["world_size"]
        self._files: dict = {}
        self.mapped_bytes = 0   # storages of the opened files (memory-mapped: pages are read when touched)
        self.bytes_read = 0     # bytes copied out of them
        self.shard_numel = sum(u["shard"] for u in self.layout["units"])   # each saved rank's slice
        self.index = {}   # param name -> (saved unit index, offset in the unit, numel, shape)
        for ui, u in enumerate(self.layout["units"]):
            for name, shape, off in u["params"]:
                self.index[name] = (ui, off, math.prod(shape), tuple(shape))

    def file(self, name: str) -> dict:
        if name not in self._files:
            self._files[name] = read_checked(self.dir, name, self.manifest, self.verify)
            self.mapped_bytes += _storage_bytes(self._files[name])
        return self._files[name]

    def rank_state(self, r: int, key: str) -> torch.Tensor:
        name = optim_file(r)
        data = self.file(name)
        try:
            t = data["state"][key]
        except (KeyError, TypeError):
            raise CheckpointError(f"{self.dir}/{name}: no state {key!r} (found "
                                  f"{sorted(data.get('state', {})) if isinstance(data, dict) else type(data)})") \
                from None
        want = self.shard_numel
        if not isinstance(t, torch.Tensor) or t.dim() != 1 or t.numel() != want:
            found = list(t.shape) if isinstance(t, torch.Tensor) else type(t).__name__
            raise CheckpointError(f"{self.dir}/{name}: state {key!r} is {found}, expected [{want}] (the rank's "
                                  f"shard of every unit, from the manifest's layout)")
        return t

    def model_states(self) -> dict:
        return self.file(model_file(0, self.engine["stage"]))

    def close_file(self, name: str) -> None:
        """Forget one file (its mapping goes when the last tensor viewing it does)."""
        self._files.pop(name, None)

    def close(self) -> None:
        self._files.clear()

    # ---------------------------------------------------------------- element arithmetic
    def copy_range(self, key: str, unit: int, start: int, end: int, out: torch.Tensor) -> None:
        """Elements ``[start, end)`` of saved unit ``unit``'s buffer ``key`` into ``out`` (end - start,)."""
        u = self.layout["units"][unit]
        s = u["shard"]
        e = start
        while e < end:
            r = e // s
            stop = min(end, (r + 1) * s)
            src = self.rank_state(r, key)
            a = u["shard_offset"] + e - r * s
            out[e - start: stop - start].copy_(src[a: a + stop - e])
            self.bytes_read += (stop - e) * src.element_size()
            e = stop

    def param(self, name: str, key: str = "fp32", lo: int = 0, hi: int | None = None) -> torch.Tensor:
        """Parameter ``name``'s saved elements ``[lo, hi)`` of ``key``, flat fp32 (a fresh tensor)."""
        unit, off, numel, _ = self.index[name]
        hi = numel if hi is None else hi
        out = torch.empty(hi - lo, dtype=torch.float32)
        self.copy_range(key, unit, off + lo, off + hi, out)
        return out


def _storage_bytes(obj, seen=None) -> int:
    seen = set() if seen is None else seen
    if isinstance(obj, torch.Tensor):
        s = obj.untyped_storage()
        if s.data_ptr() in seen:
            return 0
        seen.add(s.data_ptr())
        return s.nbytes()
    if isinstance(obj, dict):
        return sum(_storage_bytes(v, seen) for v in obj.values())
    if isinstance(obj, (list, tuple)):
        return sum(_storage_bytes(v, seen) for v in obj)
    return 0


def check_compatible(saved: SavedCheckpoint, model_layout: dict) -> None:
    """The model must have the checkpoint's trainable parameters with the same shapes."""
    path = f"{saved.dir}/{MANIFEST}"
    mine = {name: tuple(shape) for u in model_layout["units"] for name, shape, _ in u["params"]}
    missing = sorted(set(mine) - set(saved.index))
    if missing:
        raise CheckpointError(f"{path}: parameter {missing[0]!r} of the model is not in the checkpoint "
                              f"({len(missing)} missing; the checkpoint has {len(saved.index)} parameters): "
                              f"saved from another model?")
    extra = sorted(set(saved.index) - set(mine))
    if extra:
        raise CheckpointError(f"{path}: parameter {extra[0]!r} in the checkpoint is not a trainable parameter "
                              f"of the model ({len(extra)} such): saved from another model?")
    for name, shape in mine.items():
        if saved.index[name][3] != shape:
            raise CheckpointError(f"{path}: parameter {name!r} has shape {list(saved.index[name][3])} in the "
                                  f"checkpoint, expected {list(shape)} (the model's)")


def fill_owned(saved: SavedCheckpoint, unit: dict, start: int, length: int, keys, scratch=None) -> dict:
    """This rank's owned part ``[start, start + length)`` of a *new* unit (layout dict), for each
    state key, from the saved shards; padding stays zero. ``scratch``: a (len(keys), >= length) fp32
    buffer to fill (the loader reuses one, sized for its largest unit, for every unit)."""
    if scratch is None:
        scratch = torch.empty(len(keys), length, dtype=torch.float32)
    out = {k: row[:length].zero_() for k, row in zip(keys, scratch)}
    end = start + length
    for name, shape, off in unit["params"]:
        a, b = max(start, off), min(end, off + math.prod(shape))
        if a >= b:
            continue
        su, soff, _, _ = saved.index[name]
        for k in keys:
            saved.copy_range(k, su, soff + a - off, soff + b - off, out[k][a - start: b - start])
    return out


def consolidate(saved: SavedCheckpoint) -> dict:
    """The model's fp32 state dict from the saved shards, one saved rank at a time (each file is
    mapped, copied from, and closed before the next: resident memory stays near the output plus
    one shard). Keys in the saved order; tied names share one tensor; frozen parameters and
    buffers come from rank 0's files."""
    lay = saved.layout
    params = {name: torch.empty(saved.index[name][2], dtype=torch.float32) for name in saved.index}
    for r in range(saved.world_size):
        src = saved.rank_state(r, "fp32")
        for name, (ui, off, numel, _) in saved.index.items():
            u = lay["units"][ui]
            lo, hi = max(off, r * u["shard"]), min(off + numel, (r + 1) * u["shard"])
            if lo < hi:
                a = u["shard_offset"] + lo - r * u["shard"]
                params[name][lo - off: hi - off].copy_(src[a: a + hi - lo])
                saved.bytes_read += (hi - lo) * 4
        del src
        saved.close_file(optim_file(r))
    rest = {}
    names = set(lay["frozen"]) | set(lay["buffers"])
    if names:
        module = saved.model_states().get("module", {})
        buffers = saved.file(optim_file(0)).get("buffers", {})
        for k in names:
            t = module.get(k, buffers.get(k))
            if t is not None:
                rest[k] = t.float().clone() if t.is_floating_point() else t.clone()
    params = {name: t.view(saved.index[name][3]) for name, t in params.items()}
    out = {}
    for k in lay["keys"]:
        canon = lay["aliases"].get(k, k)
        if canon in params:
            out[k] = params[canon]
        elif k in rest:
            out[k] = rest[k]
    return out
