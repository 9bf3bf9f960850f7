"""Stage 2: ZeRO-2, gradient partitioning (chapter 5).

Stage 1 plus one idea: a rank only ever *uses* the reduced gradient of its
own shard, so it need not keep the rest. During backward, each parameter's
fresh gradient is copied into its bucket's staging buffer and ``p.grad`` is
dropped; when the bucket is complete it is reduce-scattered straight into
this rank's gradient shard and the staging buffer is freed. Between backward
and step a rank holds gradients for Ψ/N elements only.

The staging buffer is laid out *rank-major* — row r holds rank r's shard of
every unit in the bucket — so the reduce-scatter needs no packing copy:

    staging (N x ΣS):  row 0 = [u1 shard 0 | u2 shard 0]   -> rank 0
                       row 1 = [u1 shard 1 | u2 shard 1]   -> rank 1

The price: gradients cannot wait for the accumulation boundary (nobody keeps
the full sum), so *every* micro-batch reduce-scatters; per step that is
g reduce-scatters plus one all-gather, (g+1)/2 times stage 1's bytes.
``contiguous_gradients``: the shard is one contiguous buffer in shard space,
so the reduce-scatter writes into it directly and the optimizer reads it as is.
"""
from __future__ import annotations

import torch

from zerolab.runtime.measure import storage_bytes
from zerolab.engine.buckets import rank_major_pieces
from zerolab.engine.stage1 import Stage1Engine


class Stage2Engine(Stage1Engine):
    stage = 2
    reduce_every_micro_step = True

    def build_grads(self) -> None:
        """Only this rank's gradient shard is kept; full gradients exist briefly, per bucket."""
        # gradient shard, grad dtype: padded Ψ / N elements (contiguous_gradients)
        self.grad_shard = torch.zeros(self.flat.shard_numel, dtype=self.precision.grad_dtype, device=self.flat.device)
        self._staging = [None] * len(self.buckets)  # per bucket: its full gradients, alive only during backward
        self._pieces = {}                            # id(p) -> (bucket, [(src start, src end, dst start)])
        for i, b in enumerate(self.buckets):
            row = sum(u.shard for u in b)            # ΣS: one rank's share of the bucket
            col = 0
            for u in b:
                for (_, p), off in zip(u.params, u.offsets):
                    self._pieces[id(p)] = (i, rank_major_pieces(off, p.numel(), u.shard, row, col))
                col += u.shard
        for p in self.flat.params():
            p.grad = None

    def _staging_buffer(self, i: int) -> torch.Tensor:
        if self._staging[i] is None:
            numel = self.world_size * sum(u.shard for u in self.buckets[i])
            # staging, grad dtype: N x ΣS rank-major (zeros: padding and unused params)
            self._staging[i] = torch.zeros(numel, dtype=self.grad_shard.dtype, device=self.grad_shard.device)
        return self._staging[i]

    def keep_grad(self, p) -> None:
        """Move the fresh gradient into its bucket's staging buffer and drop ``p.grad``."""
        i, pieces = self._pieces[id(p)]
        staging, g = self._staging_buffer(i), p.grad.view(-1)
        for a, b, d in pieces:
            staging[d: d + b - a].copy_(g[a:b])
        p.grad = None

    def _bucket_shard(self, i: int) -> torch.Tensor:
        """This rank's gradient shard of bucket ``i``: contiguous in shard space, (ΣS,)."""
        b = self.buckets[i]
        return self.grad_shard[b[0].shard_offset: b[-1].shard_offset + b[-1].shard]

    def reduce_scatter_grads(self, i: int) -> None:
        """Reduce-scatter bucket ``i`` into this rank's gradient shard; free the bucket."""
        staging, self._staging[i] = self._staging_buffer(i), None
        dest = self._bucket_shard(i)
        first = self.micro_steps % self.gas == 0  # first micro-batch of the step: the shard is zero
        out = dest if first else torch.empty_like(dest)
        h = self.communicator.reduce_scatter(out, staging, async_op=self.overlap_comm, tag=f"grad-bucket-{i}")
        self.track(h, None if first else (lambda: dest.add_(out)), (staging,) if first else (staging, out), i)

    def all_reduce_grads(self, i: int) -> None:
        """``"reduce_scatter": false``: all-reduce the bucket (2x the bytes), keep this rank's row."""
        staging, self._staging[i] = self._staging_buffer(i), None
        dest = self._bucket_shard(i)
        h = self.communicator.all_reduce(staging, async_op=self.overlap_comm, tag=f"grad-bucket-{i}")
        mine = staging[self.rank * dest.numel(): (self.rank + 1) * dest.numel()]
        self.track(h, lambda: dest.add_(mine), (staging,), i)

    def owned_grads(self) -> list[torch.Tensor]:
        return [self.flat.shard_view(self.grad_shard, u) for u in self.flat.units]

    def zero_grads(self) -> None:
        self.grad_shard.zero_()

    def grad_bytes(self) -> int:
        return storage_bytes(self.grad_shard)

    def transient_bytes(self) -> int:
        storages = {t.untyped_storage().data_ptr(): storage_bytes(t) for _, _, keep, _ in self._pending for t in keep}
        storages.update({s.untyped_storage().data_ptr(): storage_bytes(s) for s in self._staging if s is not None})
        return sum(storages.values())
