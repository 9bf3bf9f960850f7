"""Measuring what a rank holds: tensor census, peak memory, step timers.

Chapter 1 introduces these tools; every later chapter prints memory and time
through them, never through a typed-in number.

* ``census()``   — bytes of every live tensor storage, each storage counted once
                   (a view shares its base's storage; ``.grad``s included).
* ``MemoryReport`` — params / grads / optimizer / buffers / host / nvme bytes,
                   what ``engine.memory()`` returns.
* ``peak_memory()`` — the peak *increase* of memory inside a ``with`` block:
                   CPU through VmHWM (reset by ``/proc/self/clear_refs``), sampled
                   RssAnon, or the torch profiler's allocation events; CUDA through
                   torch.cuda stats (``zerolab.runtime.peak``, re-exported here).
* ``rss()`` — resident set; ``Timer``, ``timed()``, ``time_fn()`` (from
                   ``zerolab.runtime.timing``, re-exported here) — step times.

Bytes everywhere; ``MB`` means 10**6 bytes and ``MiB`` 2**20.
"""
from __future__ import annotations

import gc
import time
import warnings
from dataclasses import asdict, dataclass, field, fields

import torch

from zerolab.runtime.peak import PeakMeter, peak_memory, rss, status_kb, trim_heap  # noqa: F401  (re-exported)
from zerolab.runtime.timing import Timer, time_fn, timed  # noqa: F401  (re-exported)

UNITS = {"B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "KiB": 2**10, "MiB": 2**20, "GiB": 2**30}


# ---------------------------------------------------------------- census
@dataclass
class Census:
    """Deduplicated bytes of live tensor storages (see ``census``)."""
    total: int = 0                                        # bytes, each storage once
    count: int = 0                                        # number of distinct storages
    by_device: dict = field(default_factory=dict)         # "cpu" -> bytes
    by_dtype: dict = field(default_factory=dict)          # "float32" -> bytes (first view's dtype)
    by_category: dict = field(default_factory=dict)       # classify() answer or "other" -> bytes

    def table(self, unit: str = "MB") -> str:
        rows = [("total", self.total)]
        for name, d in (("device", self.by_device), ("dtype", self.by_dtype), ("category", self.by_category)):
            rows += [(f"{name}:{k}", v) for k, v in sorted(d.items())]
        return "\n".join(f"{k:<24}{v / UNITS[unit]:>12.3f} {unit}" for k, v in rows)

    __str__ = table


def _tensors_in(obj, out: list) -> None:
    """Tensors held by ``obj``: a tensor, module, optimizer, or nested dict/list/tuple."""
    if isinstance(obj, torch.Tensor):
        out.append(obj)
    elif isinstance(obj, torch.nn.Module):
        out.extend(obj.parameters())
        out.extend(obj.buffers())
    elif isinstance(obj, torch.optim.Optimizer):
        for state in obj.state.values():
            _tensors_in(state, out)
    elif isinstance(obj, dict):
        for v in obj.values():
            _tensors_in(v, out)
    elif isinstance(obj, (list, tuple, set)):
        for v in obj:
            _tensors_in(v, out)


def census(*, extra=(), include_grads: bool = True, classify=None, collect: bool = True) -> Census:
    """Count every live tensor storage once: the bytes this process holds in tensors.

    Finds tensors through ``gc.get_objects()`` (every tensor with a Python
    object), the state of every live ``torch.optim.Optimizer``, each tensor's
    ``.grad`` (``include_grads=False`` leaves every ``.grad`` out) and anything in ``extra`` (tensors, modules,
    optimizers, containers). Two tensors that share a storage (views,
    ``.view(dtype)``, slices of a flat buffer) count once, with the storage's
    full size: a 2-element slice of a 1000-element buffer costs the buffer.

    ``classify(tensor) -> str | None`` names a category for ``by_category``;
    a storage takes the first non-None answer of any tensor viewing it, else
    ``"other"``. Tensors that live only inside C++ (autograd's saved
    activations) are invisible here; ``peak_memory`` sees them.
    A forked rank also sees the tensors it inherited from its parent: compare
    categories, not ``total``, across processes. ``collect`` runs
    ``gc.collect()`` first, so tensors kept only by dead reference cycles go.
    """
    if collect:
        gc.collect()
    found: list = []
    _tensors_in(list(extra), found)
    kinds: dict = {}  # type -> 1 tensor, 2 optimizer, 0 other (issubclass on torch types is slow)
    for obj in gc.get_objects():
        cls = type(obj)  # not isinstance: that reads obj.__class__, which lazy modules answer with warnings
        kind = kinds.get(cls)
        if kind is None:
            kind = kinds[cls] = 1 if issubclass(cls, torch.Tensor) else 2 if issubclass(cls, torch.optim.Optimizer) else 0
        if kind == 1:
            found.append(obj)
        elif kind == 2:
            _tensors_in(obj, found)

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # .grad of a non-leaf warns
        grads = [t.grad for t in found if t.requires_grad and t.is_leaf and t.grad is not None]
    if include_grads:
        found += grads
    else:
        skip = {id(g) for g in grads}
        found = [t for t in found if id(t) not in skip]

    storages: dict = {}  # (device, data_ptr) -> [nbytes, dtype, category]
    for t in found:
        if t.is_meta or t.layout != torch.strided:
            continue  # no memory (meta) or no single storage (sparse)
        try:
            st = t.untyped_storage()
        except (RuntimeError, NotImplementedError):
            continue  # fake/functional tensors
        key = (str(t.device), st.data_ptr())
        cat = classify(t) if classify is not None else None
        entry = storages.get(key)
        if entry is None:
            storages[key] = [st.nbytes(), str(t.dtype).removeprefix("torch."), cat]
        else:
            entry[0] = max(entry[0], st.nbytes())
            entry[2] = entry[2] or cat

    c = Census()
    for (device, ptr), (nbytes, dtype, cat) in storages.items():
        if nbytes == 0:
            continue
        c.total += nbytes
        c.count += 1
        c.by_device[device] = c.by_device.get(device, 0) + nbytes
        c.by_dtype[dtype] = c.by_dtype.get(dtype, 0) + nbytes
        cat = cat or "other"
        c.by_category[cat] = c.by_category.get(cat, 0) + nbytes
    return c


# ---------------------------------------------------------------- memory report
def settled_census(tries: int = 20, pause: float = 0.02) -> int:
    """``census().total`` once it stops changing: gloo's worker threads may hold a
    finished collective's tensors for a moment (seen on a loaded 2-core machine)."""
    last = census().total
    for _ in range(tries):
        time.sleep(pause)
        now = census().total
        if now == last:
            break
        last = now
    return last


@dataclass
class MemoryReport:
    """What one rank holds, in bytes (``engine.memory()``; chapter 1's Table 1).

    ``total`` is the device tier the ZeRO paper counts: params + grads + optimizer
    (optimizer = fp32 master copy + Adam moments). ``buffers`` are transient
    (buckets, gathered units, staging); ``host`` / ``nvme`` what was offloaded.
    """
    params: int = 0
    grads: int = 0
    optimizer: int = 0
    buffers: int = 0
    host: int = 0
    nvme: int = 0
    gathered: int = 0   # of buffers: stage 3's gathered (full) units held right now

    @property
    def total(self) -> int:
        return self.params + self.grads + self.optimizer

    def as_dict(self) -> dict:
        return {**asdict(self), "total": self.total}

    def __add__(self, other: "MemoryReport") -> "MemoryReport":
        return MemoryReport(**{f.name: getattr(self, f.name) + getattr(other, f.name) for f in fields(self)})

    @classmethod
    def max(cls, reports) -> "MemoryReport":
        """Field-wise maximum over ranks (the rank that needs the most decides the device)."""
        reports = list(reports)
        return cls(**{f.name: max(getattr(r, f.name) for r in reports) for f in fields(cls)})

    @classmethod
    def sum(cls, reports) -> "MemoryReport":
        """Field-wise sum over ranks (the whole cluster)."""
        out = cls()
        for r in reports:
            out = out + r
        return out

    def table(self, unit: str = "MB") -> str:
        s = UNITS[unit]
        rows = ["params", "grads", "optimizer", "total", "buffers", "host", "nvme"]
        return "\n".join(f"{k:<10}{self.as_dict()[k] / s:>12.3f} {unit}" for k in rows)

    __str__ = table


# ---------------------------------------------------------------- bytes of one tensor (meters: runtime/peak.py)
def storage_bytes(t: torch.Tensor | None) -> int:
    """Bytes of ``t``'s storage (0 for None): what holding ``t`` costs, views included."""
    return 0 if t is None else t.untyped_storage().nbytes()
