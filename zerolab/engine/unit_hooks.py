"""Which module gathers which units at stage 3, and what a unit's release in backward waits for (chapter 6).

``unit_hooks`` lists the modules that gather: the root (its own "rest" unit),
each unit's module (its unit and its frozen twin) and any other module that
directly owns a parameter of another unit (a tied head). ``release_waits``
says, per unit, how many events its release in backward waits for: a
trainable unit, the gradients of its parameters (once they are all in, every
backward node that read them has run); a frozen twin (``flat.py``), which gets
no gradient, its trainable unit and the small trainable parameters kept whole
inside it (a LayerNorm's weight) — plus one per forward whose inputs needed
gradients, counted by ``Stage3Engine`` when the forward runs.
"""
from __future__ import annotations

import torch
from torch import nn

from zerolab.engine.flat import find_units, unit_paths_of


def release_waits(model: nn.Module, policy, units: list, n_trainable: int, persistent: set):
    """``(twin_of, twin_waits, n_waits)``: trainable unit -> its frozen twin; id(small trainable
    parameter kept whole) -> the twin of the unit it sits in; per unit, the events its release
    in backward waits for before any forward is counted."""
    by_name = {u.name: i for i, u in enumerate(units[:n_trainable])}
    twin_at = {u.name: j for j, u in enumerate(units) if j >= n_trainable}
    twin_of = {by_name[name]: j for name, j in twin_at.items() if name in by_name}
    home = unit_paths_of(model, policy)
    twin_waits = {id(p): twin_at[home[id(p)]] for i in persistent for _, p in units[i].params
                  if home[id(p)] in twin_at}
    n_waits = [len(u.params) if i < n_trainable else
               int(i in twin_of.values()) + sum(w == i for w in twin_waits.values())
               for i, u in enumerate(units)]
    return twin_of, twin_waits, n_waits


def unit_hooks(model: nn.Module, units: list, policy, unit_of: dict, persistent: set):
    """``(module, units, is_root, unit index)`` for every module that gathers something: the
    root (its own "rest" unit), each unit's module (its unit and its frozen twin), and any
    other module that directly owns a parameter of a unit other than the one it sits in (a tied head)."""
    index: dict = {}   # unit path -> its indices (trainable unit, frozen twin)
    for i, u in enumerate(units):
        if i not in persistent:
            index.setdefault(u.name, []).append(i)
    out = [(model, index.get("rest", []), True, -1)]
    where = {}   # module path -> the unit path it sits in
    for path, _ in find_units(model, policy):
        where[path] = path
    for path, m in model.named_modules():
        if not path:
            continue
        home = path
        while home and home not in where:
            home = home.rpartition(".")[0]
        home = home or "rest"
        if path == home and home in index:
            out.append((m, index[home], False, index[home][0]))
        own = {unit_of[id(p)] for p in m.parameters(recurse=False) if id(p) in unit_of}
        extra = sorted(own - set(index.get(home, ())) - persistent)
        if extra:
            out.append((m, extra, False, -1))
    return out


def tensors_of(x):
    """The tensors in ``x`` (a tensor, or lists, tuples and dicts of them)."""
    if isinstance(x, torch.Tensor):
        return [x]
    if isinstance(x, (list, tuple)):
        return [t for v in x for t in tensors_of(v)]
    if isinstance(x, dict):
        return [t for v in x.values() for t in tensors_of(v)]
    return []
