"""ZeRO-3's one demand on the model: every rank gathers the same units in the same order (chapter 6).

A unit's all-gather is a collective: it completes only when every rank of the
group issues it. Stage 3 issues it when the unit's module is about to run, so
a module whose forward runs on some ranks only — an expert of a mixture of
experts that got no tokens here, a layer behind ``if`` on the data — makes
the ranks issue different collectives. Two outcomes, both bad: the ranks wait
for each other until the collective times out, or — when the two units happen
to have the same size — the all-gather completes with one rank's shard of one
unit beside another rank's shard of another, and training goes on with wrong
weights. DeepSpeed and FSDP have the same demand (DeepSpeed's answer for
mixture-of-experts blocks is ``set_z3_leaf_modules``: the whole block is one
unit, gathered on every rank whether or not an expert is used).

zerolab's default units already keep an expert inside its block's unit
(``flat.find_units``: only the top-level blocks are units). What this file
adds is the guarantee that a model breaking the rule fails loudly:

* each rank folds the unit index of every all-gather it issues into a running
  hash; at each optimizer step, before anything is updated (the engine's
  ``agree_before_update`` phase, the step's first collective), the ranks compare
  (count, hash) in one all-reduce of four integers (booked in
  ``engine.comm.control``, apart from the algorithm's bytes) and raise an error
  naming the units this rank gathered — a silent mismatch never reaches the
  weights;
* an all-gather that fails (a timeout, a size mismatch) raises the same
  explanation, naming the unit it was gathering, with the backend's error as
  the cause.

The fix the message gives: make the module that may be skipped part of a unit
that runs on every rank — ``zl.set_leaf_modules(model, [ItsParentClass])``
(DeepSpeed's ``deepspeed.utils.set_z3_leaf_modules``), or a unit policy
(``{"zerolab": {"units": [...]}}``) that names the parent, not the expert.
"""
from __future__ import annotations

import torch
from torch import nn

_MASK = (1 << 62) - 1
_SHOWN = 12   # unit uses quoted in the error


class UnitOrderCheck:
    """The engine's part: a running hash of the units this rank gathered since the last step."""

    _order_count, _order_hash, _order_log = 0, 0, ()

    def note_gather(self, i: int) -> None:
        """Unit ``i``'s all-gather is being issued on this rank."""
        self._order_count += 1
        self._order_hash = (self._order_hash * 1_000_003 + i + 1) & _MASK
        if len(self._order_log) < _SHOWN:
            self._order_log = (*self._order_log, i)

    def _unit_names(self, units) -> str:
        return ", ".join(f"{i} ({self.units[i].name if i < len(self.units) else '?'})" for i in units) or "none"

    def check_unit_order(self) -> None:
        """A collective, at every optimizer step on every rank: raise if the ranks gathered different units."""
        mine = (self._order_count, self._order_hash)
        log, self._order_count, self._order_hash, self._order_log = self._order_log, 0, 0, ()
        if self.world_size == 1:
            return
        t = torch.tensor([mine[0], mine[1], -mine[0], -mine[1]], dtype=torch.int64)
        self.communicator.all_reduce(t, op="max", tag="unit-order", control=True)
        if int(t[0]) != -int(t[2]) or int(t[1]) != -int(t[3]):
            raise RuntimeError(
                f"ZeRO-3: the ranks gathered different units since the last step (rank {self.rank}: "
                f"{mine[0]} all-gathers; the ranks' counts range from {-int(t[2])} to {int(t[0])}); the first "
                f"units this rank gathered: {self._unit_names(log)}. " + self.order_advice())

    def agree_before_update(self) -> None:
        """The engine's step phase before anything is updated (``base.py``): the order check."""
        super().agree_before_update()
        self.check_unit_order()

    def order_advice(self) -> str:
        return ("Every rank must run the same units' forward in the same order: a module whose forward runs "
                "on some ranks only (an expert that got no tokens, a layer behind a data-dependent `if`) must "
                "be inside a unit that runs on every rank: zl.set_leaf_modules(model, [its parent's class]) "
                "(DeepSpeed: deepspeed.utils.set_z3_leaf_modules), or a {'zerolab': {'units': [...]}} policy "
                "naming the parent. The parameters were not updated.")

    def gather_failed(self, i: int, err: BaseException) -> RuntimeError:
        """The error to raise when unit ``i``'s all-gather failed on this rank."""
        return RuntimeError(f"ZeRO-3: the all-gather of unit {i} ({self.units[i].name}) failed on rank "
                            f"{self.rank}: {str(err).splitlines()[0] if str(err) else type(err).__name__}. "
                            f"A common cause: the ranks are gathering different units. " + self.order_advice())


def set_leaf_modules(model: nn.Module, classes) -> list:
    """Make every module of ``classes`` (classes or class names) one ZeRO-3 unit with all it contains:
    gathered whole around its forward and backward on every rank, whichever of its children run.
    Marks them as DeepSpeed's ``set_z3_leaf_modules`` does (``module._z3_leaf = True``, which
    ``flat.find_units`` honours, so DeepSpeed's own call works too); call it before ``zl.initialize``.
    Returns the modules marked; a class list that matches no module is an error naming them."""
    classes = [classes] if isinstance(classes, (type, str)) else list(classes)
    names = {c if isinstance(c, str) else c.__name__ for c in classes}
    marked = [m for m in model.modules() if type(m).__name__ in names
              or any(isinstance(m, c) for c in classes if isinstance(c, type))]
    if not marked:
        raise ValueError(f"set_leaf_modules: no module of {sorted(names)} in {type(model).__name__}; "
                         f"its module classes include {sorted({type(m).__name__ for m in model.modules()})[:12]}")
    for m in marked:
        m._z3_leaf = True
    return marked
