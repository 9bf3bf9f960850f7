"""The unit trace behind ZeRO-3 prefetch and reuse (chapter 6).

ZeRO-3 cannot prefetch what it cannot predict. The first micro-step records
the order units are *used* in (forward pre-hooks, then the backward hooks
that fire just before each unit's backward); later micro-steps walk the same
list, so at every use the engine knows which units come next:

    order   [rest, b0, b1, b2, rest, b2, b1, b0]     (forward, then backward)
    pos                  ^ using b1: b2 and rest are next

``upcoming()`` is what ``Prefetcher.prefetch`` gathers ahead (greedy, in
order). The knobs, DeepSpeed's names: ``stage3_prefetch_bucket_size``
(elements gathered ahead; 0 = no prefetch) and ``stage3_max_live_parameters``
(prefetch stops where the gathered elements would exceed it: it caps what is
gathered *ahead*, while the unit computing now and units kept for reuse are
gathered regardless). ``reuse_distance(u)`` is how many elements are used
before ``u`` is needed again: under ``stage3_max_reuse_distance`` the unit is
kept instead of released.

Every rank must use units in the same order within a micro-step (their
all-gathers must match, as in DeepSpeed and FSDP), but the order may change
from step to step (data-dependent control flow): a use that differs from the
record invalidates it, prefetch stops for the rest of the micro-step, and the
new order is recorded and used from the next micro-step on.
"""
from __future__ import annotations

import warnings


class UnitTrace:
    """The recorded order of unit uses in one micro-step (forward + backward)."""

    def __init__(self, numels: dict):
        self.numels = numels       # unit index -> padded elements
        self.order: list = []      # the recorded order (valid when self.valid)
        self.valid = False         # a complete record exists and matches so far
        self.pos = 0               # uses seen in this micro-step
        self.seen: list = []       # uses of this micro-step, recorded as they come
        self.changes = 0           # how often the order changed (and was re-recorded)
        self.mismatch: str = ""    # what differed, for the warning

    def start(self) -> None:
        """A micro-step begins (the root module's forward)."""
        self.pos, self.seen, self.mismatch = 0, [], ""
        self.valid = bool(self.order)

    def use(self, u: int) -> None:
        """Unit ``u`` is used now; a use the record did not predict invalidates it."""
        if self.valid and (self.pos >= len(self.order) or self.order[self.pos] != u):
            expected = self.order[self.pos] if self.pos < len(self.order) else "the end"
            self.mismatch = f"use {self.pos}: expected unit {expected}, got unit {u}"
            self.valid = False
        self.seen.append(u)
        self.pos += 1

    def finish(self) -> bool:
        """End of backward: keep this micro-step's order; True if it differs from the record."""
        if self.valid and self.pos != len(self.order):
            self.mismatch = f"{self.pos} uses, the record has {len(self.order)}"
            self.valid = False
        changed = bool(self.order) and self.seen != self.order
        self.changes += changed
        self.order, self.valid = self.seen, False
        return changed

    def upcoming(self) -> list:
        """Units used after the current one, in order ([] while recording or invalid)."""
        return self.order[self.pos:] if self.valid else []

    def reuse_distance(self, u: int) -> float:
        """Elements of other units used before ``u`` is used again (inf: not in this micro-step)."""
        if not self.valid:
            return float("inf")
        d = 0
        for v in self.order[self.pos:]:
            if v == u:
                return d
            d += self.numels[v]
        return float("inf")


class Prefetcher:
    """Stage 3's prefetch and reuse, along the ``UnitTrace`` (``self.trace``): which units to gather
    ahead of their use, and which to keep instead of releasing after one."""

    def _use(self, units) -> None:
        """A module is about to compute with ``units``: record the use, gather them, gather ahead."""
        if self._tracing:
            for i in units:
                self.trace.use(i)
                self._ahead.discard(i)
                self._keep.discard(i)
        self.gather_params(units)
        if self._tracing:
            self.prefetch()

    def finish_trace(self) -> None:
        """Backward ended: close the recorded order (a changed order is recorded anew, with a warning)."""
        if self._tracing and self.trace.finish():
            warnings.warn(f"zerolab ZeRO-3: the order units ran in changed ({self.trace.mismatch}); "
                          f"prefetch stopped at the change and the new order was recorded for the next "
                          f"step (results are unaffected; every rank must still run the same units)",
                          stacklevel=3)
        self._tracing = False

    def prefetch(self) -> None:
        """All-gather the next units of the recorded order asynchronously, greedily and in
        order, while the elements gathered ahead stay within ``stage3_prefetch_bucket_size``
        and all gathered elements within ``stage3_max_live_parameters``. A gathered unit whose
        next use is inside that window is kept until then (as DeepSpeed does): released and
        gathered again, its all-gather would queue behind the ones issued here."""
        if not self.prefetch_elements:
            return
        ahead = sum(self.units[i].padded for i in self._ahead)
        for i in self.trace.upcoming():
            if i in self._ahead:
                continue                      # prefetched already, counted in ahead
            n = self.units[i].padded
            if ahead + n > self.prefetch_elements:
                break
            if i in self._gathered:           # in use now (or kept): keep it for this next use
                self._keep.add(i)
            elif self.live_elements + n > self.max_live:
                break
            else:
                self._issue(i)
                self._ahead.add(i)
            ahead += n

    def _done_with(self, i: int) -> None:
        """After a use: keep the unit if prefetch saw its next use, or if that use is within
        ``stage3_max_reuse_distance`` elements (and the gathered units fit); else release it."""
        if i in self._keep:
            return
        if self.trace.reuse_distance(i) >= self.max_reuse or self.live_elements > self.max_live:
            self.release_params(i)

