"""What one pipeline step measured: the F/B timeline, the micro-batches in flight, the activations kept (chapter 10).

``StepRecorder`` wraps each forward ("F"), backward ("B") and, when the backward is split
(zero bubble), weight-gradient pass ("W") of ``train_batch``:

* ``trace``: ``(op, micro_batch, start, end)`` per operation, ``time.perf_counter()``
  seconds (CLOCK_MONOTONIC on Linux: one clock for every process of the machine, so
  the ranks' traces can be laid side by side). Only the computation is timed: waiting
  for a neighbour's activation or gradient falls between operations, in the bubble.
  ``chunks``: each operation's chunk (interleaved schedules; 0 otherwise), in the trace's order.
  ``weight_passes``: how many deferred weight-gradient passes (one per Linear and micro-batch) the W
  operations ran (0 without a split backward).
* ``in_flight_max``: the most micro-batches (per chunk) whose forward has run and backward not yet
  (with a split backward: whose W has not).
* ``activation_peak_bytes``: measured with ``torch.autograd.graph.saved_tensors_hooks``:
  during a forward every tensor autograd saves for backward is seen once; its storage's
  bytes are counted (once per storage, parameters excluded) for that micro-batch until
  its backward (its W) ends. The peak is the largest sum over the micro-batches in flight.
* ``bubble``: this rank's idle fraction: 1 - busy / (end of its last operation - entry
  into ``train_batch``).

``pipeline_bubble(stats)`` gives the step's bubble from every rank's stats (gathered,
e.g., in a launched function's return value): over the window from the first
operation's start to the last one's end on any rank, 1 - the ranks' mean busy time /
the window — what (p - 1)/(m + p - 1) predicts when every stage's forward and
backward take the same time.
"""
from __future__ import annotations

import contextlib
import time

import torch

from zerolab.theory.bubble import bubble_fraction


class StepRecorder:
    """The measurements of one ``train_batch`` call on this rank (module docstring)."""

    def __init__(self, params, split: bool = False):
        self.start, self.split = time.perf_counter(), split   # split: a micro-batch's W ends it, not its B
        self.weight_passes = 0
        self.trace, self.chunks, self.saved, self.in_flight, self.in_flight_max, self.peak = [], [], {}, 0, 0, 0
        self.param_storages = {p.untyped_storage().data_ptr() for p in params}

    @contextlib.contextmanager
    def op(self, kind: str, i: int, chunk: int = 0):
        t0 = time.perf_counter()
        key = (i, chunk)
        if kind == "F":
            seen, self.saved[key] = set(), 0

            def pack(t):
                st = t.untyped_storage()
                ptr = st.data_ptr()
                if ptr not in self.param_storages and ptr not in seen:
                    seen.add(ptr)
                    self.saved[key] += st.nbytes()
                return t

            with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
                yield
            self.in_flight += 1
            self.in_flight_max = max(self.in_flight_max, self.in_flight)
            self.peak = max(self.peak, sum(self.saved.values()))
        else:
            yield
            if kind == ("W" if self.split else "B"):
                self.saved.pop(key, None)
                self.in_flight -= 1
        self.trace.append((kind, i, t0, time.perf_counter()))
        self.chunks.append(chunk)

    def stats(self) -> dict:
        busy = sum(end - start for _, _, start, end in self.trace)
        end = max((e for *_, e in self.trace), default=self.start)
        return {"trace": list(self.trace), "chunks": list(self.chunks), "weight_passes": self.weight_passes,
                "start": self.start, "busy": busy,
                "in_flight_max": self.in_flight_max, "activation_peak_bytes": self.peak,
                "bubble": 1.0 - busy / (end - self.start) if end > self.start else 0.0}


def pipeline_bubble(stats: list) -> float:
    """The measured bubble of one step from every rank's ``pipeline_stats`` (module docstring)."""
    traces = [s["trace"] for s in stats if s["trace"]]
    if not traces:
        raise ValueError("pipeline_bubble: no rank recorded an operation")
    first = min(t[0][2] for t in traces)
    last = max(t[-1][3] for t in traces)
    busy = sum(sum(e - b for _, _, b, e in t) for t in traces) / len(traces)
    return 1.0 - busy / (last - first)


def bubble_formula(p: int, m: int, kind: str = "1f1b", v: int = 1, f=1, b=1, w=1) -> float:
    """The bubble the schedule predicts (uniform stages): (p - 1) / (m + p - 1) for GPipe and 1F1B,
    (p - 1) / (v·m + p - 1) interleaved, ZB-H1's with costs f, b, w (``theory/bubble.py``)."""
    return float(bubble_fraction(kind, p, m, v, f, b, w))
