"""Chapter 10's pipeline lessons on modelled GPUs: the laptop's traced step beside its replay, the schedules'
bubble replayed at a target's size (``theory/replay_pipe.py``, ``theory/replay_time3d.py``).

* ``bubble_table(p, m, v, model, clusters)``: per schedule (GPipe, 1F1B, interleaved with v chunks,
  ZB-H1) its orders (``parallel.schedule``) replayed at ``model``'s size on each cluster (a preset name
  and the ranks per node the stages sit at: 1 puts each stage on its own node), and on a cluster with
  free sends, with the formula (``theory.bubble.bubble_fraction``) at the replay's own F, B, W costs.
* ``side_by_side(stages, rep)``: the laptop's measured step (``runs3d.bubble_run``'s per-stage list)
  above the replay of that step's trace (``zl.replay``'s ``PipeReplay``).
"""
from __future__ import annotations

from zerolab.parallel.pipeline_schedule import schedule
from zerolab.theory.bubble import bubble_fraction
from zerolab.theory.hardware import HARDWARE
from zerolab.theory.network import Link
from zerolab.theory.nodes import Node
from zerolab.theory.replay_cluster import Cluster
from zerolab.theory.replay_pipe import orders_trace, replay_pipeline

KINDS = (("gpipe", 1), ("1f1b", 1), ("interleaved", 2), ("zb-h1", 1))
# one DGX H100 whose sends cost nothing: infinite bandwidth, no latency (the formulas' assumption)
FREE = Cluster(HARDWARE["dgx-h100"].with_(name="DGX H100, free sends",
                                          node=Node("free", 8, 8, 1e30, Link("free", 1e30, 0.0), 0.0)))


def orders(kind: str, m: int, p: int, v: int = 1) -> list:
    return [schedule(kind, m, p, s, v) if v > 1 else schedule(kind, m, p, s) for s in range(p)]


def bubble_table(p=4, m=8, v=2, model="llama-2-7b", clusters=(("dgx-h100", None), ("cloud-100gbe:4", 1))) -> list:
    """Rows {"kind", "v", "formula", "free", cluster name: replayed bubble, cluster name + " step": seconds}."""
    rows = []
    for kind, vv in KINDS:
        vv = v if kind == "interleaved" else 1
        row = {"kind": kind, "v": vv}
        for name, rpn in (("free", None),) + tuple(clusters):
            tr = orders_trace(orders(kind, m, p, vv), 1, 1, 1 if kind == "zb-h1" else 0, nbytes=1, v=vv,
                              ranks_per_node=rpn)
            rep = replay_pipeline(tr, FREE if name == "free" else name, model=model)
            row[name], row[name + " step"] = rep.bubble, rep.step_seconds
            if name == "free":
                cost = {op: (e - s) * vv for op, _, _, s, e in rep.ops[0]}
                f, b, w = cost["F"], cost["B"], cost.get("W", 0.0)
                if kind != "zb-h1":
                    b, w = b / 2, b / 2
                row["formula"] = float(bubble_fraction(kind, p, m, vv, f, b, w))
        rows.append(row)
    return rows


def side_by_side(stages: list, rep, name: str = "1F1B"):
    """Two panels: the laptop's measured step (seconds) and its trace replayed (``rep``, ms)."""
    from matplotlib.patches import Rectangle
    from zerolab.book.plots import new_axes
    fig, _ = new_axes(figsize=(10, 1.6 + 2.4 * len(stages) / 4 * 2))
    fig.clear()
    top, bottom = fig.subplots(2, 1)
    for s, st in enumerate(stages):
        counts = {"F": 0, "B": 0}
        for kind, a, e in st["events"]:
            top.add_patch(Rectangle((a, s - 0.35), e - a, 0.6, color="C0" if kind == "F" else "C1"))
            top.text((a + e) / 2, s - 0.05, str(counts[kind]), ha="center", va="center", fontsize=7, color="white")
            counts[kind] += 1
    step = stages[0]["step"]
    top.set_xlim(0, step * 1.01)
    top.set_ylim(len(stages) - 0.5, -0.5)
    top.set_yticks(range(len(stages)), [f"rank {s}" for s in range(len(stages))])
    top.set_xlabel("measured wall time on this laptop (s; sleeping blocks)")
    top.set_title(f"{name} on this laptop (measured): step {step:.2f} s, bubble {100 * stages[0]['bubble']:.1f} %",
                  fontsize=9)
    rep.plot(ax=bottom, title=f"The same trace replayed at Llama-2-7B's size on {rep.cluster} (modelled): "
                              f"step {rep.step_seconds * 1e3:.0f} ms, bubble {100 * rep.bubble:.1f} %")
    bottom.title.set_fontsize(9)
    alt = (f"Two Gantt charts of the same {name} pipeline step, ranks as rows, F in blue and B in orange "
           f"numbered by micro-batch. Top: measured on this laptop, {step:.2f} s, bubble "
           f"{100 * stages[0]['bubble']:.1f} %. Bottom: its trace replayed on {rep.cluster} at Llama-2-7B's "
           f"size, {rep.step_seconds * 1e3:.0f} ms, bubble {100 * rep.bubble:.1f} %, sends as thin black bars.")
    return fig, alt
