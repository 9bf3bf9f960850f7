"""ZeRO-Infinity's parameter offload: stage 3's parameter shard on the host or on NVMe (chapter 7).

Stage 3 keeps only ``param_shard`` (padded Ψ / N elements) between uses and
all-gathers a unit from it right before the unit computes. With
``offload_param.device``:

    "cpu"   the shard belongs to host RAM (on a CPU-only machine the same RAM as
            the "device": the move is one of accounting; ``memory()`` reports
            it under ``host``)
    "nvme"  the shard is a tensor over a memory-mapped swap file under
            ``nvme_path``. Gathering unit u reads its pages in (the kernel
            does the I/O; ``prefetch`` = ``MADV_WILLNEED`` on the next units
            of the recorded order, up to ``buffer_count`` units ahead), and
            once the all-gather is done the pages are written back and dropped
            (``release``), so the resident set holds at most the units in flight.

Stage 3's partitioned frozen weights (``frozen_shard``) go the same way, to a
file of their own under NVMe. Every use of a unit therefore costs a read of its shard from NVMe (forward
and backward) and every step a write: 2 x 2Ψ/N bytes read and 2Ψ/N written
per micro-step in 16-bit — the arithmetic chapter 7 sets against NVMe bandwidth.
"""
from __future__ import annotations


from zerolab.config import ConfigError
from zerolab.runtime.measure import storage_bytes
from zerolab.engine.offload.nvme import MappedFile, check_nvme_path


class ParamOffloadMixin:
    """Put in front of ``Stage3Engine``: its parameter shard moves to host RAM or NVMe."""

    def __init__(self, model, cfg, communicator=None, **kw):
        super().__init__(model, cfg, communicator, **kw)
        off = cfg.zero.offload_param
        if self.param_shard.device.type != "cpu":
            raise ConfigError("zero_optimization.offload_param on an accelerator is not implemented yet in "
                              "zerolab (the gather reads the shard in place); use offload_optimizer")
        self.param_device, self.param_file, self.frozen_file = off.device, None, None
        if off.device == "nvme":
            path = check_nvme_path(off.nvme_path, "zero_optimization.offload_param")
            shard = self.param_shard
            self.param_file = MappedFile(path, storage_bytes(shard), f"params-r{self.rank}", "zero_optimization.offload_param")
            mapped = self.param_file.tensor(shard.dtype, shard.numel())   # (padded Ψ/N,) on disk
            mapped.copy_(shard)
            self.param_shard = self.flat.flat = mapped
            del shard
            if self.master is None:   # fp32, or an offloaded optimizer: it writes the shard itself
                self.targets = [self.flat.shard_view(mapped, u) for u in self.flat.units]
                self.optimizer.targets = self.targets
            self.param_file.release()
            if self.frozen_shard is not None:   # the frozen weights' shard: a file of its own
                shard = self.frozen_shard
                self.frozen_file = MappedFile(path, storage_bytes(shard), f"frozen-r{self.rank}",
                                              "zero_optimization.offload_param")
                mapped = self.frozen_file.tensor(shard.dtype, shard.numel())   # (padded Ψ_frozen/N,) on disk
                mapped.copy_(shard)
                self.frozen_shard = self.frozen_flat.flat = mapped
                del shard
                self.frozen_file.release()
        self.read_ahead = off.buffer_count

    def _file_range(self, i: int):
        """(mapped file, first byte, end byte) of unit ``i``'s shard (a frozen twin's: the frozen file)."""
        u, es = self.units[i], self.param_shard.element_size()
        f = self.param_file if i < self.n_trainable else self.frozen_file
        return f, u.shard_offset * es, (u.shard_offset + u.shard) * es

    def _issue(self, i: int) -> None:
        if self.param_file is not None:   # read this unit and the next ones ahead
            for j in [i] + self.trace.upcoming()[: self.read_ahead]:
                f, a, b = self._file_range(j)
                f.willneed(a, b)
        super()._issue(i)

    def _complete(self, i: int) -> None:
        super()._complete(i)
        if self.param_file is not None:   # gathered into the unit buffer: the shard's pages can go
            f, a, b = self._file_range(i)
            f.release(a, b)

    def step(self) -> None:
        super().step()
        if self.param_file is not None:   # the optimizer wrote the shard: back to disk
            self.param_file.release()

    def memory(self):
        r = super().memory()
        moved = storage_bytes(self.param_shard) + storage_bytes(self.frozen_shard)
        r.params -= moved
        if self.param_device == "nvme":
            r.nvme += moved
        else:
            r.host += moved
        return r

    def close(self) -> None:
        super().close()
        for f in (self.param_file, self.frozen_file):
            if f is not None:
                f.close()
