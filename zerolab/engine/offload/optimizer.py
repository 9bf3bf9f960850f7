"""ZeRO-Offload's optimizer: the rank's optimizer state and step on the CPU, the state in RAM or on NVMe (chapter 7).

With ``offload_optimizer.device`` "cpu" or "nvme" (stages 1-3) the rank's
shard of the optimizer state — fp32 master weights (mixed precision) and
Adam's m and v, 12 bytes per element, or m and v alone (8) in fp32 — lives
off the accelerator. Per unit, at the step:

    gradient shard  already on the host, fp32 (it left the device during backward)
    state chunk     RAM, or NVMe -> staging buffer (read ahead, ``buffer_count``)
    CPU step        one fused pass (torch's vectorised CPU Adam/AdamW kernel)
    parameters      host -> device  (the updated 16-bit, or fp32, shard)
    state chunk     staging -> NVMe (written behind, while the next unit steps)

What the engine changes around it (gradients to the host during backward,
the ranks agreeing on a failed read) is ``optimizer_mixin.py``.
"""
from __future__ import annotations

import torch

from zerolab.runtime.measure import storage_bytes
from zerolab.engine.offload.nvme import ChunkStore, NVMeError, check_nvme_path
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
                 key="zero_optimization.offload_optimizer", groups=None, segments=None, start=None):
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
                chunk[: b - a].copy_((start or targets)[i][a:b])   # start: fp32 values where the model had them
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
        self.math.step_count = self.step_count   # (a loaded checkpoint sets step_count here)
        self.math.begin_step()                   # parameters without a gradient anywhere keep their own t
        self.step_count = self.math.step_count
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
                for s, e, h, lr_k, t in self.math.runs(i, a, b, lr):   # one run per group (and parameter)
                    self._update(p[s:e], g[s:e], [v[s:e] for v in views], lr_k, h, t)
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

    def _update(self, p, g, moments, lr, h, t):
        m = self.math
        fused = FUSED_ADAM.get(self.kind)
        if fused is not None:
            step = torch.tensor(float(t))
            fused([p], [g], [moments[0]], [moments[1]], [], [step], lr=lr, beta1=h.betas[0], beta2=h.betas[1],
                  weight_decay=h.weight_decay, eps=h.eps, amsgrad=False, maximize=False)
        elif self.kind == "sgd":
            m._sgd(p, g, moments[0] if moments else None, lr, h, t)
        else:
            m._adam(p, g, moments[0], moments[1], lr, h, t)

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
