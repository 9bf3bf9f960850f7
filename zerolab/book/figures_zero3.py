"""ZeRO-3's gather -> compute -> release, drawn from a real engine's event trace (chapter 6).

A stage-3 engine run with ``{"zerolab": {"trace": true}}`` records, in order, when each
unit's all-gather is issued and completes, when it computes (forward, backward) and when it
is released (``zerolab.engine.events``). Replaying that list gives, at every moment of a
step, the set of units a rank holds *whole* — on top of its 1/N shard of every unit, which
it always holds. Two figures read it:

* ``step_figure``: one rank's step, unit by unit (rows) and event by event (columns): the
  span each unit is held whole, its all-gather in flight, its forward and backward compute;
  below, the elements held whole at each moment against the rank's shard.
* ``moment_figure``: who holds what at chosen moments (between steps, during a unit's
  forward, during its backward): per rank its shard of every unit and the units it holds
  whole then, laid out on the flat parameter space as ``figures.partition_figure`` does.

``units`` is ``unit_table(engine)``: ``[(name, offset, padded, shard), ...]``. The
helpers (``lifetimes``, ``held_elements``, ``gathered_at``, ``position``) are plain
replays of the list, tested against the engine's own counters (tests/test_figures_zero3.py).
Each figure function returns ``(fig, alt)`` for ``plots.show(fig, alt=alt)``.
"""
from __future__ import annotations

from zerolab.book.plots import COLORS
from zerolab.engine import events as ev


def unit_table(source) -> list[tuple[str, int, int, int]]:
    """``[(name, offset, padded, shard), ...]`` indexed as the events index units, picklable: a stage-3
    engine's ``units`` (its trainable units, then the frozen twins, named "... (frozen)"), or a
    ``FlatParams``' units. Offsets run unit after unit, as the figures lay them out."""
    units = source.units
    trainable = getattr(source, "n_trainable", len(units))
    out, offset = [], 0
    for i, u in enumerate(units):
        out.append((u.name + (" (frozen)" if i >= trainable else ""), offset, u.padded, u.shard))
        offset += u.padded
    return out


def names_of(events) -> list[tuple[str, int]]:
    """``(name, index)`` of each event (traces carry a time as a third field; the order is what counts)."""
    return [(e[0], e[1]) for e in events]


def lifetimes(events) -> dict[int, list[tuple[int, int, int]]]:
    """``{unit: [(issued, done, released), ...]}``: event positions of each time a unit was held whole
    (``released`` is the list's length if the unit was still held at its end)."""
    out, open_ = {}, {}
    evs = names_of(events)
    for k, (name, i) in enumerate(evs):
        if name == ev.GATHER_ISSUED:
            open_[i] = [k, None]
        elif name == ev.GATHER_DONE and i in open_:
            open_[i][1] = k
        elif name == ev.RELEASE and i in open_:
            issued, done = open_.pop(i)
            out.setdefault(i, []).append((issued, k if done is None else done, k))
    for i, (issued, done) in open_.items():
        out.setdefault(i, []).append((issued, len(evs) if done is None else done, len(evs)))
    return out


def gathered_at(events, pos: int) -> set[int]:
    """Units held whole (issued and not yet released) once the event at position ``pos`` has happened."""
    held = set()
    for name, i in names_of(events)[:pos + 1]:
        if name == ev.GATHER_ISSUED:
            held.add(i)
        elif name == ev.RELEASE:
            held.discard(i)
    return held


def held_elements(events, units) -> list[int]:
    """Elements held whole after each event (the engine's ``live_elements``, replayed)."""
    size, held, out = {i: u[2] for i, u in enumerate(units)}, set(), []
    for name, i in names_of(events):
        if name == ev.GATHER_ISSUED:
            held.add(i)
        elif name == ev.RELEASE:
            held.discard(i)
        out.append(sum(size[j] for j in held))
    return out


def position(events, name: str, index: int, occurrence: int = 0) -> int:
    """Position of the ``occurrence``-th event ``(name, index)`` in the trace."""
    hits = [k for k, e in enumerate(names_of(events)) if e == (name, index)]
    if len(hits) <= occurrence:
        raise ValueError(f"event ({name!r}, {index}) occurs {len(hits)} time(s) in the trace, "
                         f"occurrence {occurrence} asked for")
    return hits[occurrence]


def _compute_spans(evs, rest):
    """``[(unit row, kind, start, end)]``: forward and backward compute per unit; a module computing
    with another unit's (tied) parameters (index -1) is drawn on the row of "rest", which holds them."""
    out, fwd, bwd = [], [], {}
    for k, (name, i) in enumerate(evs):
        row = rest if i == -1 else i
        if name == ev.UNIT_FWD_START:
            fwd.append((row, k))
        elif name == ev.UNIT_FWD_END and fwd:
            r, s = fwd.pop()
            out.append((r, "forward", s, k))
        elif name == ev.UNIT_BWD_START:
            if i == -1 and rest is not None:
                out.append((rest, "backward", k, k + 1))
            bwd.setdefault(i, k)
        elif name == ev.UNIT_BWD_END and i in bwd:
            out.append((i, "backward", bwd.pop(i), k))
    return [s for s in out if s[0] is not None]


def _with_twins(spans, names):
    """A frozen twin computes with its unit: repeat each span on the row named "<unit> (frozen)"."""
    twin = {i: names.index(f"{n} (frozen)") for i, n in enumerate(names) if f"{n} (frozen)" in names}
    return spans + [(twin[r], kind, s, e) for r, kind, s, e in spans if r in twin]


def step_figure(events, units, rank: int = 0, title: str | None = None):
    """One rank's step: units held whole (rows) along the trace, and the elements held whole below."""
    from matplotlib.figure import Figure
    from matplotlib.patches import Patch
    evs = names_of(events)
    names = [u[0] for u in units]
    rest = next((names.index(n) for n in ("rest", "rest (frozen)") if n in names), None)
    fig = Figure(figsize=(10, 1.6 + 0.42 * len(units) + 1.8), layout="constrained")
    top, bottom = fig.subplots(2, 1, sharex=True, height_ratios=[max(len(units), 3), 3])
    life = lifetimes(events)
    for i, spans in life.items():
        for issued, done, released in spans:
            top.broken_barh([(issued, released - issued)], (i - 0.4, 0.8), facecolors=COLORS["params"], alpha=0.25)
            top.broken_barh([(issued, max(done - issued, 0.5))], (i - 0.4, 0.8), facecolors="none",
                            edgecolors="gray", hatch="////")
    colors = {"forward": "#55A868", "backward": "#DD8452"}
    for row, kind, s, e in _with_twins(_compute_spans(evs, rest), names):
        top.broken_barh([(s, max(e - s, 0.6))], (row - 0.22, 0.44), facecolors=colors[kind])
    phases = {ev.FORWARD_START: "forward", ev.BACKWARD_START: "backward", ev.STEP_START: "step"}
    for k, (name, _) in enumerate(evs):
        if name in phases:
            for ax in (top, bottom):
                ax.axvline(k, color="black", linestyle=":", linewidth=1)
            top.text(k + 0.5, -0.75, phases[name], fontsize=8, va="bottom")
    top.set_yticks(range(len(units)), names, fontsize=8)
    top.set_ylim(len(units) - 0.5, -1.0)
    top.legend(handles=[Patch(facecolor=COLORS["params"], alpha=0.25, label="held whole (gathered)"),
                        Patch(facecolor="none", edgecolor="gray", hatch="////", label="all-gather in flight"),
                        Patch(facecolor=colors["forward"], label="forward compute"),
                        Patch(facecolor=colors["backward"], label="backward compute")],
               fontsize=8, loc="upper left", bbox_to_anchor=(1.0, 1.0))
    top.set_title(title or f"ZeRO-3, rank {rank}: gather -> compute -> release over one step", fontsize=10)
    curve, shard = held_elements(events, units), sum(u[3] for u in units)
    bottom.step(range(len(curve)), curve, where="post", color=COLORS["params"], label="elements held whole")
    bottom.axhline(shard, color=COLORS["optimizer"], linestyle="--", label=f"the rank's shard ({shard:,})")
    peak = max(curve, default=0)
    bottom.set_ylabel("elements", fontsize=8)
    bottom.set_xlabel("events of one step on this rank, in the order they happened (not to time scale)")
    bottom.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.0, 1.0))
    at_peak = sorted(gathered_at(events, curve.index(peak))) if curve else []
    counts = {len(life.get(i, [])) for i in range(len(units))}
    times = {1: "once", 2: "twice"}.get(counts.pop(), None) if len(counts) == 1 else None
    forward = [names[i] for n_, i in evs if n_ == ev.GATHER_ISSUED and i >= 0][:len(units)]
    alt = (f"One ZeRO-3 training step on rank {rank} with {len(units)} units, drawn from the engine's event "
           f"trace. The units are all-gathered in the order {', '.join(forward)}; "
           + (f"each unit is gathered {times} and released after each use. " if times else
              "gathers per unit: " + ", ".join(f"{names[i]} {len(life.get(i, []))}" for i in range(len(units)))
              + ". ")
           + f"At most {peak:,} elements are held whole at once ({' + '.join(names[i] for i in at_peak)}), "
           f"against the rank's shard of {shard:,} elements that it always holds; at the end of the step "
           f"{'nothing is' if not gathered_at(events, len(evs) - 1) else 'something is still'} held whole.")
    return fig, alt


def moment_figure(events_per_rank, units, moments, bytes_per_element: int = 2):
    """Per moment (a panel): per rank, its shard of every unit and the units it holds whole at that moment.

    ``moments``: ``[(label, event name, unit index), ...]`` located in each rank's own trace."""
    from matplotlib.figure import Figure
    from matplotlib.patches import Patch, Rectangle
    n, total = len(events_per_rank), units[-1][1] + units[-1][2]
    fig = Figure(figsize=(3.6 * len(moments) + 1.4, 1.2 + 0.6 * n), layout="constrained")
    axes = fig.subplots(1, len(moments), squeeze=False)[0]
    said = []
    for ax, (label, name, index) in zip(axes, moments):
        held_by_rank = []
        for r, events in enumerate(events_per_rank):
            held = gathered_at(events, position(events, name, index))
            held_by_rank.append(held)
            y = r * 3
            ax.add_patch(Rectangle((0, y), total, 2, facecolor="#eeeeee", edgecolor="none"))
            for _, offset, padded, shard in units:
                ax.add_patch(Rectangle((offset + r * shard, y), shard, 1, facecolor=COLORS["optimizer"]))
            for i in held:
                ax.add_patch(Rectangle((units[i][1], y + 1), units[i][2], 1, facecolor=COLORS["params"]))
        for _, offset, _, _ in units:
            ax.axvline(offset, color="white", linewidth=1.2)
        ax.set_xlim(0, total)
        ax.set_ylim(3 * n - 1, 0)
        ax.set_yticks([3 * r + 1 for r in range(n)], [f"rank {r}" for r in range(n)] if ax is axes[0] else [])
        ax.set_xticks([o + p / 2 for _, o, p, _ in units], [u[0] for u in units], fontsize=7, rotation=90)
        whole = sorted(held_by_rank[0])
        elements = sum(units[i][2] for i in whole)
        ax.set_title(f"{label}\nheld whole: {', '.join(units[i][0] for i in whole) or 'nothing'}", fontsize=9)
        said.append(f"{label}: " + (f"{' and '.join(units[i][0] for i in whole)} whole, "
                                    f"{elements * bytes_per_element:,} bytes on top of the shard" if whole
                                    else "only the shard") +
                    ("" if all(h == held_by_rank[0] for h in held_by_rank) else " (ranks differ)"))
    shard = sum(u[3] for u in units)
    fig.legend(handles=[Patch(facecolor=COLORS["optimizer"], label="the rank's shard (1/N of every unit, "
                              "with its gradient and optimizer shards)"),
                        Patch(facecolor=COLORS["params"], label="units held whole (gathered, transient)")],
               loc="outside upper center", ncols=2, fontsize=8, frameon=False)
    fig.supxlabel("flat parameter space (elements), unit after unit; upper lane: shard, lower lane: gathered", fontsize=8)
    alt = (f"Who holds what under ZeRO-3 on {n} ranks with {len(units)} units, read from each rank's event "
           f"trace. Every rank always holds its own 1/{n} slice of every unit ({shard:,} elements, "
           f"{shard * bytes_per_element:,} bytes of 16-bit parameters). " + "; ".join(said) + ".")
    return fig, alt


def packed_lanes(events_per_rank) -> tuple[list, list[str]]:
    """Rows for ``plots.plot_timeline`` like ``events.lanes``, but collectives in flight at the same
    time get rows of their own (greedy, in start order), so every all-gather is a bar you can count."""
    rows, labels = [], []
    for r, events in enumerate(events_per_rank):
        s = ev.spans(events)
        for lane in ("compute", "all-gather", "reduce-scatter"):
            bars = sorted(((kind, start, end) for kind, start, end, ln in s if ln == lane), key=lambda b: b[1])
            packed = []                                   # each: the bars of one row, none overlapping
            for bar in bars:
                row = next((p for p in packed if lane == "compute" or p[-1][2] <= bar[1]), None)
                if row is None:
                    packed.append([bar])
                else:
                    row.append(bar)
            for k, row in enumerate(packed or [[]]):
                rows.append(row)
                labels.append(f"rank {r} {lane}" + (f" {k + 1}" if len(packed) > 1 else ""))
    return rows, labels
