"""Stage 2: ZeRO-2, gradient partitioning (chapter 5).

Stage 1 plus one idea: a rank only ever *uses* the reduced gradient of its
own shard, so it need not keep the rest. During backward, each parameter's
fresh gradient is copied into its unit's staging buffer and ``p.grad`` is
dropped; as soon as the unit's last gradient is in, the unit is reduced
straight into this rank's gradient shard and its staging buffer is freed.
Between backward and step a rank holds gradients for Ψ/N elements only;
during backward, the units being filled or in flight.

A unit's staging buffer has the unit's own layout, which is already its N
shards in rank order, so the reduce-scatter reads it as it is:

    staging of unit u (N x S):  [ shard 0 | shard 1 | ... ]   -> rank r gets the sum of shard r

Buckets (``reduce_bucket_size``) still group units: their collectives are
issued unit by unit, in backward order, and the bucket is done when its last
unit is; with ``overlap_comm`` a bucket's size bounds the gradient elements
staged or in flight at once (the oldest collective is waited for first).

The price: gradients cannot wait for the accumulation boundary (nobody keeps
the full sum), so *every* micro-batch reduce-scatters; per step that is
g reduce-scatters plus one all-gather, (g+1)/2 times stage 1's bytes.
``contiguous_gradients``: the shard is one contiguous buffer in shard space,
so the reduce-scatter writes into it directly and the optimizer reads it as is.

Not the idea, in files of their own: on gloo a unit is all-reduced and a small
unit shares its neighbour's call (``collectives.py``, a tuning); ZeRO++'s qgZ and
the offload engines stage a whole bucket at once (``whole_buckets.py``).
"""
from __future__ import annotations

import torch

from zerolab.engine import events as ev
from zerolab.engine.buckets import UnitStaging
from zerolab.engine.collectives import all_reduce_own_slices, reduce_groups
from zerolab.engine.stage1 import Stage1Engine
from zerolab.runtime.measure import storage_bytes
from zerolab.engine.accumulate import first_backward_of_step


class Stage2Engine(Stage1Engine):
    stage = 2
    reduce_every_micro_step = True

    def build_grads(self) -> None:
        """Only this rank's gradient shard is kept; full gradients exist briefly, per unit."""
        # gradient shard, grad dtype: padded Ψ / N elements (contiguous_gradients)
        self.grad_shard = torch.zeros(self.flat.shard_numel, dtype=self.precision.grad_dtype, device=self.flat.device)
        units = self.flat.units
        self._place = {id(p): (j, off) for j, u in enumerate(units) for (_, p), off in zip(u.params, u.offsets)}
        self._unit_index = index = {id(u): j for j, u in enumerate(units)}
        self._order = [index[id(u)] for b in self.buckets for u in reversed(b)]   # backward order
        self._bucket_of_unit = {index[id(u)]: i for i, b in enumerate(self.buckets) for u in b}
        self._groups = None       # units reduced by one collective, set at the first backward
        self.staging = None       # their staging buffers (buckets.UnitStaging)
        for p in self.flat.params():
            p.grad = None

    def reset_buckets(self) -> None:
        super().reset_buckets()
        self._unit_left = [len(u.params) for u in self.flat.units]   # gradients still to come, per unit
        self._unit_ready = [False] * len(self.flat.units)
        self._units_left = [len(b) for b in self.buckets]             # units not yet reduced, per bucket
        self._next_group = 0                                          # position in self._groups
        if self._groups is None:   # grad_collective is known by now: which units share a call (collectives.py)
            self._groups = reduce_groups(self.flat.units, self._order, self._bucket_of_unit, self.grad_collective)
            self.staging = UnitStaging(self.flat.units, self._groups, self.grad_shard.dtype, self.grad_shard.device)

    def keep_grad(self, p) -> None:
        """Copy the fresh gradient into its unit's staging buffer and drop ``p.grad``."""
        self.stage_grad(p, p.grad.view(-1))
        p.grad = None

    def stage_grad(self, p, g: torch.Tensor) -> None:
        j, off = self._place[id(p)]
        self.staging.view(j)[off: off + g.numel()].copy_(g)

    def grad_arrived(self, p) -> None:
        """A unit whose gradients are all in is reduced now (in backward order), not with its bucket."""
        j = self._place[id(p)][0]
        self._unit_left[j] -= 1
        if self._unit_left[j] == 0 and self.fire_on_local_grads:
            self._unit_ready[j] = True
            self._reduce_ready_units()
        super().grad_arrived(p)

    def reduce_bucket(self, i: int) -> None:
        """Bucket ``i`` is complete (or backward ended): reduce what is left of it; units without
        gradients (unused parameters) go as zeros."""
        for u in self.buckets[i]:
            self._unit_ready[self._unit_index[id(u)]] = True
        self._reduce_ready_units()

    def _reduce_ready_units(self) -> None:
        """Issue the groups whose units are all ready, in backward order (every rank must call
        collectives in the same order)."""
        while self._next_group < len(self._groups) and \
                all(self._unit_ready[j] for j in self._groups[self._next_group]):
            self.reduce_units(self._next_group)
            self._next_group += 1

    def reduce_units(self, g: int) -> None:
        """Reduce-scatter group ``g``'s staging buffer (one unit; on gloo perhaps a small one and the
        next) into this rank's gradient shard; free the buffer when done."""
        js, i = self._groups[g], self._bucket_of_unit[self._groups[g][0]]
        units = [self.flat.units[j] for j in js]
        if self.overlap_comm:
            self.bound_in_flight()
        views = [self.staging.view(j) for j in js]   # (creates the buffer if no gradient came)
        staging = self.staging.pop(g)                # from here on only the collective holds it
        for u, j, view in zip(units, js, views):
            if self._unit_left[j]:   # parameters that got no gradient in this backward (unused): zeros
                for (_, p), a, b in zip(u.params, u.offsets, u.offsets[1:] + [u.numel]):
                    if id(p) not in self._fired:
                        view[a:b].zero_()
        dests = [self.flat.shard_view(self.grad_shard, u) for u in units]
        first = first_backward_of_step(self)   # the step's first backward writes the shard, later ones add
        self.announce(i)
        if self.grad_collective == "reduce_scatter":   # one unit: its layout is its N shards
            outs = [dests[0] if first else torch.empty_like(dests[0])]
            h = self.communicator.reduce_scatter(outs[0], staging, async_op=self.overlap_comm,
                                                 tag=f"grad-bucket-{i}")
            keep = (staging,) if first else (staging, outs[0])
        else:   # a tuning (collectives.py): all-reduce in place, keep this rank's slice of each unit
            h, outs, keep = all_reduce_own_slices(self.communicator, staging, views, units, self.rank,
                                                  self.overlap_comm, f"grad-bucket-{i}")

        def finish():
            for out, dest in zip(outs, dests):
                if out is not dest and first:
                    dest.copy_(out)
                elif out is not dest:
                    dest.add_(out)
            self._units_left[i] -= len(js)
            if self._units_left[i] == 0:
                self.event(ev.REDUCE_DONE, i)
        self.track(h, finish, keep, None)

    def bound_in_flight(self) -> None:
        """``overlap_comm``: the gradient elements staged or in flight stay within one bucket
        (``reduce_bucket_size``): wait for the oldest collectives until they do."""
        while self._pending and self.transient_bytes() // self.grad_shard.element_size() > \
                self.config.zero.reduce_bucket_size:
            self.finish_oldest()

    # ---------------------------------------------------------------- what the step reads, memory
    def owned_grads(self) -> list[torch.Tensor]:
        return [self.flat.shard_view(self.grad_shard, u) for u in self.flat.units]

    def zero_grads(self) -> None:
        self.grad_shard.zero_()

    def grad_bytes(self) -> int:
        return storage_bytes(self.grad_shard)

    def transient_bytes(self) -> int:
        storages = {t.untyped_storage().data_ptr(): storage_bytes(t) for _, _, keep, _ in self._pending for t in keep}
        if self.staging is not None:
            storages.update({s.untyped_storage().data_ptr(): storage_bytes(s) for s in self.staging.buffers.values()})
        return sum(storages.values())
