"""Parameters that got no gradient on any rank are not stepped, as in torch (chapter 3).

A single-process ``torch.optim`` step skips a parameter whose ``.grad`` is
None: its Adam moments, its weight decay and its own step count stay as they
were. DDP with ``find_unused_parameters=True`` agrees. A flat-buffer engine
has no None: an unused parameter's slice of the reduced gradient is zero, and
stepping it with that zero still moves it — the moments of earlier steps keep
pushing (about one learning rate per step) and weight decay shrinks it.
(DeepSpeed's flat buffers behave that way.)

Whether *some* rank produced a gradient is a fact about all ranks, so each
rank sends one flag per parameter (1: I saw its gradient in this step) in a
MAX all-reduce before the step; the parameters whose flag stays 0 sit the
step out (``ShardedOptimizer.skip_now``; their own step count, as torch's
per-parameter ``state["step"]``, is the engine's count minus the steps they
sat out). The call is the same on every rank whatever the data, costs one byte
per parameter tensor, and is booked apart from the algorithm's collectives
(``engine.comm.control``), so byte counts of the training collectives stay
those of the formulas.
"""
from __future__ import annotations

import torch


def param_spans(flat, shards_optimizer: bool) -> list:
    """Per unit, the parameters' spans inside the elements this rank updates: ``(start, end, name)``."""
    out = []
    for u in flat.units:
        a, b = flat.own_range(u, shards_optimizer)
        spans = []
        ends = u.offsets[1:] + [u.numel]   # (not p.numel(): a released ZeRO-3 parameter is empty)
        for (name, _), off, end in zip(u.params, u.offsets, ends):
            s, e = max(off, a), min(end, b)
            if s < e:
                spans.append((s - a, e - a, name))
        out.append(spans)
    return out


class SkipUnused:
    """The engine's part: which parameters saw a gradient in this step, on any rank."""

    def unused_everywhere(self, seen: set) -> set:
        """Names of the trainable parameters no rank saw a gradient for since the last step (``seen``:
        ids of the parameters this rank saw). A collective: every rank calls it at every step."""
        params = [(name, p) for u in self.flat.units for name, p in u.params]
        flags = torch.tensor([1 if id(p) in seen else 0 for _, p in params], dtype=torch.uint8)
        if self.world_size > 1:
            self.communicator.all_reduce(flags, op="max", tag="unused-params", control=True)
        return {name for (name, _), f in zip(params, flags.tolist()) if not f}
