"""Chapter 10's figures: the 3-D mesh drawn from the runtime's own layout, and pipeline timelines.

``mesh_figure(infos, n_layer)``: ``infos`` is what ``zerolab.book.runs3d.mesh_info`` returned on every
rank of a launch (``zl.mesh``'s coordinates and node, rank by rank). Each rank is a box inside its
node, saying which layers it holds (its PP stage's share of ``n_layer``, by
``zerolab.parallel.split_blocks``), which TP shard of them, and which ZeRO shard (its DP index) of
that slice; TP groups are joined by a thick line, DP groups by a dashed one across nodes.

``timeline_figure(runs)``: per schedule, per stage, the forwards and backwards that
``runs3d.bubble_run`` timed, as a Gantt chart (white is the bubble).

Each returns ``(fig, alt)`` for ``plots.show(fig, alt=alt)``.
"""
from __future__ import annotations

from matplotlib.patches import Rectangle

from zerolab.book.plots import new_axes
from zerolab.parallel import split_blocks

STAGE_COLORS = ("#4C72B0", "#DD8452", "#55A868", "#C44E52", "#8172B3", "#937860", "#DA8BC3", "#8C8C8C")


def mesh_cells(infos: list, n_layer: int) -> list:
    """One line of text per rank: (rank, node, label lines) — what the figure writes in each box."""
    dp = 1 + max(i["dp"] for i in infos)
    tp = 1 + max(i["tp"] for i in infos)
    pp = 1 + max(i["pp"] for i in infos)
    bounds = split_blocks(n_layer, pp)
    out = []
    for i in sorted(infos, key=lambda i: i["rank"]):
        lo, hi = bounds[i["pp"]]
        out.append((i["rank"], i["node"], [f"rank {i['rank']}",
                                          f"PP stage {i['pp']}: " + (f"layers {lo}-{hi - 1}" if hi - lo > 1
                                                                     else f"layer {lo}"),
                                          f"TP shard {i['tp']}/{tp}",
                                          f"ZeRO shard {i['dp']}/{dp}"]))
    return out


def mesh_figure(infos: list, n_layer: int = 4):
    """The mesh, one box per rank, nodes as dashed frames (module docstring)."""
    infos = sorted(infos, key=lambda i: i["rank"])
    nodes = sorted({i["node"] for i in infos})
    k = len(infos) // len(nodes)
    cells = mesh_cells(infos, n_layer)
    fig, ax = new_axes(figsize=(10, 1.0 + 1.9 * len(nodes)))
    pos = {}
    for (rank, node, lines), info in zip(cells, infos):
        x, y = (rank % k) * 1.25, -node * 2.0
        pos[rank] = (x, y)
        ax.add_patch(Rectangle((x, y), 1.05, 1.2, color=STAGE_COLORS[info["pp"] % len(STAGE_COLORS)], alpha=0.22))
        for j, line in enumerate(lines):
            ax.text(x + 0.52, y + 1.02 - 0.27 * j, line, ha="center", va="center", fontsize=7,
                    weight="bold" if j == 0 else "normal")
    for node in nodes:
        ax.add_patch(Rectangle((-0.1, -node * 2.0 - 0.25), k * 1.25 + 0.0, 1.65, fill=False, ls="--", color="gray"))
        ax.text(-0.2, -node * 2.0 + 0.6, f"node {node}", ha="right", va="center", fontsize=8)
    groups = {g: sorted({tuple(i["groups"][g]) for i in infos}) for g in ("tp", "dp", "pp")}
    for g in groups["tp"]:
        if len(g) > 1:
            xs = [pos[r][0] + 0.52 for r in g]
            ax.plot(xs, [pos[g[0]][1] - 0.08] * len(g), color="black", lw=3, solid_capstyle="butt")
    for g in groups["dp"]:
        if len(g) > 1:
            ax.plot([pos[r][0] + 0.9 for r in g], [pos[r][1] + 0.1 for r in g], color="tab:red", lw=1, ls=":")
    ax.set_xlim(-1.2, k * 1.25 + 0.1)
    ax.set_ylim(-2.0 * len(nodes) + 1.5, 1.5)
    ax.axis("off")
    sizes = {g: len(groups[g][0]) for g in groups}
    ax.set_title(f"zl.mesh(dp={sizes['dp']}, tp={sizes['tp']}, pp={sizes['pp']}) on {len(infos)} ranks, "
                 f"{len(nodes)} nodes x {k}: colour = PP stage, black bar = a TP group (inside a node), "
                 f"red dotted = a DP group (ZeRO shards over it)", fontsize=8)
    alt = (f"{len(infos)} ranks in {len(nodes)} nodes of {k}. " + " ".join(
        f"Rank {r} on node {n}: {', '.join(lines[1:])}." for r, n, lines in cells)
        + f" TP groups {[list(g) for g in groups['tp']]}, PP groups {[list(g) for g in groups['pp']]}, "
          f"DP groups {[list(g) for g in groups['dp']]}.")
    return fig, alt


def timeline_figure(runs: dict):
    """``runs``: {schedule name: bubble_run's per-stage list}. One panel per schedule, stages as rows."""
    fig, axes = new_axes(figsize=(10, 1.2 + 1.3 * len(runs)))
    fig.clear()
    axes = fig.subplots(len(runs), 1, squeeze=False)[:, 0]
    parts = []
    for ax, (name, stages) in zip(axes, runs.items()):
        for s, st in enumerate(stages):
            f = b = 0
            for kind, a, e in st["events"]:
                i = f if kind == "F" else b
                ax.add_patch(Rectangle((a, s - 0.4), e - a, 0.8, color="tab:blue" if kind == "F" else "tab:orange",
                                       alpha=0.8 if kind == "F" else 0.6))
                ax.text((a + e) / 2, s, str(i), ha="center", va="center", fontsize=6, color="white")
                f, b = f + (kind == "F"), b + (kind == "B")
        step = stages[0]["step"]
        ax.set_xlim(0, step * 1.01)
        ax.set_ylim(len(stages) - 0.5, -0.5)
        ax.set_yticks(range(len(stages)), [f"stage {s}" for s in range(len(stages))], fontsize=7)
        idle = sum(st["idle"] for st in stages) / len(stages)
        peaks = [st["peak"] for st in stages]
        ax.set_title(f"{name}: idle {idle:.0%} of the step (measured), most micro-batches in flight per stage "
                     f"{peaks} (blue forward, orange backward, white the bubble)", fontsize=8)
        ax.set_xlabel("seconds from the step's first forward", fontsize=7)
        parts.append(f"{name}: step {step:.2f} s, mean idle fraction {idle:.2f}, in flight {peaks}")
    alt = "Gantt charts of a pipeline step per stage, measured. " + "; ".join(parts) + "."
    return fig, alt
