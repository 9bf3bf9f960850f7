"""Step timers: wall-clock seconds with CUDA synchronised, medians for noisy machines.

Chapters 3-7 time training steps with these (re-exported by ``zerolab.runtime.measure``).
On a shared 2-core CPU single steps vary by 2x or more: quote the median.
"""
from __future__ import annotations

import statistics
import time
from contextlib import contextmanager

import torch

def _sync() -> None:
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        torch.cuda.synchronize()


class Timer:
    """Wall-clock timer for repeated steps: ``with timer: step()`` appends seconds.

    Synchronises CUDA before and after each measurement when CUDA is in use,
    so queued kernels are counted. ``median`` is the number to quote: on a
    shared 2-core machine single steps are noisy.
    """

    def __init__(self):
        self.times: list[float] = []

    def __enter__(self) -> "Timer":
        _sync()
        self._t0 = time.perf_counter()
        return self

    def __exit__(self, *exc) -> None:
        _sync()
        self.times.append(time.perf_counter() - self._t0)

    @property
    def last(self) -> float:
        return self.times[-1]

    @property
    def seconds(self) -> float:
        return sum(self.times)

    @property
    def median(self) -> float:
        return statistics.median(self.times)

    @property
    def mean(self) -> float:
        return statistics.fmean(self.times)

    @property
    def min(self) -> float:
        return min(self.times)

    def __repr__(self) -> str:
        if not self.times:
            return "Timer(no measurements)"
        return (f"Timer(n={len(self.times)}, median={self.median * 1e3:.2f} ms, "
                f"min={self.min * 1e3:.2f} ms, max={max(self.times) * 1e3:.2f} ms)")


@contextmanager
def timed():
    """``with timed() as t: ...`` then ``t.seconds``."""
    t = Timer()
    with t:
        yield t


def time_fn(fn, *args, repeat: int = 5, warmup: int = 1, **kwargs) -> Timer:
    """Run ``fn(*args, **kwargs)`` ``warmup`` times untimed, then ``repeat`` times timed."""
    for _ in range(warmup):
        fn(*args, **kwargs)
    t = Timer()
    for _ in range(repeat):
        with t:
            fn(*args, **kwargs)
    return t
