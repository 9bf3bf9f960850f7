"""ZeRO-Offload: the optimizer's state and step on the CPU, its state in RAM or on NVMe (chapter 7).

With ``offload_optimizer.device`` "cpu" or "nvme" (stages 1-3) the rank's
shard of the optimizer state — fp32 master weights (mixed precision) and
Adam's m and v, 12 bytes per element, or m and v alone (8) in fp32 — lives
off the accelerator. Per unit, at the step:

    gradient shard  already on the host, fp32 (it left the device during backward)
    state chunk     RAM, or NVMe -> staging buffer (read ahead, ``buffer_count``)
    CPU step        one fused pass (torch's vectorised CPU Adam/AdamW kernel)
    parameters      host -> device  (the updated 16-bit, or fp32, shard)
    state chunk     staging -> NVMe (written behind, while the next unit steps)

Gradients leave the device during backward, as in ZeRO-Offload and DeepSpeed:
each bucket's reduce-scatter lands in a device temporary that is copied at
once into the rank's fp32 gradient shard in host RAM (``host_grads``, padded
Ψ/N elements; accumulated over micro-batches in the config's gradient dtype,
so the numbers are those of the on-device engines). The step reads that shard
in place. So the device keeps the parameters only (and, at stage 1, the whole
gradient buffer it accumulates into): ``memory()`` reports ``optimizer`` = 0,
``grads`` = 0 at stages 2-3, the fp32 gradient shard under ``host`` and the
state under ``host`` or ``nvme``. On a CPU-only machine "device" and "host"
are the same RAM; the accounting still says which tier each byte belongs to,
and the NVMe tier really leaves RAM.

``OffloadMixin`` goes in front of a stage class; the named classes built from
it are in ``offloaded.py`` (stage 3's parameter offload is in ``param_offload``).
"""
from __future__ import annotations

import errno

import torch

from zerolab.runtime.measure import storage_bytes
from zerolab.engine.buckets import rank_major
from zerolab.engine.nvme import ChunkStore, NVMeError, check_nvme_path
from zerolab.engine.optim import FUSED_ADAM, ShardedOptimizer


class OffloadOptimizer:
    """The optimizer of a rank's shard, held on the host ("cpu") or in a swap file ("nvme").

    ``targets``: the device tensors the step writes (the rank's parameter shard per unit,
    compute dtype). Each unit's shard is cut into pieces of at most ``sub_group_size``
    elements; the state of a piece of P elements is one fp32 chunk ``[master | m | v]`` (P
    each; no master in fp32, where the device parameter itself is updated: read back to the
    host and written again on an accelerator, in place on a CPU device).
    """

    def __init__(self, kind, params, targets, has_master, off, rank=0, sub_group_size=10**9,
                 key="zero_optimization.offload_optimizer", groups=None, segments=None):
        # validated hyper-parameters (per parameter group), torch.optim's maths
        self.math = ShardedOptimizer(kind, params, [], groups, segments)
        self.kind, self.targets, self.has_master, self.device = kind, targets, has_master, off.device
        self.lr, self.step_count = self.math.lr, 0
        self.read_error = None   # a failed NVMe read of this step, raised once every rank knows
        moments = 2 if kind in ("adam", "adamw") else int(any(h.momentum for h in self.math.hypers))  # m, v | momentum | none
        self.slots = int(has_master) + moments                # fp32 arrays per element
        # pieces: (unit, start, end) tiles of each unit's shard, at most sub_group_size elements
        step_ = max(1, int(sub_group_size))
        self.pieces = [(i, a, min(a + step_, t.numel())) for i, t in enumerate(targets)
                       for a in range(0, t.numel(), step_)]
        self.sizes = [b - a for _, a, b in self.pieces]
        dev = targets[0].device if targets else torch.device("cpu")
        self.pin = bool(off.pin_memory) and torch.cuda.is_available() and dev.type == "cuda"
        self.async_copy = dev.type == "cuda"
        # a CPU "device" is host memory already: fp32 params are used in place
        self.params_in_place = dev.type == "cpu" and not has_master
        big = max(self.sizes, default=0)
        # fp32 only: the parameter piece comes back to the host for the step (2 x largest piece)
        self.param_stage = [torch.empty(0 if has_master or self.params_in_place else big, dtype=torch.float32,
                                        pin_memory=self.pin) for _ in range(2)]
        chunks = [self.slots * n for n in self.sizes]
        if self.device == "nvme":
            path = check_nvme_path(off.nvme_path, key)
            self.store = ChunkStore(path, chunks, torch.float32, off.buffer_count, f"optimizer-r{rank}", key,
                                    self.pin)
            self.host = None
        else:
            self.store = None
            # host state, fp32: slots x padded Ψ/N, one chunk per unit
            self.host = torch.zeros(sum(chunks), dtype=torch.float32, pin_memory=self.pin)
            self.chunks, off_ = [], 0
            for n in chunks:
                self.chunks.append(self.host[off_: off_ + n])
                off_ += n
        for k, (i, a, b) in enumerate(self.pieces):   # initial state: master = the parameters, moments = 0
            chunk = torch.zeros(chunks[k], dtype=torch.float32) if self.store else self.chunks[k]
            if has_master:
                chunk[: b - a].copy_(targets[i][a:b])
            if self.store:
                self.store.write_now(k, chunk)
        self._error = None

    # ---------------------------------------------------------------- bytes by tier
    def nbytes(self) -> int:
        """Optimizer bytes on the device: none."""
        return 0

    def host_bytes(self) -> int:
        return storage_bytes(self.host)

    def nvme_bytes(self) -> int:
        return self.store.nbytes() if self.store else 0

    def staging_bytes(self) -> int:
        """Transfer and I/O staging buffers (host RAM)."""
        return sum(storage_bytes(t) for t in self.param_stage) + \
            (self.store.staging_bytes() if self.store else 0)

    # ---------------------------------------------------------------- the step
    def _fetch(self, k: int, grads, slot: int):
        """Piece k's gradient (host fp32, scaled in place below); in fp32 start copying its parameters."""
        i, a, b = self.pieces[k]
        g = grads[i][a:b]
        p = None
        if self.params_in_place:
            p = self.targets[i][a:b]
        elif not self.has_master:
            p = self.param_stage[slot][: b - a]
            p.copy_(self.targets[i][a:b], non_blocking=self.async_copy)
        ev = None
        if self.async_copy:
            ev = torch.cuda.Event()
            ev.record()
        return g, p, ev

    def _chunks(self, order):
        if self.store is not None:
            yield from self.store.stream(order)
        else:
            for i in order:
                yield i, self.chunks[i]

    @torch.no_grad()
    def step(self, grads, lr: float, scale: float = 1.0) -> None:
        """One update with ``scale * grads``; the updated parameters are written to ``targets``."""
        self.step_count += 1
        self.math.step_count = self.step_count
        order = list(range(len(self.pieces)))
        pending = self._fetch(0, grads, 0) if order else None
        try:
            for k, chunk in self._chunks(order):
                g, p, ev = pending
                if k + 1 < len(order):   # double buffering: the next piece's transfer overlaps this step
                    pending = self._fetch(k + 1, grads, (k + 1) % 2)
                if ev is not None:
                    ev.synchronize()
                if scale != 1.0:
                    g.mul_(scale)
                i, a, b = self.pieces[k]
                views = list(chunk.view(self.slots, b - a))   # [master,] m, v: (piece,) each
                if self.has_master:
                    p, views = views[0], views[1:]
                for s, e, h, lr_k in self.math.runs(i, a, b, lr):   # one run per parameter group
                    self._update(p[s:e], g[s:e], [v[s:e] for v in views], lr_k, h)
                if not self.params_in_place:
                    self.targets[i][a:b].copy_(p)     # host -> device: the updated piece (cast to compute dtype)
        except OSError as e:   # raised after the ranks agree (OffloadMixin.after_update): none is left waiting
            self.read_error = NVMeError(e.errno, f"offload_optimizer: reading the optimizer state from NVMe failed "
                                                 f"at step {self.step_count} ({e.strerror}); the step is "
                                                 f"incomplete: restore from a checkpoint")
            self.read_error.__cause__ = e
            return
        if self.store is not None and self.store.errors:
            i, e = self.store.errors[0]
            held = sum(storage_bytes(t) for t in self.store.dirty.values())
            self._error = NVMeError(e.errno, f"offload_optimizer: writing the optimizer state to "
                                             f"{self.store.directory!r} failed ({e.strerror}) for "
                                             f"{len(self.store.errors)} of {len(order)} units. The step completed: "
                                             f"their new state ({held / 1e6:.1f} MB) is held in RAM and written at "
                                             f"the next step; training state is intact. Free disk space")

    def _update(self, p, g, moments, lr, h):
        m = self.math
        fused = FUSED_ADAM.get(self.kind)
        if fused is not None:
            step = torch.tensor(float(self.step_count))
            fused([p], [g], [moments[0]], [moments[1]], [], [step], lr=lr, beta1=h.betas[0], beta2=h.betas[1],
                  weight_decay=h.weight_decay, eps=h.eps, amsgrad=False, maximize=False)
        elif self.kind == "sgd":
            m._sgd(p, g, moments[0] if moments else None, lr, h)
        else:
            m._adam(p, g, moments[0], moments[1], lr, h)

    def edit_master(self, i: int, changed: torch.Tensor, new: torch.Tensor) -> None:
        """Parameters edited outside training (``gathered_parameters(modifier_rank=...)``): the
        fp32 master takes the edited 16-bit values where they changed."""
        for k, (j, a, b) in enumerate(self.pieces):
            if j == i and bool(changed[a:b].any()):
                chunk = self.store.read_now(k) if self.store else self.chunks[k]
                chunk[: b - a][changed[a:b]] = new[a:b][changed[a:b]].float()
                if self.store:
                    self.store.write_now(k, chunk)

    def take_error(self):
        e, self._error = self._error, None
        return e

    # ---------------------------------------------------------------- inspection
    def fp32_shards(self) -> list[torch.Tensor]:
        """The fp32 values of the rank's shard, one tensor per unit (the master, or the fp32 params)."""
        if not self.has_master:
            return list(self.targets)
        pieces = [self.store.read_now(k)[:n] if self.store else self.chunks[k][:n] for k, n in enumerate(self.sizes)]
        out = [[] for _ in self.targets]
        for (i, _, _), t in zip(self.pieces, pieces):
            out[i].append(t)
        return [torch.cat(ts) if len(ts) > 1 else ts[0] for ts in out]

    def close(self) -> None:
        if self.store is not None:
            self.store.close()


class OffloadMixin:
    """Put in front of a stage engine class: the optimizer becomes an ``OffloadOptimizer``."""
    stages_buckets_whole = True   # stage 2-3: a bucket's reduced shard leaves for the host in one piece

    def build_optimizer(self) -> None:
        z = self.config.zero
        self.master = None   # no device master: the engine's own master->params copy is skipped
        self.targets = [self.own(self.flat.flat, u) for u in self.flat.units]
        self.optimizer = OffloadOptimizer(self.config.optimizer.type, self.config.optimizer.params, self.targets,
                                          self.precision.has_master, z.offload_optimizer, self.rank,
                                          z.sub_group_size, groups=self.group_hypers,
                                          segments=self.group_segments())

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
        return self.stage == 1 or self.micro_steps % self.gas == 0

    def reduce_scatter_grads(self, i: int) -> None:
        """Reduce-scatter bucket ``i`` into a device temporary; its shard then leaves for the host."""
        b, first = self.buckets[i], self._first_micro_step()
        if self.stage >= 2:      # stage 2's rank-major staging buffer, freed with the collective
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
