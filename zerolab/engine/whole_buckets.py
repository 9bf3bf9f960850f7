"""A bucket's gradients staged whole, rank-major, for one collective per bucket (chapters 7 and 9).

Plain stage 2 reduces each unit as soon as its gradients are in, from the
unit's own staging buffer. Two engines need a whole bucket in one call
instead: ZeRO++'s qgZ (one quantized all-to-all per bucket) and the offload
engines (a bucket's reduced shard leaves for the host in one piece). For them
a bucket is staged *rank-major* — row r holds rank r's shard of every unit of
the bucket (``buckets.rank_major_pieces`` says where each parameter's gradient
lands) — so one reduce-scatter hands each rank its row:

    bucket of u1, u2 (N = 2):   | r0 of u1, r0 of u2 | r1 of u1, r1 of u2 |

``WholeBucketStaging`` goes in front of a stage 2 or 3 engine class; while its
``stages_buckets_whole`` is true (ZeRO++: only with qgZ) it replaces stage 2's
unit staging. The price is memory: a whole bucket staged at once.
"""
from __future__ import annotations

import torch

from zerolab.engine.buckets import GradientBuckets, rank_major_pieces
from zerolab.runtime.measure import storage_bytes
from zerolab.engine.accumulate import first_backward_of_step


class WholeBucketStaging:
    """Stage 2's gradient staging, a bucket at a time, rank-major."""
    stages_buckets_whole = True

    def build_grads(self) -> None:
        super().build_grads()
        self._staging = [None] * len(self.buckets)   # per bucket, rank-major, alive until its collective
        self._pieces = {}                            # id(p) -> (bucket, [(src start, src end, dst start)])
        for i, b in enumerate(self.buckets if self.stages_buckets_whole else []):
            row, col = sum(u.shard for u in b), 0    # ΣS: one rank's share of the bucket
            for u in b:
                for (_, p), off in zip(u.params, u.offsets):
                    self._pieces[id(p)] = (i, rank_major_pieces(off, p.numel(), u.shard, row, col))
                col += u.shard

    def stage_grad(self, p, g: torch.Tensor) -> None:
        """Copy a fresh gradient into its bucket's rank-major staging buffer."""
        if not self.stages_buckets_whole:
            return super().stage_grad(p, g)
        i, pieces = self._pieces[id(p)]
        staging = self._staging_buffer(i)
        for a, b, d in pieces:
            staging[d: d + b - a].copy_(g[a:b])

    def grad_arrived(self, p) -> None:
        """Buckets fire when complete, as at stages 0-1 (no unit-by-unit reduction)."""
        if not self.stages_buckets_whole:
            return super().grad_arrived(p)
        GradientBuckets.grad_arrived(self, p)

    def reduce_bucket(self, i: int) -> None:
        if not self.stages_buckets_whole:
            return super().reduce_bucket(i)
        if self.grad_collective == "reduce_scatter":
            self.reduce_scatter_grads(i)
        else:
            self.all_reduce_grads(i)

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
        first = first_backward_of_step(self)
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

    def transient_bytes(self) -> int:
        staged = {s.untyped_storage().data_ptr(): storage_bytes(s) for s in self._staging if s is not None}
        return super().transient_bytes() + sum(staged.values())
