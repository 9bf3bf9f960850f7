"""Stage 1: ZeRO-1, optimizer-state partitioning (chapter 4).

Stage 0 plus one idea: the optimizer state (Adam's m and v, and the fp32
master weights in mixed precision) is split N ways. Rank r keeps and updates
only its shard, the contiguous slice ``[r*S, (r+1)*S)`` of every unit, so it
only needs the *reduced* gradient for that slice:

    backward (boundary micro-batch): reduce-scatter each gradient bucket  -> rank r gets its S
    step:                            update the shard (fp32)
    during the step:                 all-gather the updated parameters    -> everyone has all Ψ
                                     (each gather bucket as soon as its units are updated,
                                      so it travels while the optimizer updates the rest)

A reduce-scatter plus an all-gather moves the same bytes as one all-reduce
(2Ψ(N-1)/N), so ZeRO-1 saves 12Ψ(N-1)/N bytes of optimizer state for free.
Gradients are still accumulated whole (Ψ elements) until the boundary.
"""
from __future__ import annotations

import torch

from zerolab.engine import events as ev
from zerolab.engine.buckets import rank_major, unpack_rank_major
from zerolab.engine.stage0 import Stage0Engine


class Stage1Engine(Stage0Engine):
    stage = 1
    shards_optimizer = True

    def __init__(self, model, cfg, communicator=None):
        self._gathers = {}       # gather bucket -> issued all-gather, for the step in progress
        self._to_update = None   # gather bucket -> units still to update in this step (None: none issued)
        super().__init__(model, cfg, communicator)

    def own(self, buf: torch.Tensor, u) -> torch.Tensor:
        """The part of unit ``u`` this rank updates: its shard ``[r*S, (r+1)*S)``."""
        return self.flat.own_view(buf, u)

    def reduce_bucket(self, i: int) -> None:
        if self.config.zero.reduce_scatter:
            self.reduce_scatter_grads(i)
        else:  # DeepSpeed's "reduce_scatter": false: all-reduce (2x the bytes); the own slice is in place
            self.all_reduce_grads(i)

    def reduce_scatter_grads(self, i: int) -> None:
        """Reduce-scatter bucket ``i``: rank r receives the sum of every rank's r-th shard
        of each unit, written into its own slice of the flat gradients."""
        b = self.buckets[i]
        inp = rank_major([self.flat.unit_view(self.grads, u) for u in b], self.world_size)  # (N * ΣS,)
        out = torch.empty(sum(u.shard for u in b), dtype=self.grads.dtype, device=self.grads.device)  # (ΣS,)
        h = self.communicator.reduce_scatter(out, inp, async_op=self.overlap_comm, tag=f"grad-bucket-{i}")

        def finish():
            torch._foreach_copy_([self.own(self.grads, u) for u in b], list(out.split([u.shard for u in b])))
        self.track(h, finish, (inp, out) if len(b) > 1 else (out,), i)

    gathers_params = True  # stage 3 keeps only its shard: no all-gather after the step

    def unit_updated(self, i: int) -> None:
        """As soon as the last unit of a gather bucket is updated, start that bucket's
        all-gather, so it travels while the optimizer updates the remaining units."""
        super().unit_updated(i)
        if not self.gathers_params:
            return
        if self._to_update is None:
            self._to_update = [len(b) for b in self.gather_buckets]
            self._gathers = {}
        u = self.flat.units[i]
        j = next(k for k, b in enumerate(self.gather_buckets) if any(v is u for v in b))
        self._to_update[j] -= 1
        if self._to_update[j] == 0:
            self._issue_gather(j)

    def after_update(self) -> None:
        self.all_gather_params()

    def _issue_gather(self, i: int) -> None:
        flat, b = self.flat, self.gather_buckets[i]
        fulls = [flat.unit_view(flat.flat, u) for u in b]
        inp = torch.cat([self.own(flat.flat, u) for u in b])  # (ΣS,) this rank's shards, a copy
        out = fulls[0] if len(b) == 1 else torch.empty(self.world_size * inp.numel(), dtype=inp.dtype, device=inp.device)
        self.event(ev.GATHER_ISSUED, i)
        h = self.communicator.all_gather(out, inp, async_op=self.overlap_comm, tag=f"param-bucket-{i}")
        self._gathers[i] = (h, b, fulls, out, inp)

    def all_gather_params(self) -> None:
        """Every rank sends its updated shard of each unit and receives everyone else's.
        Buckets the step already started (``unit_updated``) are only waited for."""
        if self._to_update is None:  # nothing issued yet (offload's optimizer steps in its own pieces)
            self._gathers = {}
        for i in range(len(self.gather_buckets)):
            if i not in self._gathers:
                self._issue_gather(i)
        for i, (h, b, fulls, out, inp) in self._gathers.items():
            h.wait()
            if len(b) > 1:
                unpack_rank_major(out, fulls, self.world_size)
            self.event(ev.GATHER_DONE, i)
        self._gathers, self._to_update = {}, None
