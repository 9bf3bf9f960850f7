"""Stage 2: ZeRO-2, gradient partitioning (chapter 5).

Stage 1 plus one idea: a rank only ever *uses* the reduced gradient of its
own shard, so it need not keep the rest. During backward, each parameter's
fresh gradient is copied into its bucket's staging buffer and ``p.grad`` is
dropped; when the bucket is complete it is reduce-scattered straight into
this rank's gradient shard and the staging buffer is freed. Between backward
and step a rank holds gradients for Ψ/N elements only.

The price: gradients cannot wait for the accumulation boundary (nobody keeps
the full sum), so *every* micro-batch reduce-scatters; per step that is
g reduce-scatters plus one all-gather, (g+1)/2 times stage 1's bytes.
``contiguous_gradients``: the shard is one contiguous buffer in shard space,
so the reduce-scatter writes into it directly and the optimizer reads it as is.
"""
from __future__ import annotations

import torch

from .base import _nbytes
from .flat import rank_major
from .stage1 import Stage1Engine


class Stage2Engine(Stage1Engine):
    stage = 2
    reduce_every_micro_step = True

    def build_grads(self) -> None:
        """Only this rank's gradient shard is kept; full gradients exist briefly, per bucket."""
        # gradient shard, grad dtype: padded Ψ / N elements (contiguous_gradients)
        self.grad_shard = torch.zeros(self.flat.shard_numel, dtype=self.precision.grad_dtype, device=self.flat.device)
        self._staging = [None] * len(self.buckets)  # per bucket: its full gradients, alive only during backward
        self._slot = {}                              # id(p) -> (bucket, start in staging, numel)
        for i, b in enumerate(self.buckets):
            for u in b:
                for (_, p), off in zip(u.params, u.offsets):
                    self._slot[id(p)] = (i, u.offset - b[0].offset + off, p.numel())
        for p in self.flat.params():
            p.grad = None

    def _staging_buffer(self, i: int) -> torch.Tensor:
        if self._staging[i] is None:
            b = self.buckets[i]
            # staging, grad dtype: the bucket's padded elements (zeros: padding and unused params)
            self._staging[i] = torch.zeros(b[-1].offset + b[-1].padded - b[0].offset,
                                           dtype=self.grad_shard.dtype, device=self.grad_shard.device)
        return self._staging[i]

    def keep_grad(self, p) -> None:
        """Move the fresh gradient into its bucket's staging buffer and drop ``p.grad``."""
        i, start, n = self._slot[id(p)]
        self._staging_buffer(i)[start: start + n].copy_(p.grad.view(-1))
        p.grad = None

    def reduce_bucket(self, i: int) -> None:
        if self.config.zero.reduce_scatter:
            self.reduce_scatter_grads(i)
        else:
            self.all_reduce_grads(i)

    def all_reduce_grads(self, i: int) -> None:
        """``"reduce_scatter": false``: all-reduce the bucket, then keep only this rank's shards."""
        b = self.buckets[i]
        staging, self._staging[i] = self._staging_buffer(i), None
        h = self.communicator.all_reduce(staging, async_op=self.overlap_comm, tag=f"grad-bucket-{i}")

        def finish():
            for u in b:
                start = u.offset - b[0].offset + self.rank * u.shard
                self.flat.shard_view(self.grad_shard, u).add_(staging[start: start + u.shard])
        self.track(h, finish, (staging,), i)

    def reduce_scatter_grads(self, i: int) -> None:
        """Reduce-scatter bucket ``i`` into this rank's gradient shard; free the bucket."""
        b = self.buckets[i]
        staging, self._staging[i] = self._staging_buffer(i), None
        units = [staging[u.offset - b[0].offset: u.offset - b[0].offset + u.padded] for u in b]
        inp = rank_major(units, self.world_size)  # (N * ΣS,)
        dest = self.grad_shard[b[0].shard_offset: b[-1].shard_offset + b[-1].shard]  # (ΣS,) contiguous
        first = self.micro_steps % self.gas == 0  # first micro-batch of the step: the shard is zero
        out = dest if first else torch.empty_like(dest)
        h = self.communicator.reduce_scatter(out, inp, async_op=self.overlap_comm, tag=f"grad-bucket-{i}")
        self.track(h, None if first else (lambda: dest.add_(out)), (staging, inp) if first else (staging, inp, out), i)

    def owned_grads(self) -> list[torch.Tensor]:
        return [self.flat.shard_view(self.grad_shard, u) for u in self.flat.units]

    def zero_grads(self) -> None:
        self.grad_shard.zero_()

    def grad_bytes(self) -> int:
        return _nbytes(self.grad_shard)

    def transient_bytes(self) -> int:
        storages = {t.untyped_storage().data_ptr(): _nbytes(t) for _, _, keep, _ in self._pending for t in keep}
        storages.update({s.untyped_storage().data_ptr(): _nbytes(s) for s in self._staging if s is not None})
        return sum(storages.values())
