"""Conceptual figures for collectives across ranks and nodes (chapter 2), drawn from zerolab's state.

* ``ring_figure``: a ring all-reduce step by step — which ranks' contributions each rank
  holds in each chunk, read from ``ring.ring_allreduce_states`` (the stepper's own
  simulation): N−1 reduce-scatter steps, then N−1 all-gather steps.
* ``node_ring_figure``: N ranks on nodes of K, the ring's links, and which of them cross a
  node boundary — the rule the ledger uses to split a flat collective's bytes into
  intra- and inter-node (``runtime.nodes.inter_fraction``).

Each returns ``(fig, alt)`` for ``plots.show(fig, alt=alt)``, as ``zerolab.book.figures`` does.
"""
from __future__ import annotations

import math

from zerolab.book.ring import ring_allreduce_states
from zerolab.runtime.nodes import inter_fraction


def ring_figure(n: int = 4):
    """One panel per state (2(N−1)+1): rows are ranks, columns chunks, shade = share of ranks summed in."""
    from matplotlib.figure import Figure
    states = ring_allreduce_states(n)
    fig = Figure(figsize=(1.45 * len(states) + 0.6, 2.8), layout="constrained")   # square panels: width sets height
    axes = fig.subplots(1, len(states), squeeze=False)[0]
    for k, (ax, state) in enumerate(zip(axes, states)):
        grid = [[len(state[r][c]) / n for c in range(n)] for r in range(n)]
        ax.imshow(grid, cmap="Blues", vmin=0, vmax=1)
        for r in range(n):
            for c in range(n):
                ax.text(c, r, str(len(state[r][c])), ha="center", va="center", fontsize=8,
                        color="white" if grid[r][c] > 0.6 else "black")
        phase = "start" if k == 0 else ("reduce-scatter" if k <= n - 1 else "all-gather")
        ax.set_title(f"{phase}\nstep {k}", fontsize=8)
        ax.set_xticks(range(n), [f"c{c}" for c in range(n)], fontsize=7)
        ax.set_yticks(range(n), [f"rank {r}" for r in range(n)] if k == 0 else [], fontsize=7)
    fig.suptitle(f"Ring all-reduce on {n} ranks: how many ranks' contributions each copy of each chunk holds",
                 fontsize=9)
    fig.supxlabel("chunk of the tensor (c0 ... c{}); shade and number: contributions summed in, of {}".format(n - 1, n),
                  fontsize=8)
    done = [(r, c) for r in range(n) for c in range(n) if len(states[n - 1][r][c]) == n]
    alt = (f"Ring all-reduce on {n} ranks, {len(states) - 1} steps: each panel is a rank-by-chunk grid "
           f"whose number is how many ranks' contributions that copy holds. After the {n - 1} reduce-scatter "
           f"steps each rank holds one fully summed chunk ("
           + ", ".join(f"rank {r}: chunk {c}" for r, c in done)
           + f"); after {n - 1} more all-gather steps every rank holds all {n} summed chunks.")
    return fig, alt


def node_ring_figure(n: int = 8, k: int = 4, op: str = "all_reduce"):
    """Ranks on a circle in ring order, grouped by node; links that cross a node boundary drawn red."""
    from matplotlib.figure import Figure
    fig = Figure(figsize=(4.6, 4.6), layout="constrained")
    ax = fig.subplots()
    pos = [(math.cos(2 * math.pi * r / n + math.pi / 2), math.sin(2 * math.pi * r / n + math.pi / 2)) for r in range(n)]
    crossing = [r for r in range(n) if r // k != ((r + 1) % n) // k]
    for r in range(n):
        (x0, y0), (x1, y1) = pos[r], pos[(r + 1) % n]
        ax.annotate("", (x1, y1), (x0, y0), arrowprops=dict(
            arrowstyle="-|>", lw=2.4 if r in crossing else 1.2, color="tab:red" if r in crossing else "tab:gray",
            shrinkA=13, shrinkB=13))
    colors = ["tab:blue", "tab:green", "tab:orange", "tab:purple", "tab:brown", "tab:olive"]
    for r, (x, y) in enumerate(pos):
        ax.scatter([x], [y], s=520, color=colors[(r // k) % len(colors)], zorder=3)
        ax.text(x, y, str(r), ha="center", va="center", color="white", fontsize=10, zorder=4)
    share = inter_fraction(op, list(range(n)), 0, k)
    ax.set_title(f"{n} ranks, {k} per node: {len(crossing)} of {n} ring links cross nodes\n"
                 f"inter_fraction = {share:g} of each rank's {op} bytes", fontsize=9)
    ax.set_xlim(-1.35, 1.35), ax.set_ylim(-1.35, 1.35), ax.set_aspect("equal"), ax.axis("off")
    alt = (f"{n} ranks drawn on a ring in rank order, coloured by node ({n // k} nodes of {k}). "
           f"{len(crossing)} of the {n} ring links join two nodes (drawn red: "
           + ", ".join(f"{r}->{(r + 1) % n}" for r in crossing)
           + f"), so the ledger books {share:g} of every rank's ring bytes as inter-node and the rest as intra-node.")
    return fig, alt
