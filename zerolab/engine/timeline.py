"""The engine's event trace as spans for a Gantt chart (chapters 3 and 6).

With ``{"zerolab": {"trace": true}}`` an engine appends ``(name, index,
perf_counter seconds)`` to ``engine.events``: ``gather-issued``/``gather-done``
(index: unit), ``unit-fwd-start``/``-end`` and ``unit-bwd-start``/``-end``
(stage 3, index: unit), ``release`` (unit), ``reduce-issued``/``reduce-done``
(index: gradient bucket), ``step-start``/``step-end``. ``spans`` pairs them
into ``(kind, start, end, lane)`` rows: lane "compute", "all-gather" or
"reduce-scatter". A collective's span ends when the engine *waited* for it
(for a gather: the moment compute could go on), so with prefetch or
``overlap_comm`` it covers the compute it hid behind.
"""
from __future__ import annotations

PAIRS = {  # start event -> (end event, kind, lane)
    "gather-issued": ("gather-done", "all-gather", "all-gather"),
    "reduce-issued": ("reduce-done", "reduce-scatter", "reduce-scatter"),
    "unit-fwd-start": ("unit-fwd-end", "forward", "compute"),
    "unit-bwd-start": ("unit-bwd-end", "backward", "compute"),
    "step-start": ("step-end", "optimizer step", "compute"),
}
_END = {end: start for start, (end, _, _) in PAIRS.items()}


def spans(events) -> list[tuple[str, float, float, str]]:
    """``[(kind, start, end, lane), ...]`` from one rank's ``engine.events``."""
    open_, out = {}, []
    for name, index, t in events:
        if name in PAIRS:
            open_.setdefault((name, index), t)
        elif name in _END and (_END[name], index) in open_:
            start = open_.pop((_END[name], index))
            _, kind, lane = PAIRS[_END[name]]
            out.append((kind, start, t, lane))
    return out


def lanes(events_per_rank) -> tuple[list, list[str]]:
    """Rows for ``zerolab.plots.plot_timeline``: per rank a compute, an all-gather and a
    reduce-scatter row, and their labels (``ax.set_yticks(range(len(labels)), labels)``)."""
    rows, labels = [], []
    for r, events in enumerate(events_per_rank):
        s = spans(events)
        for lane in ("compute", "all-gather", "reduce-scatter"):
            rows.append([(kind, start, end) for kind, start, end, ln in s if ln == lane])
            labels.append(f"rank {r} {lane}")
    return rows, labels
