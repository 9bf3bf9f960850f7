"""The unit trace behind ZeRO-3 prefetch and reuse (chapter 6).

ZeRO-3 cannot prefetch what it cannot predict. The first micro-step records
the order units are *used* in (forward pre-hooks, then the backward hooks
that fire just before each unit's backward); later micro-steps walk the same
list, so at every use the engine knows which units come next:

    order   [rest, b0, b1, b2, rest, b2, b1, b0]     (forward, then backward)
    pos                  ^ using b1: b2 and rest are next

``upcoming()`` is what ``Stage3Engine.prefetch`` gathers ahead (greedy, in
order, within ``stage3_prefetch_bucket_size`` elements ahead and
``stage3_max_live_parameters`` live). ``reuse_distance(u)`` is how many
elements are used before ``u`` is needed again: under
``stage3_max_reuse_distance`` the unit is kept instead of released.

Every rank must use units in the same order within a micro-step (their
all-gathers must match, as in DeepSpeed and FSDP), but the order may change
from step to step (data-dependent control flow): a use that differs from the
record invalidates it, prefetch stops for the rest of the micro-step, and the
new order is recorded and used from the next micro-step on.
"""
from __future__ import annotations


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
