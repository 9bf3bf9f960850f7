"""What an engine changes when its optimizer is offloaded: gradients leave the device during backward (chapter 7).

Gradients leave the device during backward, as in ZeRO-Offload and DeepSpeed:
each bucket's reduce-scatter lands in a device temporary that is copied at
once into the rank's fp32 gradient shard in host RAM (``host_grads``, padded
Ψ/N elements; accumulated over micro-batches in the config's gradient dtype,
so the numbers are those of the on-device engines). The step reads that shard
in place (``OffloadOptimizer``, ``optimizer.py``). So the device keeps the
parameters only (and, at stage 1, the whole gradient buffer it accumulates
into): ``memory()`` reports ``optimizer`` = 0, ``grads`` = 0 at stages 2-3, the
fp32 gradient shard under ``host`` and the state under ``host`` or ``nvme``. On
a CPU-only machine "device" and "host" are the same RAM; the accounting still
says which tier each byte belongs to, and the NVMe tier really leaves RAM.

``OffloadMixin`` goes in front of a stage class; the named classes built from
it are in ``engines.py`` (stage 3's parameter offload is in ``params.py``).
"""
from __future__ import annotations

import errno

import torch

from zerolab.engine.buckets import rank_major
from zerolab.engine.offload.nvme import NVMeError
from zerolab.engine.offload.optimizer import OffloadOptimizer
from zerolab.runtime.measure import storage_bytes
from zerolab.engine.accumulate import first_backward_of_step


class OffloadMixin:
    """Put in front of a stage engine class: the optimizer becomes an ``OffloadOptimizer``. At stages 2-3
    a bucket's reduced shard leaves for the host in one piece: the class also takes ``WholeBucketStaging``."""

    def build_optimizer(self) -> None:
        z = self.config.zero
        self.master = None   # no device master: the engine's own master->params copy is skipped
        self.targets = [self.own(self.flat.flat, u) for u in self.flat.units]
        self.optimizer = OffloadOptimizer(self.config.optimizer.type, self.config.optimizer.params, self.targets,
                                          self.precision.has_master, z.offload_optimizer, self.rank,
                                          z.sub_group_size, groups=self.group_hypers,
                                          segments=self.group_segments(),
                                          start=[self.flat.exact.pop(i, t) for i, t in enumerate(self.targets)])

    # ---------------------------------------------------------------- gradients go to the host in backward
    def build_grads(self) -> None:
        super().build_grads()
        pin = torch.cuda.is_available() and self.flat.device.type == "cuda"
        # gradient shard in host RAM, fp32: padded Ψ / N elements (the CPU optimizer reads it in place)
        self.host_grads = torch.zeros(self.flat.shard_numel, dtype=torch.float32, pin_memory=pin)
        if self.stage >= 2:   # no device gradient shard: each bucket's reduced shard goes straight to the host
            self.grad_shard = self.grad_shard.new_empty(0)

    def _to_host(self, bucket, shards, first: bool) -> None:
        """A bucket's reduced gradient shards (device, grad dtype; one per unit) -> ``host_grads``.
        Later micro-batches add, rounded to the grad dtype as the on-device shard would be."""
        dest = [self.flat.shard_view(self.host_grads, u) for u in bucket]
        if first:
            torch._foreach_copy_(dest, shards)
            return
        torch._foreach_add_(dest, [t.to(self.host_grads.device, torch.float32) for t in shards])
        if self.precision.grad_dtype != torch.float32:
            torch._foreach_copy_(dest, [d.to(self.precision.grad_dtype) for d in dest])

    def _first_micro_step(self) -> bool:
        return self.stage == 1 or first_backward_of_step(self)

    def reduce_scatter_grads(self, i: int) -> None:
        """Reduce-scatter bucket ``i`` into a device temporary; its shard then leaves for the host."""
        b, first = self.buckets[i], self._first_micro_step()
        if self.stage >= 2:      # the bucket's rank-major staging buffer (whole_buckets.py), freed with the collective
            inp, self._staging[i] = self._staging_buffer(i), None
        else:                    # stage 1: the accumulated full gradients, packed rank-major
            inp = rank_major([self.flat.unit_view(self.grads, u) for u in b], self.world_size)
        out = torch.empty(sum(u.shard for u in b), dtype=inp.dtype, device=inp.device)  # (ΣS,) grad dtype
        h = self.communicator.reduce_scatter(out, inp, async_op=self.overlap_comm, tag=f"grad-bucket-{i}")
        keep = (inp, out) if self.stage >= 2 or len(b) > 1 else (out,)
        self.track(h, lambda: self._to_host(b, list(out.split([u.shard for u in b])), first), keep, i)

    def all_reduce_grads(self, i: int) -> None:
        """``"reduce_scatter": false``: all-reduce the bucket, then this rank's shard leaves for the host."""
        b, first = self.buckets[i], self._first_micro_step()
        if self.stage >= 2:
            buf, self._staging[i] = self._staging_buffer(i), None
            row = sum(u.shard for u in b)
            mine = lambda: list(buf[self.rank * row: (self.rank + 1) * row].split([u.shard for u in b]))  # noqa: E731
        else:
            buf = self.grads[b[0].offset: b[-1].offset + b[-1].padded]
            mine = lambda: [self.own(self.grads, u) for u in b]  # noqa: E731
        h = self.communicator.all_reduce(buf, async_op=self.overlap_comm, tag=f"grad-bucket-{i}")
        self.track(h, lambda: self._to_host(b, mine(), first), (buf,) if self.stage >= 2 else (), i)

    def owned_grads(self) -> list[torch.Tensor]:
        return [self.flat.shard_view(self.host_grads, u) for u in self.flat.units]

    def step(self) -> None:
        super().step()
        error = self.optimizer.take_error()
        if error is not None:
            raise error

    def after_update(self) -> None:
        """NVMe: before the parameters travel, the ranks agree whether any read failed (all-reduce
        MAX of rank + 1), so every rank raises instead of one raising and the others waiting."""
        failed = self.optimizer.read_error
        if self.optimizer.store is not None and self.world_size > 1:
            flag = torch.tensor([float(self.rank + 1) if failed is not None else 0.0], device=self.flat.device)
            self.communicator.all_reduce(flag, op="max", tag="nvme-read-check")
            bad = int(flag.item()) - 1
        else:
            bad = self.rank if failed is not None else -1
        if bad >= 0:
            self.optimizer.read_error = None
            raise failed or NVMeError(errno.EIO, f"offload_optimizer: rank {bad} failed to read its optimizer "
                                                 f"state from NVMe at step {self.optimizer.step_count}; every rank "
                                                 f"stops here: restore from a checkpoint")
        super().after_update()

    def memory(self):
        r = super().memory()
        r.host += self.optimizer.host_bytes() + storage_bytes(self.host_grads)
        r.nvme += self.optimizer.nvme_bytes()
        r.buffers += self.optimizer.staging_bytes()
        return r

    def full_state_dict(self, rank0_only: bool = False) -> dict | None:
        saved = self.targets
        self.targets = self.optimizer.fp32_shards()
        try:
            return super().full_state_dict(rank0_only)
        finally:
            self.targets = saved

    def _repartition(self, units, src: int) -> None:
        """Stage 3's modifier_rank edits: also into the offloaded fp32 master."""
        before = [self.targets[i].clone() for i in units] if self.precision.has_master else []
        super()._repartition(units, src)
        for i, old in zip(units, before):
            self.optimizer.edit_master(i, self.targets[i] != old, self.targets[i])

    def close(self) -> None:
        super().close()
        self.optimizer.close()
