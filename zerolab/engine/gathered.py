"""Full parameters outside forward at stage 3: ``zl.gathered_parameters`` and the released-parameter guard (chapter 6).

Between uses a stage-3 rank keeps only its 1/N shard of each unit; a released
parameter is an empty tensor. To read one (logging, an evaluation metric) or
edit one (initialising a layer after ``initialize``), code outside the model's
forward enters ``with zl.gathered_parameters(engine, module):``: the units
holding those parameters are all-gathered for the block and released after;
with ``modifier_rank=r`` rank r's in-place edits are broadcast and written back
into every rank's shard (and the fp32 master, where an element changed).
``{"zerolab": {"debug": true}}`` turns a released parameter into a
``ReleasedParameter`` that raises an explanatory error when touched.
"""
from __future__ import annotations

from contextlib import contextmanager

import torch
from torch import nn


@contextmanager
def gathered_parameters(engine, modules_or_params=None, modifier_rank=None):
    """Make full parameters readable inside the block (chapter 6); collective: every rank enters.

    ``modules_or_params``: a module, a parameter or a list of them (None: the
    whole model). Stage 3 all-gathers the units holding them and releases them
    on exit; with ``modifier_rank=r``, rank r's in-place edits are broadcast and
    re-partitioned (its shard, and the fp32 master where an element changed).
    Stages 0-2 keep every parameter whole on every rank: a no-op there.
    """
    if not hasattr(engine, "gathered"):
        yield
        return
    with engine.gathered(_params_of(engine, modules_or_params), modifier_rank):
        yield


def _params_of(engine, x) -> list:
    if x is None:
        return list(engine.module.parameters())
    if isinstance(x, torch.Tensor):
        return [x]
    if isinstance(x, nn.Module):
        return list(x.parameters())
    return [p for item in x for p in _params_of(engine, item)]


class GatheredMixin:
    """Stage 3's whole parameters on demand: ``gathered``, ``param_shape``, ``close``
    (``Stage3Engine`` derives from it)."""

    @contextmanager
    def gathered(self, params, modifier_rank=None):
        """Full ``params`` inside the block (collective: every rank must enter). With
        ``modifier_rank=r``, rank r's in-place edits are broadcast and re-partitioned on exit."""
        units = sorted({self._unit_of[id(p)] for p in params if id(p) in self._unit_of})
        fetched = [i for i in units if i not in self._gathered and i not in self.persistent]
        self.gather_params(fetched)
        try:
            yield
            if modifier_rank is not None:
                self._repartition(units, modifier_rank)
        finally:
            for i in fetched:
                self.release_params(i)

    def param_shape(self, p) -> torch.Size:
        """The full shape of ``p`` (released, it is an empty tensor): its view into the unit buffer."""
        return next(v.shape for q, v in self._views[self._unit_of[id(p)]] if q is p)

    def close(self) -> None:
        """Collective: gather every unit for good and remove the hooks, leaving a plain model
        (parameters in the compute dtype, each unit's full buffer) that works without the engine."""
        if not self._module_hooks:
            return
        self.gather_params([i for i in range(len(self.units)) if i not in self.persistent])
        for h in self._module_hooks:
            h.remove()
        self._module_hooks = []
        super().close()

    @torch.no_grad()
    def _repartition(self, units, src: int) -> None:
        for i in units:
            u = self.units[i]
            self.communicator.broadcast(self._full[i], src=src, tag="modified-params")
            new = self._full[i][self.rank * u.shard: (self.rank + 1) * u.shard]   # (S,) the edited shard
            shard = self.shard_of(i)
            changed = shard != new
            shard.copy_(new)
            if self.master is not None and i < self.n_trainable:   # fp32 master: only the edited elements take the 16-bit value
                self.targets[i][changed] = new[changed].float()


_HARMLESS = {"__get__", "__set__", "__delete__", "numel", "dim", "size", "__len__"}


class ReleasedParameter(nn.Parameter):
    """A released parameter under ``{"zerolab": {"debug": true}}``: any use raises."""

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        if getattr(func, "__name__", "") not in _HARMLESS:
            for a in list(args) + list((kwargs or {}).values()):
                if isinstance(a, ReleasedParameter):
                    raise RuntimeError(
                        f"ZeRO-3 released parameter {a._zl_name!r}: outside its unit's forward and backward "
                        f"this rank keeps only a 1/N shard of it, and the parameter itself is an empty "
                        f"tensor. To read it, wrap the code in `with zl.gathered_parameters(engine, module):`;"
                        f" to change it, edit in place inside `with zl.gathered_parameters(engine, module, "
                        f"modifier_rank=0):` (rank 0's edit is kept). (Raised because zerolab.debug is on.)")
        with torch._C.DisableTorchFunctionSubclass():
            return func(*args, **(kwargs or {}))
