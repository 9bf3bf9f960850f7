"""Gradient and parameter buckets: which units travel in one collective, and in what layout (chapters 3-5).

A bucket is a run of consecutive whole units (``group_units``), in backward
order so the first bucket to fill is the last layer's. One collective serves a
whole bucket; to make one reduce-scatter hand each rank its shard of *every*
unit in the bucket, the units' buffers are laid out *rank-major*:

    units u1, u2 (N = 2)    full:        | u1: r0 r1 | u2: r0 r1 |
                            rank-major:  | r0 of u1, r0 of u2 | r1 of u1, r1 of u2 |

``rank_major`` packs and ``unpack_rank_major`` unpacks (chapter 4 shows the layout),
and ``rank_major_pieces`` says where each parameter's gradient lands in a rank-major
staging buffer, so a stage 2 that stages whole buckets (qgZ, offload) copies it there
directly during backward; plain stage 2 stages each unit on its own (its layout is
already rank-major). Stage 1 needs
no packing: it reduce-scatters a bucket unit by unit (``HandleGroup`` finishes the
bucket's collectives together), each straight from the flat gradient buffer. ``GradientBuckets`` is the engine's part that fires buckets as their
gradients arrive (``grad_arrived`` from the gradient hook, ``launch_ready`` in
bucket order, ``flush_buckets`` when backward ends) and keeps each collective
in flight until it is finished (``track``, ``finish_completed``).
"""
from __future__ import annotations

import torch

from zerolab.engine import events as ev
from zerolab.engine.flat import Unit
from zerolab.runtime.measure import storage_bytes


def rank_major(chunks: list[torch.Tensor], world_size: int) -> torch.Tensor:
    """Pack several units' full buffers so that one reduce-scatter gives each
    rank its shards of all of them: [r0 of u1, r0 of u2, r1 of u1, r1 of u2, ...]."""
    if len(chunks) == 1:
        return chunks[0]
    return torch.cat([c.view(world_size, -1) for c in chunks], dim=1).view(-1)


def unpack_rank_major(packed: torch.Tensor, chunks: list[torch.Tensor], world_size: int) -> None:
    """Inverse of ``rank_major``: copy a gathered (N * sum S) buffer into the units' buffers."""
    sizes = [c.numel() // world_size for c in chunks]
    for src, dst in zip(packed.view(world_size, -1).split(sizes, dim=1), chunks):
        dst.view(world_size, -1).copy_(src)


def group_units(units: list[Unit], limit: int) -> list[list[Unit]]:
    """Buckets: consecutive units in *backward* order (last unit first), each
    bucket holding up to ``limit`` elements; a unit larger than ``limit`` is a
    bucket of its own (a bucket never splits a unit)."""
    buckets, cur, size = [], [], 0
    for u in reversed(units):
        if cur and size + u.padded > limit:
            buckets.append(cur)
            cur, size = [], 0
        cur.append(u)
        size += u.padded
    if cur:
        buckets.append(cur)
    return [list(reversed(b)) for b in buckets]  # each bucket in layout order: contiguous


def rank_major_pieces(off: int, numel: int, shard: int, row: int, col: int) -> list[tuple[int, int, int]]:
    """Where a parameter at unit offset ``off`` lands in a rank-major bucket: pieces
    (start, end) of the flattened parameter -> start in the staging buffer."""
    pieces, a = [], 0
    while a < numel:
        e = off + a                      # element of the unit
        r, c = divmod(e, shard)          # its rank row and column within the unit's shard
        b = min(numel, a + shard - c)    # up to the end of that shard
        d = r * row + col + c
        if pieces and pieces[-1][2] + pieces[-1][1] - pieces[-1][0] == d:
            pieces[-1] = (pieces[-1][0], b, pieces[-1][2])  # contiguous in the staging buffer: merge
        else:
            pieces.append((a, b, d))
        a = b
    return pieces


class HandleGroup:
    """The collectives issued for one bucket (one per unit), finished together: done when all are."""

    def __init__(self, handles):
        self.handles = list(handles)

    @property
    def done(self) -> bool:
        return all(h.done for h in self.handles)

    def is_completed(self) -> bool:
        return all(h.is_completed() for h in self.handles)

    def wait(self) -> None:
        for h in self.handles:
            h.wait()


class GradientBuckets:
    """The bucket bookkeeping every engine shares (``Engine`` derives from it).

    A stage supplies ``reduce_bucket(i)`` (the collective for bucket ``i``) and may
    pass a ``finish`` callback to ``track`` (what to do once the collective is done)."""
    fire_on_local_grads = True   # a bucket fires when this rank has its gradients (stage 3: reduce_order.py)

    def build_buckets(self, reduce_bucket_size: int, allgather_bucket_size: int) -> None:
        units = self.flat.units
        self.buckets = group_units(units, reduce_bucket_size)             # gradient buckets, backward order
        self.gather_buckets = group_units(units, allgather_bucket_size)   # stage 1-2's parameter all-gathers
        self._bucket_of = {id(p): i for i, b in enumerate(self.buckets) for u in b for _, p in u.params}
        self._bucket_params = [sum(len(u.params) for u in b) for b in self.buckets]
        self._pending = []   # [(handle, finish or None, tensors kept alive until finished, bucket)]

    def reset_buckets(self) -> None:
        """Before a backward: every bucket waits for all its parameters' gradients."""
        self._left = list(self._bucket_params)
        self._ready = [False] * len(self.buckets)
        self._next_bucket, self._pending, self._announced = 0, [], set()

    def announce(self, i: int) -> None:
        """Bucket ``i``'s first collective is issued (the trace's REDUCE_ISSUED, once per backward)."""
        if i not in self._announced:
            self._announced.add(i)
            self.event(ev.REDUCE_ISSUED, i)

    def grad_arrived(self, p) -> None:
        """``p``'s gradient is kept: its bucket may now be complete."""
        i = self._bucket_of[id(p)]
        self._left[i] -= 1
        if self._left[i] == 0 and self.fire_on_local_grads:
            self._ready[i] = True
            self.launch_ready()

    def launch_ready(self) -> None:
        """Issue ready buckets in bucket order (every rank must call collectives in the same order)."""
        while self._next_bucket < len(self.buckets) and self._ready[self._next_bucket]:
            self.announce(self._next_bucket)
            self.reduce_bucket(self._next_bucket)
            self._next_bucket += 1

    def flush_buckets(self) -> None:
        """After autograd: buckets holding unused parameters go as they are (their gradients
        are zero), then wait for everything in flight."""
        self._ready = [True] * len(self.buckets)
        self.launch_ready()
        self.event(ev.BACKWARD_END)
        while self._pending:
            self.finish_oldest()

    def finish_oldest(self) -> None:
        """Wait for the oldest collective in flight and finish it (its buffers are then freed)."""
        handle, finish, _, index = self._pending.pop(0)
        handle.wait()
        self._finished(finish, index)

    def _finished(self, finish, index) -> None:
        if finish is not None:
            finish()
        if index is not None:   # None: the finish reports the bucket's end itself (stage 2, unit by unit)
            self.event(ev.REDUCE_DONE, index)

    def track(self, handle, finish=None, keep=(), index: int | None = -1) -> None:
        """Finish a collective now if it is done (overlap off), else when backward ends."""
        if handle.done:
            self._finished(finish, index)
        else:
            self._pending.append((handle, finish, keep, index))

    def finish_completed(self) -> None:
        """Finish the in-flight collectives that have completed, so their buffers (stage 2's
        staging, stage 1's packing) are freed during backward rather than at its end."""
        if not self._pending:
            return
        still = []
        for entry in self._pending:
            handle, finish, _, index = entry
            if handle.is_completed():
                handle.wait()  # returns at once; books the ledger record
                self._finished(finish, index)
            else:
                still.append(entry)
        self._pending = still

    def transient_bytes(self) -> int:
        """Bytes in staging buffers and in-flight temporaries right now."""
        storages = {t.untyped_storage().data_ptr(): storage_bytes(t) for _, _, keep, _ in self._pending for t in keep}
        return sum(storages.values())


class UnitStaging:
    """Stage 2's staging buffers during backward: one per group of units reduced by one collective (a
    unit alone, or on gloo a small unit and the next, ``collectives.reduce_groups``), created with the
    group's first gradient and handed to the collective when the group is reduced."""

    def __init__(self, units: list[Unit], groups: list[list[int]], dtype, device):
        self.units, self.groups, self.dtype, self.device = units, groups, dtype, device
        self.group_of = {j: g for g, js in enumerate(groups) for j in js}
        self.offset = {j: sum(units[k].padded for k in js[:js.index(j)]) for js in groups for j in js}
        self.buffers = {}   # group -> its units' full gradients, alive until its collective is issued

    def view(self, j: int) -> torch.Tensor:
        """Unit ``j``'s slice of its group's staging buffer (created with the group's first gradient)."""
        g, units = self.group_of[j], self.units
        if g not in self.buffers:
            # staging, grad dtype: the group's padded elements; every gradient is copied in whole, so only
            # the padding is zeroed here (and, by stage 2, the parameters that got no gradient)
            buf = torch.empty(sum(units[k].padded for k in self.groups[g]), dtype=self.dtype, device=self.device)
            for k in self.groups[g]:
                buf[self.offset[k] + units[k].numel: self.offset[k] + units[k].padded].zero_()
            self.buffers[g] = buf
        return self.buffers[g][self.offset[j]: self.offset[j] + units[j].padded]

    def pop(self, g: int) -> torch.Tensor:
        """Group ``g``'s buffer, no longer held here (from now on only its collective holds it)."""
        return self.buffers.pop(g)
