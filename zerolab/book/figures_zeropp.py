"""ZeRO++'s topology drawn from the runtime's own node layout (chapter 9).

``topology_figure(n, k, hpz)``: N ranks as nodes of K (``runtime.nodes.node_layout``,
the lists the communicator turns into process groups). Each rank is a box holding its
primary shard (1/N of the parameters, index = rank) and, with hpZ, its secondary shard
(1/H, index = rank mod H inside its node). Lines mark the groups: the intra-node groups
(backward all-gather under hpZ, qgZ's first all-to-all) and the inter-node groups (qgZ's
second all-to-all).

``tier_bytes_figure(measured)``: per variant (ZeRO-3, qwZ, hpZ, qgZ, ZeRO++), the bytes one rank
sends per step inside its node and across nodes, as the ledger measured them in a run of
``zerolab.book.zeropp.measure_variants``, beside ``comm_breakdown``'s prediction for the same units.

Each returns ``(fig, alt)`` for ``plots.show(fig, alt=alt)``.
"""
from __future__ import annotations

from matplotlib.patches import Rectangle

from zerolab.book.plots import new_axes
from zerolab.runtime.nodes import node_layout


def topology_figure(n: int = 8, k: int = 4, hpz: int | None = None):
    """The ranks, their primary and secondary shards, and which groups stay inside a node."""
    hpz = hpz or k
    intra, inter = node_layout(n, k)
    fig, ax = new_axes(figsize=(max(6.0, 2.2 + 1.7 * k), 1.6 + 1.1 * len(intra)))
    for node, ranks in enumerate(intra):
        y = -node * 1.6
        ax.add_patch(Rectangle((-0.3, y - 0.35), k + 0.4, 1.2, fill=False, linestyle="--", color="gray"))
        ax.text(-0.5, y + 0.25, f"node {node}", ha="right", va="center", fontsize=8)
        for b, r in enumerate(ranks):
            ax.add_patch(Rectangle((b, y), 0.8, 0.7, color="tab:blue", alpha=0.25))
            ax.text(b + 0.4, y + 0.5, f"rank {r}", ha="center", fontsize=7)
            ax.text(b + 0.4, y + 0.25, f"primary {r}/{n}", ha="center", fontsize=6)
            ax.text(b + 0.4, y + 0.05, f"secondary {r % hpz}/{hpz}", ha="center", fontsize=6, color="tab:green")
    for b, ranks in enumerate(inter):      # box edge to box edge: the line never crosses a box's text
        for a in range(len(ranks) - 1):
            ax.plot([b + 0.4] * 2, [-a * 1.6, -(a + 1) * 1.6 + 0.7], color="tab:red", lw=1.5)
    ax.set_xlim(-1.4, k + 0.3)
    ax.set_ylim(-1.6 * len(intra) + 0.9, 1.0)
    ax.axis("off")
    ax.set_title(f"ZeRO++ on {len(intra)} nodes x {k}. Dashed: a node (forward gather over all {n};\n"
                 f"backward gather from the secondary, inside it). Red: the inter-node groups", fontsize=8)
    alt = (f"{n} ranks drawn as {len(intra)} nodes of {k}. Each rank holds primary shard r of {n} and secondary "
           f"shard r mod {hpz} of {hpz}. The intra-node groups are {intra}; the inter-node groups, drawn as red "
           f"lines, are {inter}. The forward all-gather spans all {n} ranks; with hpZ the backward all-gather "
           f"stays in the node; qgZ reduces gradients inside the node, then across the red groups.")
    return fig, alt


def tier_bytes_figure(measured: dict, title: str | None = None):
    """Stacked bars per variant: intra- and inter-node bytes per rank and step, measured beside predicted."""
    fig, ax = new_axes(figsize=(9, 4.0))
    names = list(measured)
    sources = (("measured (ledger)", lambda r: r, None), ("predicted (comm_breakdown)", lambda r: r["predicted"], "//"))
    for j, (label, get, hatch) in enumerate(sources):
        xs = [i + (j - 0.5) * 0.38 for i in range(len(names))]
        intra = [get(measured[n])["intra"] / 1e3 for n in names]
        inter = [get(measured[n])["inter"] / 1e3 for n in names]
        ax.bar(xs, intra, 0.36, color="tab:blue", alpha=0.9 if hatch is None else 0.45, hatch=hatch,
               edgecolor="white", label=f"inside the node, {label}")
        ax.bar(xs, inter, 0.36, bottom=intra, color="tab:red", alpha=0.9 if hatch is None else 0.45, hatch=hatch,
               edgecolor="white", label=f"across nodes, {label}")
    base = measured[names[0]]["inter"]
    for i, n in enumerate(names):
        top = (measured[n]["intra"] + measured[n]["inter"]) / 1e3
        ax.text(i - 0.19, top, f"{base / measured[n]['inter']:.1f}x less\nacross" if i else "reference",
                ha="center", va="bottom", fontsize=7)
    ax.set_xticks(range(len(names)), names)
    ax.set_ylabel("kB one rank sends per step (algorithm bytes)")
    ax.set_title(title or "Bytes per tier: the ledger's (solid) beside the model's (hatched)", fontsize=10)
    ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.0, 1.0))

    def said(n):
        r, p = measured[n], measured[n]["predicted"]
        same = (r["intra"], r["inter"]) == (p["intra"], p["inter"])
        return (f"{n} {r['intra']:,.0f} inside the node and {r['inter']:,.0f} across"
                + (" (predicted: the same)" if same else f" (predicted: {p['intra']:,} and {p['inter']:,})"))
    alt = (f"Bars of the bytes one rank sends per training step, split into inside-the-node and across-nodes, "
           f"for {', '.join(names)}, measured by the communication ledger beside comm_breakdown's prediction: "
           + "; ".join(said(n) for n in names)
           + f". {names[-1]} sends {base / measured[names[-1]]['inter']:.1f} times fewer bytes across nodes than "
           f"{names[0]}.")
    return fig, alt
