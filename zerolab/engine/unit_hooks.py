"""Which module gathers which units at stage 3 (chapter 6).

``unit_hooks`` lists the modules that gather: the root (its own "rest" unit),
each unit's module (its unit and its frozen twin, ``frozen.py``) and any other
module that directly owns a parameter of another unit (a tied head).
"""
from __future__ import annotations

import torch
from torch import nn

from zerolab.engine.flat import find_units


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
