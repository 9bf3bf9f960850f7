"""Parameter groups: per-group ``lr`` and ``weight_decay`` over a flat shard (chapter 6).

``zl.initialize(model, config, model_parameters=groups)`` takes what a torch
optimizer takes: a list of parameters, or a list of dicts ``{"params": [...],
"weight_decay": 0.0, ...}`` whose other keys override the config's optimizer
params for that group (the usual use: no weight decay on biases and norms).

The flat buffer does not know about parameters once it is cut into shards,
so the engine keeps per-element group membership as *runs*: for each unit,
the slice this rank updates is cut into ``(start, end, group)`` pieces. Inside
a unit the parameters are laid out group by group, so a rank's shard of a
unit has at most one run per group, and the optimizer runs one kernel per run:

    unit     | w1 w2 w3 (decay) | b1 b2 ln (no decay) | pad |
    rank 1's shard:        [------ S ------]
    runs:                  (0, 5, 0) (5, S, 1)

Padding belongs to the run before it (it is zero and its gradient is zero).
"""
from __future__ import annotations

import torch

from zerolab.engine.optim import Hyper


def resolve_groups(model, model_parameters, kind: str, defaults: dict):
    """``(group_of, overrides)``: parameter id -> group index, and each group's overrides
    (``None, None`` without groups). Errors name the group and the parameter."""
    if model_parameters is None:
        return None, None
    groups = list(model_parameters)
    if not groups:
        raise ValueError("model_parameters is empty: pass a list of parameters or of parameter-group dicts")
    if all(isinstance(g, torch.Tensor) for g in groups):
        groups = [{"params": groups}]
    names = {}
    for n, p in model.named_parameters(remove_duplicate=False):
        names.setdefault(id(p), n)
    group_of, overrides = {}, []
    for k, g in enumerate(groups):
        if not isinstance(g, dict) or "params" not in g:
            raise ValueError(f"model_parameters[{k}]: expected a dict with a 'params' entry (as torch.optim "
                             f"takes) or a list of parameters, got a {type(g).__name__}")
        params = g["params"]
        params = [params] if isinstance(params, torch.Tensor) else list(params)
        over = {key: v for key, v in g.items() if key != "params"}
        try:
            Hyper(kind, {**defaults, **over})
        except ValueError as e:
            raise ValueError(f"model_parameters[{k}]: {e}") from None
        overrides.append(over)
        for p in params:
            if id(p) not in names:
                raise ValueError(f"model_parameters[{k}] holds a tensor of shape {tuple(p.shape)} that is not a "
                                 f"parameter of the model")
            if id(p) in group_of:
                raise ValueError(f"parameter {names[id(p)]!r} is in model_parameters[{group_of[id(p)]}] and "
                                 f"model_parameters[{k}]; a parameter belongs to one group")
            group_of[id(p)] = k
    missing = [n for n, p in model.named_parameters() if p.requires_grad and id(p) not in group_of]
    if missing:
        raise ValueError(f"trainable parameters in no group of model_parameters: {missing[:5]}"
                         f"{' ...' if len(missing) > 5 else ''}; add them to a group, or set "
                         f"requires_grad=False to freeze them")
    return group_of, overrides


def unit_runs(u, group_of: dict, lo: int, hi: int) -> list[tuple[int, int, int]]:
    """The runs ``(start, end, group)`` of unit ``u``'s elements [lo, hi), relative to lo."""
    runs = []
    for (_, p), off in zip(u.params, u.offsets):
        a, b = max(off, lo), min(off + p.numel(), hi)
        if a < b:
            k = group_of[id(p)]
            if runs and runs[-1][2] == k and runs[-1][1] == a - lo:
                runs[-1] = (runs[-1][0], b - lo, k)
            else:
                runs.append((a - lo, b - lo, k))
    if runs:
        runs[-1] = (runs[-1][0], hi - lo, runs[-1][2])   # padding joins the last run
        runs[0] = (0, runs[0][1], runs[0][2])            # (a shard starting in padding: nothing before)
    else:
        runs = [(0, hi - lo, 0)]                         # a shard of pure padding
    return runs
