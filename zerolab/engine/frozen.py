"""Frozen parameters at stage 3: partitioned too, as their units' "frozen twins" (chapter 6).

A LoRA base is frozen: no gradient, no optimizer state, but at stage 3 still
Ψ_frozen parameters that no rank should hold whole. They are partitioned in a
second flat buffer (``FlatParams(select="frozen")``) whose units mirror the
trainable ones; unit index T + j is trainable unit j's *frozen twin*, gathered
and released with it. Releasing a twin in backward is the subtle part: it gets
no gradient, so nothing says when autograd is done with it. It waits for

    its trainable unit        all of that unit's gradients are in
    small trainable params    kept whole inside it (a LayerNorm's weight): their gradients
    each forward's inputs     their gradients (every backward node that read the twin has run)

``release_waits`` counts these per unit; ``FrozenTwins`` counts them down.
"""
from __future__ import annotations

import torch
from torch import nn

from zerolab.engine.flat import unit_paths_of
from zerolab.engine.unit_hooks import tensors_of


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


def with_twins(flat, frozen_flat):
    """``(units, full buffers, (param, view) pairs)``, one entry per unit index: the trainable units of
    ``flat``, then the frozen twins of ``frozen_flat`` (None: nothing frozen)."""
    parts = [flat] + ([frozen_flat] if frozen_flat is not None else [])
    units = [u for f in parts for u in f.units]
    full = [b for f in parts for b in f.full]
    views = [v for f in parts for v in f.unit_views]
    for u in units:
        for name, p in u.params:
            p._zl_name, p._zl_class = name, type(p)
            # the full size, read by DeepSpeed-aware tools (PEFT, transformers) when a parameter is released
            p.ds_shape, p.ds_numel = tuple(p.shape), p.numel()
    return units, full, [list(zip((p for _, p in u.params), views[i])) for i, u in enumerate(units)]


class FrozenTwins:
    """Stage 3's bookkeeping of when a frozen twin may be released in backward."""

    def shard_of(self, i: int) -> torch.Tensor:
        """This rank's shard of unit ``i`` (a trainable unit or a frozen twin): (S,)."""
        if i < self.n_trainable:
            return self.flat.shard_view(self.param_shard, self.units[i])
        return self.frozen_flat.shard_view(self.frozen_shard, self.units[i])

    def watch_inputs(self, frozen: list, args, kwargs) -> None:
        """A unit with frozen twins ran forward: each twin also waits for the inputs' gradients."""
        inputs = [t for t in tensors_of([args, kwargs]) if t.requires_grad]
        if inputs:
            for j in frozen:
                self._grads_left[j] += 1
            torch.autograd.graph.register_multi_grad_hook(inputs, lambda _g: self._frozen_done(frozen))

    def twin_grad_in(self, p, i: int) -> None:
        """A gradient of unit ``i`` arrived: count it for a twin waiting on it."""
        if id(p) in self._twin_waits:
            self._frozen_done([self._twin_waits[id(p)]])

    def unit_grads_done(self, i: int) -> None:
        """Trainable unit ``i`` has all its gradients: its twin waited for that."""
        if i in self.twin_of:
            self._frozen_done([self.twin_of[i]])

    def _frozen_done(self, frozen) -> None:
        """One thing a frozen twin's release waited for is done; after the last one it is released."""
        for j in frozen:
            self._grads_left[j] -= 1
            if self._grads_left[j] == 0:
                self.release_params(j)
