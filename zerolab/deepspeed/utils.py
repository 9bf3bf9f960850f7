"""``deepspeed.utils``: ``RepeatingLoader``, which restarts a loader whenever it runs out (DeepSpeed's, same
behaviour), ZeRO-3's leaf modules (``set_z3_leaf_modules``: a module gathered whole, chapter 6), and
DeepSpeed's ``logger`` (the logger named "DeepSpeed", INFO, to stdout) with ``log_dist``."""
from __future__ import annotations

import logging
import sys

from zerolab.engine.unit_order import set_leaf_modules


def _make_logger() -> logging.Logger:
    log = logging.getLogger("DeepSpeed")
    if not log.handlers:   # one handler, as DeepSpeed's: the script's own logging setup is left alone
        handler = logging.StreamHandler(stream=sys.stdout)
        handler.setFormatter(logging.Formatter("[%(asctime)s] [%(levelname)s] [%(filename)s:%(lineno)d:"
                                               "%(funcName)s] %(message)s"))
        log.addHandler(handler)
        log.setLevel(logging.INFO)
        log.propagate = False
    return log


logger = _make_logger()


def log_dist(message: str, ranks=None, level=logging.INFO) -> None:
    """Log ``message`` on the listed ranks (None or [-1]: every rank), as DeepSpeed's ``log_dist``."""
    import torch.distributed as dist
    rank = dist.get_rank() if dist.is_available() and dist.is_initialized() else 0
    if ranks is None or -1 in ranks or rank in ranks:
        logger.log(level, f"[Rank {rank}] {message}")


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
