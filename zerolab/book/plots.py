"""Plots the book draws: memory by stage and by rank, bytes sent, link models, timelines.

Every function draws on a matplotlib ``Axes`` (made for you when ``ax`` is None)
and returns it; every plot gets a title and axis labels with units. Sizes are
shown in GB = 10^9 bytes, as in the ZeRO paper. ``figure_png`` turns a figure
into PNG bytes and ``show`` displays a figure with alt text: the widgets and
chapters draw without pyplot, so no figure leaks out of a widget's output area.

Used by: chapter 1 (``stage_memory_bars``, ``memory_bars``), chapter 2
(``comm_bars``, ``bandwidth_curves``), chapters 3-6 and 9 (``plot_timeline``: a measured run's
lanes and a ``zl.replay``'s, drawn alike). The ring all-reduce's
grid (chapter 2) is drawn beside its simulation, in ``zerolab.book.ring``.
"""
from __future__ import annotations

import io

GB = 1e9
CATEGORIES = ("params", "grads", "optimizer", "activations", "buffers")
COLORS = {"params": "#4C72B0", "grads": "#DD8452", "optimizer": "#55A868",
          "activations": "#C44E52", "buffers": "#8172B3", "host": "#937860", "nvme": "#7f7f7f"}
STAGE_NAMES = ("DDP", "ZeRO-1", "ZeRO-2", "ZeRO-3")


def new_axes(ax=None, figsize=(6.4, 4.0), ncols=1):
    """Return ``(fig, ax)``: the given axes' figure, or a fresh pyplot-free figure."""
    if ax is not None:
        return ax.figure, ax
    from matplotlib.figure import Figure
    fig = Figure(figsize=figsize, layout="constrained")
    axes = fig.subplots(1, ncols)
    return fig, axes


def figure_png(fig, dpi=80) -> bytes:
    """PNG bytes of ``fig`` (deterministic for the same drawing)."""
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=dpi, metadata={"Software": None})
    return buf.getvalue()


def show(fig, dpi=100, alt=None):
    """Display ``fig`` as a PNG with alt text (``alt``; default: its titles), without pyplot or ``%matplotlib``."""
    from IPython.display import display
    display(image_bundle(figure_png(fig, dpi=dpi), alt or figure_alt(fig)), raw=True)


def figure_alt(fig) -> str:
    """Default alt text: 'Figure: ' and the titles of the figure's axes."""
    return "Figure: " + ("; ".join(ax.get_title() for ax in fig.axes if ax.get_title()) or "a plot")


def image_bundle(png: bytes, alt: str) -> dict:
    """Display bundle: an <img> with alt text (the HTML nbconvert renders), the PNG, the alt as plain text."""
    import base64, html
    b64 = base64.b64encode(png).decode("ascii")
    return {"text/html": f'<img alt="{html.escape(alt)}" src="data:image/png;base64,{b64}"/>',
            "image/png": b64, "text/plain": alt}


def _get(obj, name):
    """A category's bytes from a mapping or an object with attributes (0 if absent)."""
    if isinstance(obj, dict):
        return obj.get(name, 0) or 0
    return getattr(obj, name, 0) or 0


def gb_label(gb: float) -> str:
    """'31.4 GB', '2,830 GB', '1.56 PB', '781 MB': sizes given in GB, as the book prints them."""
    if gb >= 1e6:
        return f"{gb / 1e6:.3g} PB"
    if gb >= 1e4:
        return f"{gb / 1e3:.3g} TB"
    if gb >= 100:
        return f"{gb:,.0f} GB"
    if 0 < gb < 1:
        return f"{gb * 1e3:.3g} MB"
    return f"{gb:.3g} GB"


def _label_bars(ax, xs, totals, fmt="{:.3g}"):
    top = max(totals) if len(totals) else 0
    for x, t in zip(xs, totals):
        text = fmt(t) if callable(fmt) else fmt.format(t)
        ax.text(x, t + 0.01 * top, text, ha="center", va="bottom", fontsize=8)


# -- chapter 1 -----------------------------------------------------------------

def stage_memory_bars(data, capacity_gb=None, ax=None, title=None):
    """Stacked bar per ZeRO stage of the bytes one GPU holds.

    ``data``: ``{"params": [b0, b1, b2, b3], "grads": [...], "optimizer": [...],
    "activations": [...]}`` (bytes per GPU, one entry per stage 0..3); optional
    ``"host"``/``"nvme"`` lists are written under the bars.
    """
    fig, ax = new_axes(ax)
    n = len(data["params"])
    xs = list(range(n))
    bottom = [0.0] * n
    for cat in ("params", "grads", "optimizer", "activations"):
        vals = [v / GB for v in data.get(cat, [0] * n)]
        ax.bar(xs, vals, bottom=bottom, color=COLORS[cat], label=cat, width=0.6)
        bottom = [b + v for b, v in zip(bottom, vals)]
    top = max(bottom) or 1.0
    if capacity_gb and top > 4 * capacity_gb:     # keep the GPU line readable: clip tall bars
        top = 4 * capacity_gb
    top = max(top, capacity_gb or 0)
    ax.set_ylim(0, 1.3 * top)
    for x, t in zip(xs, bottom):
        clipped = t > 1.3 * top
        ax.text(x, min(t, 1.12 * top), gb_label(t) + (" ↑" if clipped else ""), ha="center",
                va="top" if clipped else "bottom", fontsize=8, fontweight="bold" if clipped else None,
                bbox=dict(facecolor="white", edgecolor="none", alpha=0.85, pad=1))
    labels = list(STAGE_NAMES[:n])
    for key in ("host", "nvme"):
        for i, v in enumerate(data.get(key, [0] * n)):
            if v:
                labels[i] += f"\n{key}: {gb_label(v / GB)}"
    ax.set_xticks(xs, labels)
    if capacity_gb:
        ax.axhline(capacity_gb, color="black", linestyle="--", linewidth=1.2,
                   label=f"{capacity_gb:g} GB GPU")   # named in the legend: a text on the line sat on a bar
    ax.set_ylabel("memory per GPU (GB = 1e9 bytes)")
    ax.set_xlabel("data-parallel strategy")
    ax.set_title(title or "Memory per GPU by stage")
    ax.legend(loc="upper center", bbox_to_anchor=(0.5, -0.16), fontsize=7, ncols=5 if capacity_gb else 4,
              frameon=False)   # under the axis: tall (clipped) bars reach the top of the plot
    return ax


def memory_bars(predicted, measured=None, ax=None, title=None,
                categories=("params", "grads", "optimizer", "buffers")):
    """Per-rank stacked bars: predicted (hatched, left) beside measured (solid, right).

    ``predicted``/``measured``: a list (one per rank) of mappings or objects with
    byte attributes ``params``, ``grads``, ``optimizer`` (``buffers`` optional),
    e.g. ``zl.estimate(...)`` results and ``engine.memory()`` reports. A single
    object is treated as one rank.
    """
    fig, ax = new_axes(ax)
    if not isinstance(predicted, (list, tuple)):
        predicted = [predicted]
    if measured is not None and not isinstance(measured, (list, tuple)):
        measured = [measured]
    width = 0.38 if measured is not None else 0.6
    series = [("predicted", predicted, "//", -width / 2 if measured is not None else 0)]
    if measured is not None:
        series.append(("measured", measured, None, width / 2))
    scale, unit = _unit(max(sum(_get(r, c) for c in categories) for _, rs, _, _ in series for r in rs))
    for name, ranks, hatch, dx in series:
        bottom = [0.0] * len(ranks)
        xs = [i + dx for i in range(len(ranks))]
        for cat in categories:
            vals = [_get(r, cat) / scale for r in ranks]
            if not any(vals):
                continue
            ax.bar(xs, vals, bottom=bottom, width=width, color=COLORS[cat], hatch=hatch,
                   edgecolor="white", label=cat if name == series[-1][0] else None)
            bottom = [b + v for b, v in zip(bottom, vals)]
        _label_bars(ax, xs, bottom, "{:.3g} " + unit)
    ax.set_xticks(range(len(predicted)), [f"rank {i}" for i in range(len(predicted))])
    pad = max(0.0, (3 - len(predicted)) / 2)           # keep one or two ranks from filling the axes
    ax.set_xlim(-0.5 - pad, len(predicted) - 0.5 + pad)
    ax.set_ylim(0, 1.3 * ax.get_ylim()[1])                # room for the legend
    ax.set_ylabel(f"bytes held ({unit})")
    ax.set_xlabel("rank" + ("   (left: predicted, hatched; right: measured)" if measured is not None else ""))
    ax.set_title(title or ("Memory per rank: predicted vs measured" if measured is not None
                           else "Memory per rank"))
    ax.legend(fontsize=8, loc="upper center", ncols=len(categories))
    return ax


def _unit(nbytes):
    for scale, unit in ((1e9, "GB"), (1e6, "MB"), (1e3, "kB")):
        if nbytes >= scale:
            return scale, unit
    return 1, "bytes"


# -- chapter 2 -----------------------------------------------------------------

def comm_bars(measured, expected=None, ax=None, title=None):
    """Bytes sent per rank, stacked by collective; ``expected`` (bytes) drawn as a line.

    ``measured``: list (one per rank) of ``{op: bytes}`` (``ledger.by_op()``) or of
    ledgers. ``expected``: one number for every rank, or a list per rank.
    """
    fig, ax = new_axes(ax)
    ranks = [m.by_op() if hasattr(m, "by_op") else dict(m) for m in measured]
    ops = sorted({op for r in ranks for op in r})
    scale, unit = _unit(max([sum(r.values()) for r in ranks] + [0] +
                            ([max(expected)] if isinstance(expected, (list, tuple)) else [expected or 0])))
    bottom = [0.0] * len(ranks)
    palette = ["#4C72B0", "#DD8452", "#55A868", "#C44E52", "#8172B3"]
    for i, op in enumerate(ops):
        vals = [r.get(op, 0) / scale for r in ranks]
        ax.bar(range(len(ranks)), vals, bottom=bottom, color=palette[i % 5], label=op, width=0.6)
        bottom = [b + v for b, v in zip(bottom, vals)]
    _label_bars(ax, range(len(ranks)), bottom)
    if expected is not None:
        exp = expected if isinstance(expected, (list, tuple)) else [expected] * len(ranks)
        ax.hlines([e / scale for e in exp], [i - 0.4 for i in range(len(ranks))],
                  [i + 0.4 for i in range(len(ranks))], colors="black", linewidth=2, label="formula")
    ax.set_ylim(0, 1.3 * (max(bottom + [e / scale for e in (exp if expected is not None else [])]) or 1))
    ax.set_xticks(range(len(ranks)), [f"rank {i}" for i in range(len(ranks))])
    ax.set_xlabel("rank")
    ax.set_ylabel(f"bytes sent ({unit})")
    ax.set_title(title or "Bytes each rank sent (ledger) vs formula")
    ax.legend(fontsize=8, loc="upper center", ncols=len(ops) + 1)
    return ax


def bandwidth_curves(links, n, op="all_reduce", sizes=None, ax=None, title=None):
    """Alpha-beta time of ``op`` on ``n`` ranks against tensor size, one line per link."""
    from zerolab.theory.network import get_link
    fig, ax = new_axes(ax)
    sizes = sizes or [int(10 ** (3 + 0.25 * i)) for i in range(29)]   # 1 kB .. 10 GB
    for link in links:
        link = get_link(link)
        ax.plot([s / 1e6 for s in sizes], [link.time(op, s, n) for s in sizes], label=str(link))
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlabel("tensor size (MB = 1e6 bytes)")
    ax.set_ylabel("time (s)")
    ax.set_title(title or f"{op} on N = {n} ranks: alpha-beta model")
    ax.grid(True, which="major", alpha=0.3)
    ax.legend(fontsize=7)
    return ax


# -- chapter 6 -----------------------------------------------------------------

KIND_COLORS = {"forward": "#4C72B0", "backward": "#55A868", "optimizer step": "#8172B3",
               "all-gather": "#DD8452", "reduce-scatter": "#C44E52", "all-reduce": "#CCB974",
               "all-to-all": "#937860", "broadcast": "#DA8BC3",   # one colour per kind, measured or replayed
               "grad reduction": "#C44E52", "param all-gather": "#DD8452"}   # book.runs' rows: as reduce/gather


def plot_timeline(events_per_rank, ax=None, title=None, colors=None, labels=None, ranks=None):
    """Gantt chart: one row per rank (or per ``labels`` entry), one box per event.

    ``events_per_rank``: list (one per row) of events, each a mapping with
    ``kind`` (e.g. "forward", "all_gather"), ``start`` and ``end`` in seconds
    (or a tuple ``(kind, start, end)``, or ``(kind, start, end, lane)`` as
    ``engine.events.spans`` gives them). Times are drawn relative to the earliest.
    ``labels``: row names (default "rank 0", "rank 1", ...).

    A ``zl.replay`` result (``theory.Replay``) is drawn the same way, from its
    ``lanes()`` — per rank a compute, an all-gather and a reduce-scatter row, as
    ``engine.events.lanes`` gives a measured run's — on an axis of *modelled* time;
    ``ranks``: only these ranks' rows (default all).
    """
    modelled = hasattr(events_per_rank, "lanes")
    if modelled:
        rep = events_per_rank
        rows_in, names = rep.lanes()
        per = len(rows_in) // max(1, len(rep.spans))       # lanes per rank
        keep = [i for i in range(len(rows_in)) if ranks is None or i // per in ranks]
        events_per_rank, labels = [rows_in[i] for i in keep], labels or [names[i] for i in keep]
        title = title or f"Replayed on {rep.cluster} (modelled): {rep.step_seconds * 1e3:.1f} ms per step"
    fig, ax = new_axes(ax, figsize=(8, 1 + 0.6 * len(events_per_rank)))
    rows = [[_event(e) for e in evs] for evs in events_per_rank]
    t0 = 0.0 if modelled else min((s for evs in rows for _, s, _ in evs), default=0.0)
    kinds = sorted({k for evs in rows for k, _, _ in evs})
    palette = ["#4C72B0", "#DD8452", "#55A868", "#C44E52", "#8172B3", "#937860", "#DA8BC3", "#8C8C8C"]
    colors = dict(colors or {})
    for k in kinds:                                   # a kind of its own gets a colour no other kind has
        if k not in colors:
            free = [c for c in palette if c not in colors.values()] or palette
            colors[k] = KIND_COLORS.get(k) if KIND_COLORS.get(k) not in (None, *colors.values()) else free[0]
    seen = set()                                      # one legend entry per kind
    for r, evs in enumerate(rows):
        for kind in kinds:
            spans = [((s - t0) * 1e3, (e - s) * 1e3) for k, s, e in evs if k == kind]   # ms
            if spans:
                ax.broken_barh(spans, (r - 0.35, 0.7), facecolors=colors[kind],
                               label=None if kind in seen else kind)
                seen.add(kind)
    ax.set_yticks(range(len(rows)), labels or [f"rank {r}" for r in range(len(rows))])
    ax.set_ylim(len(rows) - 0.5, -0.5)
    ax.set_xlabel("modelled time since the step began (ms)" if modelled else "time since first event (ms)")
    ax.set_ylabel("" if labels else "rank")
    ax.set_title(title or "Timeline per rank")
    if seen:
        ax.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.0, 1.0))
    return ax


def _event(e):
    if isinstance(e, dict):
        return e["kind"], float(e["start"]), float(e["end"])
    if hasattr(e, "kind"):
        return e.kind, float(e.start), float(e.end)
    kind, start, end = e[:3]
    return kind, float(start), float(end)
