"""Flat, padded per-unit buffers: the one mechanism under every ZeRO stage (chapters 3-6).

A *unit* is a group of parameters that travel together (one all-gather at
stage 3). By default the units are what users expect: each block of the
model's ``nn.ModuleList``s (a transformer's blocks) is a unit, and so is every
other module that directly owns parameters (an embedding, the final norm, the
head; each layer of an ``nn.Sequential``). The root module's own parameters,
if any, are the unit ``"rest"``. ``{"zerolab": {"units": ["Block", ...]}}``
replaces that rule with a wrap policy: modules of those class names are units
(nested ones too), and what no listed module holds is ``"rest"``.

All trainable parameters live in one flat buffer, unit after unit. Each
unit's slice is padded with zeros to a multiple of N, so it splits into N
equal *shards* of S = padded / N elements, and rank r owns the contiguous
slice ``[r*S, (r+1)*S)`` of every unit:

    flat   | wte: r0 r1 r2 | blocks.0: r0 r1 r2 | blocks.1: r0 r1 r2 |   (N = 3)

Concatenating the rank's shards of all units gives its *shard space*
(``shard_numel`` = padded Ψ / N elements): the optimizer state, fp32 master
weights and (stage 2) gradient shard are contiguous buffers in that space.
Stage 3 allocates only that (``sharded=True``): ``full[i]`` is unit i's
(padded,) buffer, holding no storage until the unit is gathered.

Parameters become views into the flat buffer (``p.data = flat[a:b].view(shape)``),
so the model computes with them unchanged. A parameter shared by two modules
(tied weights) belongs to exactly one unit: the one above all its users. Frozen parameters
(``requires_grad=False``) stay outside: they are not trained, so they need no
gradient, shard or optimizer state. At stages 0-2 they stay whole on every rank;
stage 3 partitions them too, in a second ``FlatParams(select="frozen")`` with the
same units (a unit's *frozen twin*: gathered and released with it, holding only
its 1/N shard between uses), except those of at most
``stage3_param_persistence_threshold`` elements, which stay whole.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import nn


@dataclass
class Unit:
    """One module's trainable parameters inside the flat buffer."""
    name: str                 # module path ("rest": the root's own parameters; "persistent")
    params: list              # [(qualified name, nn.Parameter)], in layout order
    offset: int = 0           # first element in the flat buffer
    numel: int = 0            # parameter elements
    padded: int = 0           # numel rounded up to a multiple of N
    shard: int = 0            # S = padded // N, elements each rank owns
    shard_offset: int = 0     # first element of this unit's shard in the shard space
    offsets: list = field(default_factory=list)  # per-param offset inside the unit


def model_device(model: nn.Module) -> torch.device:
    """Where the flat buffer goes: the parameters' device; for a meta-device model the
    current accelerator if there is one, else the CPU."""
    for p in model.parameters():
        if not p.is_meta:
            return p.device
    return torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")


def find_units(model: nn.Module, policy=None) -> list[tuple[str, nn.Module]]:
    """The unit modules of ``model`` in module order: ``[("rest", model), (path, module), ...]``.

    Default: every element of an ``nn.ModuleList`` (not inside another block), and
    every other module that directly owns parameters. ``policy``: class names; the
    modules of those classes instead (nested ones too). A module marked as a leaf
    (``zl.set_leaf_modules``, DeepSpeed's ``_z3_leaf``) is one unit with everything inside it.
    """
    units = [("rest", model)]
    if getattr(model, "_z3_leaf", False):   # the whole model is one leaf: one unit
        return units

    def visit(path, m, in_block):
        for name, child in m.named_children():
            cp = f"{path}.{name}" if path else name
            if getattr(child, "_z3_leaf", False):   # a leaf (unit_order.set_leaf_modules): one unit, nothing inside
                if any(True for _ in child.parameters()):
                    units.append((cp, child))
                continue
            if policy is not None:
                unit, block = type(child).__name__ in policy, False
            else:
                block = not in_block and isinstance(m, nn.ModuleList)
                unit = block or (not in_block and any(True for _ in child.parameters(recurse=False)))
            if unit:
                units.append((cp, child))
            visit(cp, child, in_block or block)
    visit("", model, False)
    return units


def unit_paths_of(model: nn.Module, policy=None) -> dict:
    """id(param) -> the path of the unit that holds it: the nearest unit module at or above
    its module — for a parameter several modules share (a tied embedding and head), above
    their lowest common ancestor, so the unit is gathered around every use (as FSDP does)."""
    paths = {p for p, _ in find_units(model, policy)} - {"rest"}
    owners: dict = {}
    for name, p in model.named_parameters(remove_duplicate=False):
        mod = name.rpartition(".")[0].split(".") if "." in name else []
        prev = owners.get(id(p))
        if prev is None:
            owners[id(p)] = mod
        else:   # the common prefix of the owners' paths
            k = 0
            while k < min(len(prev), len(mod)) and prev[k] == mod[k]:
                k += 1
            owners[id(p)] = prev[:k]
    out = {}
    for key, parts in owners.items():
        mod = ".".join(parts)
        while mod and mod not in paths:
            mod = mod.rpartition(".")[0]
        out[key] = mod or "rest"
    return out


def pad_to(n: int, world_size: int) -> int:
    return -(-n // world_size) * world_size


def released(t: torch.Tensor) -> torch.Tensor:
    """``t`` with its storage freed (0 bytes), shape kept: a unit's full buffer between gathers."""
    t.untyped_storage().resize_(0)
    return t


class FlatParams:
    """The model's trainable parameters as views into one flat padded buffer.

    ``fill=False`` (the engine): lay out and allocate only; ``bigmodel/materialize.py``
    then fills the buffer unit by unit (and builds meta-device parameters).
    ``group_of``: parameter id -> parameter group; a unit is laid out group by group.
    ``select="frozen"`` (stage 3): the frozen parameters instead, those above
    ``persist_threshold`` elements; the small ones stay whole (``frozen``)."""

    def __init__(self, model: nn.Module, world_size: int, rank: int, dtype: torch.dtype, device,
                 persist_threshold: int = 0, policy=None, group_of=None, sharded: bool = False, fill: bool = True,
                 select: str = "trainable"):
        self.world_size, self.rank, self.dtype, self.device = world_size, rank, dtype, device
        self.sharded = sharded
        self.policy = policy
        self.shapes = {id(p): p.shape for p in model.parameters()}   # kept: stage 3 empties released params
        where = unit_paths_of(model, policy)
        by_path = {path: Unit(path, []) for path, _ in find_units(model, policy)}
        trainable = select == "trainable"
        for n, p in model.named_parameters():   # first name of each (tied) param
            if p.requires_grad == trainable and (trainable or p.numel() > persist_threshold):
                by_path[where[id(p)]].params.append((n, p))
        units = list(by_path.values())
        if group_of:
            for u in units:
                u.params.sort(key=lambda np_: group_of[id(np_[1])])
        if persist_threshold > 0 and trainable:  # stage 3: params of <= threshold elements stay whole, in a unit of their own
            small = {id(p) for u in units for _, p in u.params if p.numel() <= persist_threshold}
            kept = [(n, p) for u in units for n, p in u.params if id(p) in small]
            for u in units:
                u.params = [(n, p) for n, p in u.params if id(p) not in small]
            units.insert(0, Unit("persistent", kept))
        self.units = [u for u in units if u.params]
        placed = {id(p) for u in units for _, p in u.params}
        # frozen parameters kept whole on every rank (all of them, unless stage 3 partitions them)
        self.frozen = [(n, p) for n, p in model.named_parameters() if not p.requires_grad and id(p) not in placed]

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

        if sharded:
            # the rank's shard of every unit, compute dtype: padded Ψ / N elements (padding stays zero)
            self.flat = torch.zeros(self.shard_numel, dtype=dtype, device=device)
            # per unit, compute dtype: (padded_u,) full buffer; 0 bytes of storage until gathered
            # (each is released before the next is made: all of them at once would be the whole model)
            self.full = [released(torch.empty(u.padded, dtype=dtype, device=device)) for u in self.units]
        else:
            # flat params, compute dtype: padded elements (padding stays zero)
            self.flat = torch.zeros(self.padded, dtype=dtype, device=device)
            self.full = [self.unit_view(self.flat, u) for u in self.units]
        self.unit_views = [None] * len(self.units)   # per unit: its params' views of full[i] (materialize.py)
        self.exact = {}   # unit index -> the fp32 values of its master range, where they came in fp32 (materialize.py)
        if fill:
            if sharded:
                raise ValueError("FlatParams(sharded=True) is filled by zerolab.engine.bigmodel.materialize")
            with torch.no_grad():
                for i, u in enumerate(self.units):
                    for (_, p), view in zip(u.params, self.views(i)):
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

    def views(self, i: int) -> list[torch.Tensor]:
        """Unit ``i``'s parameters as param-shaped views of its full buffer ``full[i]``."""
        u, buf = self.units[i], self.full[i]
        return [buf[off: off + p.numel()].view(p.shape) for (_, p), off in zip(u.params, u.offsets)]

    def own_range(self, u: Unit, sharded: bool) -> tuple[int, int]:
        """The elements of unit ``u`` this rank updates, in unit coordinates."""
        return (self.rank * u.shard, (self.rank + 1) * u.shard) if sharded else (0, u.padded)

    def param_views(self, buf: torch.Tensor) -> dict:
        """id(param) -> the param-shaped view of a full-size buffer (e.g. gradients)."""
        out = {}
        for u in self.units:
            for (_, p), off in zip(u.params, u.offsets):
                out[id(p)] = buf[u.offset + off: u.offset + off + p.numel()].view(p.shape)
        return out
