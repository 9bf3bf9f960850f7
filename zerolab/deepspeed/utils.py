"""``deepspeed.utils``: ``RepeatingLoader``, which restarts a loader whenever it runs out (DeepSpeed's, same
behaviour), and ZeRO-3's leaf modules (``set_z3_leaf_modules``: a module gathered whole, chapter 6)."""
from __future__ import annotations

from zerolab.engine.unit_order import set_leaf_modules


def set_z3_leaf_modules(model, leaf_module_classes) -> list:
    """Every module of ``leaf_module_classes`` becomes one ZeRO-3 unit with all it contains (an MoE block
    whose experts may get no tokens on a rank); returns the modules marked. ``zl.set_leaf_modules``."""
    return set_leaf_modules(model, leaf_module_classes)


def unset_z3_leaf_modules(model, leaf_module_classes) -> list:
    """Undo ``set_z3_leaf_modules`` for those classes (before ``initialize``); returns the modules unmarked."""
    names = {c if isinstance(c, str) else c.__name__ for c in leaf_module_classes}
    out = [m for m in model.modules() if type(m).__name__ in names and getattr(m, "_z3_leaf", False)]
    for m in out:
        m._z3_leaf = False
    return out


def get_z3_leaf_modules(model) -> list:
    """The modules marked as leaves."""
    return [m for m in model.modules() if getattr(m, "_z3_leaf", False)]


class RepeatingLoader:
    """Iterate ``loader`` for ever: on ``StopIteration`` start it again (a new epoch of its sampler's order)."""

    def __init__(self, loader):
        self.loader = loader
        self.data_iter = iter(loader)

    def __iter__(self):
        return self

    def __next__(self):
        try:
            return next(self.data_iter)
        except StopIteration:
            self.data_iter = iter(self.loader)
            return next(self.data_iter)
