"""The engine's event vocabulary, and the one parser of its traces (chapters 3-6).

With ``{"zerolab": {"trace": true}}`` an engine appends ``(name, index,
perf_counter seconds)`` to ``engine.events``. The names are the constants
below, used by the engines (``base``, ``stage1``, ``stage3``) and read by
``spans`` here; the book (``zerolab.book.runs``) draws what ``spans`` returns.

    name                               index            emitted by
    BACKWARD_START / BACKWARD_END      -1               base: around autograd
    REDUCE_ISSUED / REDUCE_DONE        gradient bucket  base: a bucket's collective issued / waited for
    GATHER_ISSUED / GATHER_DONE        gather bucket    stage 1-2: the all-gather after the step
                                       unit             stage 3: a unit's all-gather
    RELEASE                            unit             stage 3: a unit's full buffer freed
    FORWARD_START / FORWARD_END        -1               stage 3: the root module's forward
    UNIT_FWD_START / UNIT_FWD_END      unit             stage 3: a block's forward
    UNIT_BWD_START / UNIT_BWD_END      unit             stage 3: a block's backward
    STEP_START / STEP_END              -1               base: the optimizer step

A traced run also records its FLOPs, every collective's issue and wait, and the optimizer's
updates, each a ``(name, index, seconds)`` with ``.info`` (``runtime/trace.py``, ``engine/trace.py``):
what ``zl.replay`` replays on a modelled GPU cluster.

A collective's span ends when the engine *waited* for it (for a gather: the
moment compute could go on), so with prefetch or ``overlap_comm`` it covers
the compute it hid behind.
"""
from __future__ import annotations

BACKWARD_START, BACKWARD_END = "backward-start", "backward-end"
REDUCE_ISSUED, REDUCE_DONE = "reduce-issued", "reduce-done"
GATHER_ISSUED, GATHER_DONE = "gather-issued", "gather-done"
RELEASE = "release"
FORWARD_START, FORWARD_END = "forward-start", "forward-end"
UNIT_FWD_START, UNIT_FWD_END = "unit-fwd-start", "unit-fwd-end"
UNIT_BWD_START, UNIT_BWD_END = "unit-bwd-start", "unit-bwd-end"
STEP_START, STEP_END = "step-start", "step-end"

PAIRS = {  # start event -> (end event, kind, lane)
    GATHER_ISSUED: (GATHER_DONE, "all-gather", "all-gather"),
    REDUCE_ISSUED: (REDUCE_DONE, "reduce-scatter", "reduce-scatter"),
    UNIT_FWD_START: (UNIT_FWD_END, "forward", "compute"),
    UNIT_BWD_START: (UNIT_BWD_END, "backward", "compute"),
    STEP_START: (STEP_END, "optimizer step", "compute"),
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
    """Rows for ``zerolab.book.plots.plot_timeline``: per rank a compute, an all-gather and a
    reduce-scatter row, and their labels (``ax.set_yticks(range(len(labels)), labels)``)."""
    rows, labels = [], []
    for r, events in enumerate(events_per_rank):
        s = spans(events)
        for lane in ("compute", "all-gather", "reduce-scatter"):
            rows.append([(kind, start, end) for kind, start, end, ln in s if ln == lane])
            labels.append(f"rank {r} {lane}")
    return rows, labels
