"""Flat, padded per-unit buffers: the one mechanism under every ZeRO stage (chapters 3-6).

A *unit* is a module whose parameters travel together: each block of the
model's largest ``nn.ModuleList`` (a transformer's blocks) is a unit, and
everything else (embeddings, final norm, head) is one more unit, ``"rest"``.
A model without a ``ModuleList`` is a single unit.

All trainable parameters live in one flat buffer, unit after unit. Each
unit's slice is padded with zeros to a multiple of N, so it splits into N
equal *shards* of S = padded / N elements, and rank r owns the contiguous
slice ``[r*S, (r+1)*S)`` of every unit:

    flat   | rest: r0 r1 r2 | block0: r0 r1 r2 | block1: r0 r1 r2 |   (N = 3)

Concatenating the rank's shards of all units gives its *shard space*
(``shard_numel`` = padded Ψ / N elements): the optimizer state, fp32 master
weights and (stage 2) gradient shard are contiguous buffers in that space.

Parameters become views into the flat buffer (``p.data = flat[a:b].view(shape)``),
so the model computes with them unchanged. A parameter shared by two modules
(tied weights) belongs to exactly one unit. Frozen parameters
(``requires_grad=False``) stay outside: they are not trained, so they need no
gradient, shard or optimizer state, only the same value on every rank.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import nn


@dataclass
class Unit:
    """One module's trainable parameters inside the flat buffer."""
    name: str                 # module path ("rest" for the leftovers)
    params: list              # [(qualified name, nn.Parameter)], in layout order
    offset: int = 0           # first element in the flat buffer
    numel: int = 0            # parameter elements
    padded: int = 0           # numel rounded up to a multiple of N
    shard: int = 0            # S = padded // N, elements each rank owns
    shard_offset: int = 0     # first element of this unit's shard in the shard space
    offsets: list = field(default_factory=list)  # per-param offset inside the unit


def find_units(model: nn.Module) -> list[tuple[str, nn.Module | None]]:
    """The units of ``model``: ``[("rest", None), (path, block), ...]``.

    The blocks are the elements of the ``nn.ModuleList`` holding the most
    parameters (``model.blocks`` in a GPT); ``None`` stands for "everything
    not in a block".
    """
    best, best_count = None, 0
    for path, m in model.named_modules():
        if isinstance(m, nn.ModuleList) and len(m) > 1:
            count = sum(p.numel() for p in m.parameters())
            if count > best_count:
                best, best_count = (path, m), count
    if best is None:
        return [("rest", None)]
    path, blocks = best
    return [("rest", None)] + [(f"{path}.{i}" if path else str(i), b) for i, b in enumerate(blocks)]


def pad_to(n: int, world_size: int) -> int:
    return -(-n // world_size) * world_size


class FlatParams:
    """The model's trainable parameters as views into one flat padded buffer."""

    def __init__(self, model: nn.Module, world_size: int, rank: int, dtype: torch.dtype, device,
                 persist_threshold: int = 0):
        self.world_size, self.rank, self.dtype, self.device = world_size, rank, dtype, device
        names = {id(p): n for n, p in model.named_parameters()}  # first name of each (tied) param
        seen: set = set()
        units = []
        for uname, mod in find_units(model):
            if mod is None:
                continue
            ps = [(names[id(p)], p) for p in mod.parameters() if p.requires_grad and id(p) not in seen]
            seen.update(id(p) for _, p in ps)
            units.append(Unit(uname, ps))
        rest = [(n, p) for n, p in model.named_parameters() if p.requires_grad and id(p) not in seen]
        units.insert(0, Unit("rest", rest))  # used first in forward (embeddings) and last in backward
        if persist_threshold > 0:  # stage 3: params of <= threshold elements stay whole, in a unit of their own
            small = {id(p) for u in units for _, p in u.params if p.numel() <= persist_threshold}
            kept = [(n, p) for u in units for n, p in u.params if id(p) in small]
            for u in units:
                u.params = [(n, p) for n, p in u.params if id(p) not in small]
            units.insert(0, Unit("persistent", kept))
        self.units = [u for u in units if u.params]
        self.frozen = [(n, p) for n, p in model.named_parameters() if not p.requires_grad]

        offset = shard_offset = 0
        for u in self.units:
            u.offset, u.shard_offset = offset, shard_offset
            for _, p in u.params:
                u.offsets.append(u.numel)
                u.numel += p.numel()
            u.padded = pad_to(u.numel, world_size)
            u.shard = u.padded // world_size
            offset += u.padded
            shard_offset += u.shard
        self.numel = sum(u.numel for u in self.units)   # Ψ (trainable)
        self.padded = offset                            # Ψ rounded up unit by unit
        self.shard_numel = shard_offset                 # padded Ψ / N

        # flat params, compute dtype: padded elements (padding stays zero)
        self.flat = torch.zeros(self.padded, dtype=dtype, device=device)
        with torch.no_grad():
            for u in self.units:
                for (_, p), off in zip(u.params, u.offsets):
                    view = self.flat[u.offset + off: u.offset + off + p.numel()].view(p.shape)
                    view.copy_(p.data)
                    p.data = view
            for _, p in self.frozen:
                p.data = p.data.to(device=device, dtype=dtype)

    # --- views -------------------------------------------------------------
    def params(self):
        """Trainable parameters in layout order."""
        return [p for u in self.units for _, p in u.params]

    def unit_view(self, buf: torch.Tensor, u: Unit) -> torch.Tensor:
        """The unit's padded slice of a full-size buffer: (padded,)."""
        return buf[u.offset: u.offset + u.padded]

    def own_view(self, buf: torch.Tensor, u: Unit) -> torch.Tensor:
        """This rank's shard of the unit inside a full-size buffer: (S,)."""
        start = u.offset + self.rank * u.shard
        return buf[start: start + u.shard]

    def shard_view(self, shard_buf: torch.Tensor, u: Unit) -> torch.Tensor:
        """The unit's piece of a shard-space buffer: (S,)."""
        return shard_buf[u.shard_offset: u.shard_offset + u.shard]

    def param_views(self, buf: torch.Tensor) -> dict:
        """id(param) -> the param-shaped view of a full-size buffer (e.g. gradients)."""
        out = {}
        for u in self.units:
            for (_, p), off in zip(u.params, u.offsets):
                out[id(p)] = buf[u.offset + off: u.offset + off + p.numel()].view(p.shape)
        return out
