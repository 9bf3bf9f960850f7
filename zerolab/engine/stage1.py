"""Stage 1: ZeRO-1, optimizer-state partitioning (chapter 4).

Stage 0 plus one idea: the optimizer state (Adam's m and v, and the fp32
master weights in mixed precision) is split N ways. Rank r keeps and updates
only its shard, the contiguous slice ``[r*S, (r+1)*S)`` of every unit, so it
only needs the *reduced* gradient for that slice:

    backward (boundary micro-batch): reduce-scatter each gradient bucket, -> rank r gets its S
                                     unit by unit, straight from the flat buffer
    step:                            update the shard (fp32)
    during the step:                 all-gather the updated parameters    -> everyone has all Ψ
                                     (each gather bucket as soon as its units are updated,
                                      so it travels while the optimizer updates the rest)

No collective needs a whole-bucket copy: a unit is already laid out as its N shards in
rank order, so the transient memory is one unit's shard per collective in flight.

A reduce-scatter plus an all-gather moves the same bytes as one all-reduce
(2Ψ(N-1)/N), so ZeRO-1 saves 12Ψ(N-1)/N bytes of optimizer state for free.
Gradients are still accumulated whole (Ψ elements) until the boundary.

On gloo the engine issues other collectives with the same result
(``collectives.py``: a tuning, not the algorithm).
"""
from __future__ import annotations

import torch

from zerolab.engine import events as ev
from zerolab.engine.buckets import HandleGroup
from zerolab.engine.collectives import gather_unit, plan_collectives
from zerolab.engine.stage0 import Stage0Engine


class Stage1Engine(Stage0Engine):
    stage = 1
    shards_optimizer = True

    def __init__(self, model, cfg, communicator=None, **kw):
        self._gathers = {}       # gather bucket -> issued all-gather, for the step in progress
        self._to_update = None   # gather bucket -> units still to update in this step (None: none issued)
        super().__init__(model, cfg, communicator, **kw)
        self.grad_collective, self.param_collective = plan_collectives(cfg, self.communicator.backend,
                                                                       self.partitions_params)

    def own(self, buf: torch.Tensor, u) -> torch.Tensor:
        """The part of unit ``u`` this rank updates: its shard ``[r*S, (r+1)*S)``."""
        return self.flat.own_view(buf, u)

    def reduce_bucket(self, i: int) -> None:
        if self.grad_collective == "reduce_scatter":
            self.reduce_scatter_grads(i)
        else:  # gloo, or "reduce_scatter": false: stage 0's all-reduce; the own slice is in place
            self.all_reduce_grads(i)

    def reduce_scatter_grads(self, i: int) -> None:
        """Reduce-scatter bucket ``i`` unit by unit. A unit's gradient is contiguous in the flat
        buffer with rank r's shard at ``[r*S, (r+1)*S)``, the layout a reduce-scatter reads, so
        nothing is packed: rank r receives the sum of its shard (S elements) of each unit and
        copies it into its own slice. Transient memory: S per unit in flight, never Ψ."""
        b, g = self.buckets[i], self.grads
        if self.overlap_comm:   # every unit's collective in flight at once: one output each
            outs = [torch.empty(u.shard, dtype=g.dtype, device=g.device) for u in b]   # (S,) each
        else:                   # one after another: one output, reused
            outs = [torch.empty(max(u.shard for u in b), dtype=g.dtype, device=g.device)] * len(b)
        handles = []
        for u, out in zip(b, outs):
            h = self.communicator.reduce_scatter(out[: u.shard], self.flat.unit_view(g, u),
                                                 async_op=self.overlap_comm, tag=f"grad-bucket-{i}")
            if not self.overlap_comm:
                self.own(g, u).copy_(out[: u.shard])
            handles.append(h)

        def finish():
            if self.overlap_comm:
                torch._foreach_copy_([self.own(g, u) for u in b], [o[: u.shard] for u, o in zip(b, outs)])
        self.track(HandleGroup(handles), finish, tuple({id(o): o for o in outs}.values()), i)

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
        """All-gather gather bucket ``i`` unit by unit, straight into each unit's flat buffer:
        no N x S staging and no unpacking (gloo: N broadcasts, ``collectives.gather_unit``).
        Without ``overlap_comm`` the bucket is waited for here."""
        flat, b = self.flat, self.gather_buckets[i]
        self.event(ev.GATHER_ISSUED, i)
        inputs, handles = [], []
        for u in b:
            hs, inp = gather_unit(self.communicator, flat.unit_view(flat.flat, u), self.own(flat.flat, u), u.shard,
                                  self.world_size, self.param_collective, self.overlap_comm, f"param-bucket-{i}")
            handles += hs
            inputs.append(inp if self.overlap_comm else None)   # in flight: keep its input alive
        group = HandleGroup(handles)
        if not self.overlap_comm:
            group.wait()
        self._gathers[i] = (group, inputs)

    def all_gather_params(self) -> None:
        """Every rank sends its updated shard of each unit and receives everyone else's.
        Buckets the step already started (``unit_updated``) are only waited for."""
        if self._to_update is None:  # nothing issued yet (offload's optimizer steps in its own pieces)
            self._gathers = {}
        for i in range(len(self.gather_buckets)):
            if i not in self._gathers:
                self._issue_gather(i)
        for i, (h, _) in self._gathers.items():
            h.wait()
            self.event(ev.GATHER_DONE, i)
        self._gathers, self._to_update = {}, None
