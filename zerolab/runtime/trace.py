"""What a traced run records for the replay on modelled GPUs (chapters 3-14, ``theory.replay``).

With ``{"zerolab": {"trace": true}}`` an engine keeps a ``TraceRecorder`` over its
``engine.events``. Three kinds of record join the timeline events there, each a ``Record``:
``(name, index, perf_counter seconds)`` like every event (code that unpacks three values
keeps working) with its details in ``.info``:

    "compute"      unit (or -1)  end of a stretch of compute: {"phase", "flops", "start"}
    "coll-issued"  sequence no.  a collective issued: {"op", "nbytes" (full tensor), "members"
                                 (global ranks), "group" (mesh name or None), "tag", "control"}
    "coll-waited"  sequence no.  the moment the engine waited for it (compute could not go on before);
                                 info {"soft": True} where the engine only found it finished while
                                 polling (``Handle.is_completed``): on a GPU it would not have waited there
    "coll-drain"   -1            the end of a backward: the engine waits for all it still has in flight

A stretch of compute ends wherever a collective is issued or waited for, or the engine moves
to another unit, so the replay sees the engine's real order of compute, issues and waits.
FLOPs are counted while the run executes, by ``torch.utils.flop_counter``'s formulas (matmuls,
convolutions, attention), op by op, forward and backward apart.
"""
from __future__ import annotations

import time
from contextlib import contextmanager

import torch
import torch.utils.flop_counter as fc
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.flop_counter import FlopCounterMode

class Record(tuple):
    """``(name, index, seconds)`` with ``.info``: a dict of details (or None)."""

    def __new__(cls, name, index, t, info=None):
        rec = super().__new__(cls, (name, index, t))
        rec.info = info
        return rec

    def __reduce__(self):   # pickled back as a Record (results come back from the ranks by pickle)
        return Record, (*self, self.info)


def info_of(event):
    """The details of an event: a ``Record``'s ``.info``, a plain tuple's fourth field, else None."""
    return getattr(event, "info", None) if len(event) < 4 else event[3]


COMPUTE, ISSUED, WAITED, DRAIN = "compute", "coll-issued", "coll-waited", "coll-drain"
_REGISTRY = None


def flop_registry() -> dict:
    """torch's FLOP formulas, by op (``torch.utils.flop_counter``), and the CPU's fused attention,
    which torch's table leaves out (the same count as its GPU kernels: QKᵀ and PV, twice that backward)."""
    global _REGISTRY
    if _REGISTRY is None:
        _REGISTRY = dict(FlopCounterMode(display=False).flop_registry)
        cpu = getattr(torch.ops.aten, "_scaled_dot_product_flash_attention_for_cpu", None)
        if cpu is not None:
            _REGISTRY[cpu] = lambda q, k, v, *a, out_val=None, **kw: fc.sdpa_flop_count(q.shape, k.shape, v.shape)
            _REGISTRY[torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward] = \
                lambda grad, q, k, v, *a, out_val=None, **kw: fc.sdpa_backward_flop_count(grad.shape, q.shape,
                                                                                          k.shape, v.shape)
    return _REGISTRY


class _CountFlops(TorchDispatchMode):
    """Adds each op's FLOPs to the recorder's running count."""

    def __init__(self, recorder):
        super().__init__()
        self.recorder, self.registry = recorder, flop_registry()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        count = self.registry.get(func._overloadpacket)
        if count is not None:
            self.recorder.flops += count(*args, **kwargs, out_val=out)
        return out


class TraceRecorder:
    """The recorder behind ``engine.events`` (module docstring). ``events``: the list it appends to."""

    def __init__(self, events: list):
        self.events = events
        self.flops, self.unit, self.phase = 0, -1, None
        self._since = None     # start of the open stretch of compute
        self._seq = 0

    def _flush(self, now: float) -> None:
        """Close the open stretch of compute at ``now`` (a record even with 0 FLOPs: time passed)."""
        if self.phase is not None and self._since is not None and (self.flops or now > self._since):
            self.events.append(Record(COMPUTE, self.unit, now, {"phase": self.phase, "flops": int(self.flops),
                                                                 "start": self._since}))
        self.flops, self._since = 0, now

    @contextmanager
    def computing(self, phase: str):
        """Count FLOPs of everything run inside, as ``phase`` ("forward" or "backward")."""
        if self.phase is not None:      # nested (a forward inside a backward: recomputation)
            yield
            return
        self.phase, self._since, self.flops = phase, time.perf_counter(), 0
        try:
            with _CountFlops(self):
                yield
        finally:
            self._flush(time.perf_counter())
            self.phase, self.unit = None, -1

    def enter_unit(self, unit: int) -> None:
        """The engine's compute moves to unit ``unit``."""
        if unit != self.unit:
            self._flush(time.perf_counter())
            self.unit = unit

    def issued(self, op: str, nbytes: int, members, group, tag: str, control: bool) -> int:
        now = time.perf_counter()
        self._flush(now)
        self._seq += 1
        self.events.append(Record(ISSUED, self._seq, now, {"op": op, "nbytes": int(nbytes), "members": tuple(members),
                                                            "group": group, "tag": tag, "control": bool(control)}))
        return self._seq

    def drained(self) -> None:
        """The engine has waited for everything it had in flight (the end of a backward)."""
        self.events.append(Record(DRAIN, -1, time.perf_counter()))

    def waited(self, seq: int, soft: bool = False) -> None:
        now = time.perf_counter()
        self._flush(now)
        self.events.append(Record(WAITED, seq, now, {"soft": True} if soft else None))
