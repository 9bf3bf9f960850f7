"""``deepspeed.accelerator.get_accelerator()``: the device a rank runs on, as DeepSpeed's accelerator object answers.

DeepSpeed picks its accelerator once per process (``DS_ACCELERATOR``, else CUDA
when present, else the CPU); so does this: ``"cpu"`` answers as DeepSpeed's
CPU accelerator (device name ``cpu``, gloo, memory from the process's RSS and the
host's totals), ``"cuda"`` as its CUDA accelerator (``cuda:N``, nccl, torch.cuda's
counters). Only the calls training scripts make are here; another raises an
AttributeError naming the accelerator.
"""
from __future__ import annotations

import os

import torch

_ACCELERATOR = None


class Accelerator:
    """One of DeepSpeed's two accelerators zerolab runs on: ``name`` "cpu" or "cuda"."""

    def __init__(self, name: str):
        if name not in ("cpu", "cuda"):
            raise ValueError(f"DS_ACCELERATOR={name!r}: zerolab runs on 'cpu' or 'cuda'")
        if name == "cuda" and not torch.cuda.is_available():
            raise RuntimeError("DS_ACCELERATOR=cuda: torch sees no CUDA device; use DS_ACCELERATOR=cpu")
        self._name = name
        self._peak_rss = self._rss()

    # ---------------------------------------------------------------- which device
    def device_name(self, device_index=None) -> str:
        if self._name == "cpu" or device_index is None:
            return self._name
        return f"cuda:{device_index}"

    def device(self, device_index=None):
        return None if self._name == "cpu" else torch.cuda.device(device_index)

    def set_device(self, device_index) -> None:
        if self._name == "cuda":
            torch.cuda.set_device(device_index)

    def current_device(self):
        """CUDA: the current device's index; CPU: the launcher's LOCAL_RANK (DeepSpeed's CPU answer)."""
        return torch.cuda.current_device() if self._name == "cuda" else os.environ.get("LOCAL_RANK", 0)

    def current_device_name(self) -> str:
        return f"cuda:{torch.cuda.current_device()}" if self._name == "cuda" else "cpu"

    def device_count(self) -> int:
        if self._name == "cuda":
            return torch.cuda.device_count()
        return int(os.environ.get("LOCAL_SIZE", os.environ.get("LOCAL_WORLD_SIZE", 1)))

    def is_available(self) -> bool:
        return True

    def is_synchronized_device(self) -> bool:
        return self._name == "cpu"

    def synchronize(self, device_index=None) -> None:
        if self._name == "cuda":
            torch.cuda.synchronize(device_index)

    def communication_backend_name(self) -> str:
        return "nccl" if self._name == "cuda" else "gloo"

    # ---------------------------------------------------------------- dtypes and seeds
    def is_bf16_supported(self) -> bool:
        return True if self._name == "cpu" else torch.cuda.is_bf16_supported()

    def is_fp16_supported(self) -> bool:
        if self._name == "cuda":
            return True
        try:
            return bool(torch.ops.mkldnn._is_mkldnn_fp16_supported())
        except Exception:
            return False

    def supported_dtypes(self) -> list:
        return [torch.float, torch.bfloat16] + ([torch.float16] if self.is_fp16_supported() else [])

    def manual_seed(self, seed):
        return torch.manual_seed(seed) if self._name == "cpu" else torch.cuda.manual_seed(seed)

    def manual_seed_all(self, seed):
        return torch.manual_seed(seed) if self._name == "cpu" else torch.cuda.manual_seed_all(seed)

    def random(self):
        return torch.random if self._name == "cpu" else torch.cuda.random

    # ---------------------------------------------------------------- memory
    @staticmethod
    def _rss() -> int:
        try:
            import psutil
            return psutil.Process().memory_info().rss
        except ImportError:
            return 0

    def memory_allocated(self, device_index=None) -> int:
        if self._name == "cuda":
            return torch.cuda.memory_allocated(device_index)
        rss = self._rss()
        self._peak_rss = max(self._peak_rss, rss)
        return rss

    def max_memory_allocated(self, device_index=None) -> int:
        if self._name == "cuda":
            return torch.cuda.max_memory_allocated(device_index)
        self.memory_allocated()
        return self._peak_rss

    def reset_peak_memory_stats(self, device_index=None) -> None:
        if self._name == "cuda":
            torch.cuda.reset_peak_memory_stats(device_index)
        else:
            self._peak_rss = self._rss()

    reset_max_memory_allocated = reset_peak_memory_stats

    def memory_reserved(self, device_index=None) -> int:
        return torch.cuda.memory_reserved(device_index) if self._name == "cuda" else self.memory_allocated()

    def total_memory(self, device_index=None) -> int:
        if self._name == "cuda":
            return torch.cuda.get_device_properties(device_index or torch.cuda.current_device()).total_memory
        import psutil
        return psutil.virtual_memory().total

    def available_memory(self, device_index=None) -> int:
        if self._name == "cuda":
            free, _ = torch.cuda.mem_get_info(device_index)
            return free
        import psutil
        return psutil.virtual_memory().available

    def empty_cache(self) -> None:
        if self._name == "cuda":
            torch.cuda.empty_cache()

    def pin_memory(self, tensor, align_bytes=1):
        return tensor.pin_memory() if self._name == "cuda" else tensor

    def on_accelerator(self, tensor) -> bool:
        return tensor.device.type == self._name

    def __repr__(self):
        return f"zerolab accelerator({self._name!r})"


def get_accelerator() -> Accelerator:
    """The process's accelerator: ``DS_ACCELERATOR`` if set, else CUDA when torch sees a GPU, else the CPU."""
    global _ACCELERATOR
    if _ACCELERATOR is None:
        name = os.environ.get("DS_ACCELERATOR") or ("cuda" if torch.cuda.is_available() else "cpu")
        _ACCELERATOR = Accelerator(name)
    return _ACCELERATOR


def set_accelerator(accel) -> None:
    """DeepSpeed's ``set_accelerator``: only zerolab's own accelerators are accepted."""
    global _ACCELERATOR
    if not isinstance(accel, Accelerator):
        raise NotImplementedError(f"deepspeed.accelerator.set_accelerator({type(accel).__name__}): zerolab runs "
                                  f"on its CPU or CUDA accelerator only (set DS_ACCELERATOR=cpu or cuda)")
    _ACCELERATOR = accel


__all__ = ["get_accelerator", "set_accelerator", "Accelerator"]
