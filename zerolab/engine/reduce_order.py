"""When stage 3 reduces a unit: once its module's backward is done, the same moment on every rank (chapter 6).

Stages 0-2 reduce a unit (or a bucket) as soon as *this rank* has all its
gradients. During their backward only reductions run, always in the same
bucket order, so a rank that completes a unit later (a parameter it did not
use: an expert that got no tokens here) merely issues the same call later.
Stage 3 also all-gathers during backward, and then "complete on this rank"
is not enough: rank A, whose expert got tokens, reduces block 5 before it
gathers block 4; rank B, whose expert got none, only flushes block 5 at the
end of backward, after gathering block 4. The ranks call collectives in
different orders and wait for each other forever.

So at stage 3 a unit is ready when its *module's backward is done*: a hook on
the inputs of each forward call of the unit's module fires once their
gradients exist, which is after every node of the module ran (and, since
autograd runs gradient accumulation first, after its parameters' gradients
are in). That moment depends on the model's structure, not on the data, so
every rank reaches it at the same point of its collective sequence, as
FSDP's post-backward hooks do. A unit whose module had no input needing a
gradient (an embedding, the root's own parameters, the persistent unit) is
ready when backward ends. Parameters that got no gradient go as zeros.

A gradient that arrives after its unit was reduced (a parameter shared with a
module that runs later in backward) would be lost; it raises instead.
"""
from __future__ import annotations

import torch

from zerolab.engine.unit_hooks import tensors_of


class ReduceWhenDone:
    """Stage 3's readiness: units by their module's backward, buckets by their units."""
    fire_on_local_grads = False   # GradientBuckets / Stage2Engine: no reduction on local completion

    _calls_left = None   # per unit: forward calls whose backward is not done yet (counted from the forward)

    def reset_buckets(self) -> None:
        super().reset_buckets()
        self._units_done_left = [len(b) for b in self.buckets]   # per bucket: units whose backward is not done

    def _end_of_backward(self) -> None:
        super()._end_of_backward()
        self._calls_left = None   # a forward whose backward never ran leaves nothing behind

    def watch_backward(self, i: int, args, kwargs) -> None:
        """Unit ``i``'s module runs forward: its unit is done when the inputs have their gradients."""
        if i >= len(self.flat.units):   # a frozen twin alone: nothing to reduce
            return
        inputs = [t for t in tensors_of([args, kwargs]) if t.requires_grad]
        if inputs:
            if self._calls_left is None:
                self._calls_left = [0] * len(self.flat.units)
            self._calls_left[i] += 1
            torch.autograd.graph.register_multi_grad_hook(inputs, lambda _g: self._call_done(i))

    def _call_done(self, i: int) -> None:
        if not self._in_backward or self._calls_left is None or self._calls_left[i] <= 0:
            return
        self._calls_left[i] -= 1
        if self._calls_left[i] == 0 and self._reducing:
            self._unit_ready[i] = True
            b = self._bucket_of_unit[i]
            self._units_done_left[b] -= 1
            if getattr(self, "stages_buckets_whole", False):
                if self._units_done_left[b] == 0:
                    self._ready[b] = True
                    self.launch_ready()
            else:
                self._reduce_ready_units()

    def keep_grad(self, p) -> None:
        """A gradient for a unit already reduced cannot be added any more: say so."""
        j = self._place[id(p)][0]
        whole = getattr(self, "stages_buckets_whole", False)
        late = (self._bucket_of[id(p)] < self._next_bucket) if whole else \
            (self._groups is not None and self.staging.group_of[j] < self._next_group)
        if late:
            raise RuntimeError(f"ZeRO-3: parameter {getattr(p, '_zl_name', '?')!r}'s unit was already reduced "
                               f"when another gradient for it arrived: a parameter of this unit is also used by a "
                               f"module that runs later in backward. Put both modules in one unit "
                               f"(\"zerolab\": {{\"units\": [...]}}) or tie the parameter to a module of its own")
        super().keep_grad(p)
