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
staged or in flight at once (the oldest collective is waited for first). On
gloo (``pick_collectives``) a unit's buffer is all-reduced in place and this
rank's slice kept, and a unit smaller than an eighth of the largest does not get a call of its
own: it goes in one all-reduce with the next unit of its bucket (``reduce_groups``; a synchronous
gloo call costs about the same whatever its size, docs/MEASUREMENTS.md). A subclass whose collective needs a whole bucket at once
(ZeRO++'s qgZ all-to-all, the offload engines) sets ``stages_buckets_whole``:
its bucket is staged *rank-major* (row r = rank r's shard of every unit).

The price: gradients cannot wait for the accumulation boundary (nobody keeps
the full sum), so *every* micro-batch reduce-scatters; per step that is
g reduce-scatters plus one all-gather, (g+1)/2 times stage 1's bytes.
``contiguous_gradients``: the shard is one contiguous buffer in shard space,
so the reduce-scatter writes into it directly and the optimizer reads it as is.
"""
from __future__ import annotations

import torch

from zerolab.engine import events as ev
from zerolab.runtime.measure import storage_bytes
from zerolab.engine.buckets import rank_major_pieces
from zerolab.engine.stage1 import Stage1Engine


class Stage2Engine(Stage1Engine):
    stage = 2
    reduce_every_micro_step = True
    stages_buckets_whole = False   # True: a bucket's gradients are staged rank-major for one collective

    def build_grads(self) -> None:
        """Only this rank's gradient shard is kept; full gradients exist briefly, per unit."""
        # gradient shard, grad dtype: padded Ψ / N elements (contiguous_gradients)
        self.grad_shard = torch.zeros(self.flat.shard_numel, dtype=self.precision.grad_dtype, device=self.flat.device)
        units = self.flat.units
        self._unit_staging = {}   # group -> its units' full gradients (Σ padded_u,), alive until its collective is done
        self._place = {id(p): (j, off) for j, u in enumerate(units) for (_, p), off in zip(u.params, u.offsets)}
        self._unit_index = index = {id(u): j for j, u in enumerate(units)}
        self._order = [index[id(u)] for b in self.buckets for u in reversed(b)]   # backward order
        self._bucket_of_unit = {index[id(u)]: i for i, b in enumerate(self.buckets) for u in b}
        self._groups = None   # units reduced by one collective (reduce_groups), set at the first backward
        self._staging = [None] * len(self.buckets)   # stages_buckets_whole: per bucket, rank-major
        self._pieces = {}                            # id(p) -> (bucket, [(src start, src end, dst start)])
        for i, b in enumerate(self.buckets if self.stages_buckets_whole else []):
            row, col = sum(u.shard for u in b), 0    # ΣS: one rank's share of the bucket
            for u in b:
                for (_, p), off in zip(u.params, u.offsets):
                    self._pieces[id(p)] = (i, rank_major_pieces(off, p.numel(), u.shard, row, col))
                col += u.shard
        for p in self.flat.params():
            p.grad = None

    def reset_buckets(self) -> None:
        super().reset_buckets()
        self._unit_left = [len(u.params) for u in self.flat.units]   # gradients still to come, per unit
        self._unit_ready = [False] * len(self.flat.units)
        self._units_left = [len(b) for b in self.buckets]             # units not yet reduced, per bucket
        self._next_group = 0                                          # position in self._groups
        if self._groups is None and not self.stages_buckets_whole:   # grad_collective is known by now
            units, self._groups = self.flat.units, self.reduce_groups()
            self._group_of = {j: g for g, js in enumerate(self._groups) for j in js}
            self._group_off = {j: sum(units[k].padded for k in js[:js.index(j)]) for js in self._groups for j in js}

    def reduce_groups(self) -> list[list[int]]:
        """Which units share a collective, in backward order: each unit alone, except on the all-reduce
        path (gloo), where a unit smaller than 1/8 of the largest joins the next unit of its bucket."""
        units, small = self.flat.units, max(u.padded for u in self.flat.units) / 8
        groups, cur = [], []
        for k, j in enumerate(self._order):
            cur.append(j)
            nxt = self._order[k + 1] if k + 1 < len(self._order) else None
            if self.grad_collective != "all_reduce" or units[j].padded >= small or nxt is None \
                    or self._bucket_of_unit[nxt] != self._bucket_of_unit[j]:
                groups.append(cur)
                cur = []
        return groups

    def _unit_buffer(self, j: int) -> torch.Tensor:
        """Unit ``j``'s slice of its group's staging buffer (created with the group's first gradient)."""
        g = self._group_of[j]
        if g not in self._unit_staging:
            # staging, grad dtype: the group's padded elements; every gradient is copied in whole, so only
            # the padding is zeroed here (and, in reduce_units, the parameters that got no gradient)
            buf = torch.empty(sum(self.flat.units[k].padded for k in self._groups[g]),
                              dtype=self.grad_shard.dtype, device=self.grad_shard.device)
            for k in self._groups[g]:
                u = self.flat.units[k]
                buf[self._group_off[k] + u.numel: self._group_off[k] + u.padded].zero_()
            self._unit_staging[g] = buf
        u, off = self.flat.units[j], self._group_off[j]
        return self._unit_staging[g][off: off + u.padded]

    def _zero_missing(self, j: int, staging: torch.Tensor) -> None:
        """Unit ``j`` goes with parameters that got no gradient in this backward (unused): zeros for them."""
        u = self.flat.units[j]
        ends = u.offsets[1:] + [u.numel]
        for (_, p), a, b in zip(u.params, u.offsets, ends):
            if id(p) not in self._fired:
                staging[a:b].zero_()

    def keep_grad(self, p) -> None:
        """Copy the fresh gradient into its unit's staging buffer and drop ``p.grad``."""
        g = p.grad.view(-1)
        if self.stages_buckets_whole:
            i, pieces = self._pieces[id(p)]
            staging = self._staging_buffer(i)
            for a, b, d in pieces:
                staging[d: d + b - a].copy_(g[a:b])
        else:
            j, off = self._place[id(p)]
            self._unit_buffer(j)[off: off + g.numel()].copy_(g)
        p.grad = None

    def grad_arrived(self, p) -> None:
        """A unit whose gradients are all in is reduced now (in backward order), not with its bucket."""
        if not self.stages_buckets_whole:
            j = self._place[id(p)][0]
            self._unit_left[j] -= 1
            if self._unit_left[j] == 0:
                self._unit_ready[j] = True
                self._reduce_ready_units()
        super().grad_arrived(p)

    def reduce_bucket(self, i: int) -> None:
        """Bucket ``i`` is complete (or backward ended): reduce what is left of it."""
        if self.stages_buckets_whole:
            return super().reduce_bucket(i)
        for u in self.buckets[i]:   # units without gradients (unused parameters) go as zeros
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
        """Reduce group ``g``'s staging buffer (one unit, or a small one and the next) into this rank's
        gradient shard; free the buffer when done."""
        js, i = self._groups[g], self._bucket_of_unit[self._groups[g][0]]
        if self.overlap_comm:
            self.bound_in_flight()
        views = [self._unit_buffer(j) for j in js]   # (creates the buffer if no gradient came)
        staging = self._unit_staging.pop(g)          # from here on only the collective holds it
        for j, view in zip(js, views):
            if self._unit_left[j]:
                self._zero_missing(j, view)
        dests = [self.flat.shard_view(self.grad_shard, self.flat.units[j]) for j in js]
        first = self.micro_steps % self.gas == 0   # first micro-batch of the step: the shard is zero
        self.announce(i)
        if self.grad_collective == "reduce_scatter":   # one unit: its layout is its N shards
            outs = [dests[0] if first else torch.empty_like(dests[0])]
            h = self.communicator.reduce_scatter(outs[0], staging, async_op=self.overlap_comm,
                                                 tag=f"grad-bucket-{i}")
            keep = (staging,) if first else (staging, outs[0])
        else:                   # gloo: all-reduce in place, keep this rank's slice of each unit
            outs = [v[self.rank * u.shard: (self.rank + 1) * u.shard]
                    for v, u in zip(views, (self.flat.units[j] for j in js))]
            h = self.communicator.all_reduce(staging, async_op=self.overlap_comm, tag=f"grad-bucket-{i}")
            keep = (staging,)

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

    # ---------------------------------------------------------------- a bucket staged whole
    def _staging_buffer(self, i: int) -> torch.Tensor:
        if self._staging[i] is None:
            numel = self.world_size * sum(u.shard for u in self.buckets[i])
            # staging, grad dtype: N x ΣS rank-major (zeros: padding and unused params)
            self._staging[i] = torch.zeros(numel, dtype=self.grad_shard.dtype, device=self.grad_shard.device)
        return self._staging[i]

    def _bucket_shard(self, i: int) -> torch.Tensor:
        """This rank's gradient shard of bucket ``i``: contiguous in shard space, (ΣS,)."""
        b = self.buckets[i]
        return self.grad_shard[b[0].shard_offset: b[-1].shard_offset + b[-1].shard]

    def reduce_scatter_grads(self, i: int) -> None:
        """Reduce-scatter bucket ``i``'s rank-major staging into this rank's gradient shard; free it."""
        staging, self._staging[i] = self._staging_buffer(i), None
        dest = self._bucket_shard(i)
        first = self.micro_steps % self.gas == 0
        out = dest if first else torch.empty_like(dest)
        h = self.communicator.reduce_scatter(out, staging, async_op=self.overlap_comm, tag=f"grad-bucket-{i}")
        self.track(h, None if first else (lambda: dest.add_(out)), (staging,) if first else (staging, out), i)

    def all_reduce_grads(self, i: int) -> None:
        """All-reduce bucket ``i``'s rank-major staging (2x the bytes), keep this rank's row."""
        staging, self._staging[i] = self._staging_buffer(i), None
        dest = self._bucket_shard(i)
        h = self.communicator.all_reduce(staging, async_op=self.overlap_comm, tag=f"grad-bucket-{i}")
        mine = staging[self.rank * dest.numel(): (self.rank + 1) * dest.numel()]
        self.track(h, lambda: dest.add_(mine), (staging,), i)

    # ---------------------------------------------------------------- what the step reads, memory
    def owned_grads(self) -> list[torch.Tensor]:
        return [self.flat.shard_view(self.grad_shard, u) for u in self.flat.units]

    def zero_grads(self) -> None:
        self.grad_shard.zero_()

    def grad_bytes(self) -> int:
        return storage_bytes(self.grad_shard)

    def transient_bytes(self) -> int:
        storages = {t.untyped_storage().data_ptr(): storage_bytes(t) for _, _, keep, _ in self._pending for t in keep}
        storages.update({s.untyped_storage().data_ptr(): storage_bytes(s) for s in self._staging if s is not None})
        storages.update({s.untyped_storage().data_ptr(): storage_bytes(s) for s in self._unit_staging.values()})
        return sum(storages.values())
