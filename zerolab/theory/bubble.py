"""The pipeline bubble by arithmetic: each schedule's formula, and its per-rank orders simulated (chapter 10).

A pipeline schedule gives each of the ``p`` ranks an order of operations ("F" | "B" | "W",
micro-batch[, chunk]) (``zerolab.parallel.schedule``). ``simulate(orders, v, f, b, w)`` runs
those orders with fixed costs — each rank in its own order, each operation as soon as what it
needs is done — and returns every operation's start and end: nothing else is modelled (no
sends, no memory). Costs are per stage of ``1/p`` of the model: a forward ``f``, the
input-gradient pass ``b``, the weight-gradient pass ``w``; a schedule without "W" runs the whole
backward as one "B" of ``b + w``; with ``v`` chunks per rank (interleaved) each chunk's pass costs
1/v of that. Dependencies (virtual stage j = chunk·p + rank, V = p·v of them):
F(i, j) after F(i, j-1); B(i, j) after F(i, j) and B(i, j+1); W(i, j) after B(i, j).

``bubble_time(kind, p, m, v, f, b, w)``: the idle time per rank the papers give —
GPipe and 1F1B (p-1)(f+b+w) (Huang et al. 2019; Narayanan et al. 2021); interleaved 1F1B
(p-1)(f+b+w)/v (Narayanan et al. 2021, section 2.2.2); ZB-H1 (p-1)(f+b-w) (Qi et al. 2023,
"Zero Bubble Pipeline Parallelism"; written (PP-1)(F+B-2W) with B the whole backward in
DeepSeek's DualPipe README). ``bubble_fraction``: that over the step, idle + m(f+b+w):
(p-1)/(m+p-1) for GPipe and 1F1B, (p-1)/(v·m+p-1) interleaved.
"""
from __future__ import annotations

from fractions import Fraction

KINDS = ("gpipe", "1f1b", "interleaved", "zb-h1")


def _action(a):
    op, i, *rest = a
    return op, i, (rest[0] if rest else 0)


def simulate(orders, v: int = 1, f=1, b=1, w=1) -> list:
    """Per rank, its operations as (op, micro_batch, chunk, start, end), exact (Fractions); a ValueError
    naming the stuck ranks when the orders deadlock (module docstring)."""
    p = len(orders)
    V = p * v
    split = any(_action(a)[0] == "W" for order in orders for a in order)
    cost = {"F": Fraction(f) / v, "B": Fraction(b if split else b + w) / v, "W": Fraction(w) / v}
    done, pos, free = {}, [0] * p, [Fraction(0)] * p
    out = [[] for _ in range(p)]
    progress = True
    while progress:
        progress = False
        for r in range(p):
            while pos[r] < len(orders[r]):
                op, i, c = _action(orders[r][pos[r]])
                if op not in cost or not 0 <= c < v:
                    raise ValueError(f"simulate: rank {r}'s operation {orders[r][pos[r]]} is not (F|B|W, "
                                     f"micro-batch, chunk < {v})")
                j = c * p + r
                needs = {"F": [("F", i, j - 1)] if j > 0 else [],
                         "B": [("F", i, j)] + ([("B", i, j + 1)] if j < V - 1 else []),
                         "W": [("B", i, j)]}[op]
                if any(d not in done for d in needs):
                    break
                start = max([free[r]] + [done[d] for d in needs])
                free[r] = done[(op, i, j)] = start + cost[op]
                out[r].append((op, i, c, start, free[r]))
                pos[r] += 1
                progress = True
    stuck = [r for r in range(p) if pos[r] < len(orders[r])]
    if stuck:
        raise ValueError(f"simulate: the orders deadlock: rank(s) {stuck} wait forever at "
                         f"{[orders[r][pos[r]] for r in stuck]}")
    return out


def idle_time(timeline) -> Fraction:
    """Idle time per rank over the step (first start to last end anywhere); the same on every rank when
    every rank does the same work (asserted: a ValueError otherwise)."""
    t0 = min(e[3] for ops in timeline for e in ops)
    t1 = max(e[4] for ops in timeline for e in ops)
    idles = {t1 - t0 - sum(e[4] - e[3] for e in ops) for ops in timeline}
    if len(idles) != 1:
        raise ValueError(f"idle_time: the ranks do unequal work (idle times {sorted(idles)})")
    return idles.pop()


def bubble_time(kind: str, p: int, m: int, v: int = 1, f=1, b=1, w=1) -> Fraction:
    """The idle time per rank the schedule's paper gives (module docstring)."""
    if kind not in KINDS:
        raise ValueError(f"bubble_time: kind must be one of {KINDS}, got {kind!r}")
    f, b, w = Fraction(f), Fraction(b), Fraction(w)
    if kind in ("gpipe", "1f1b"):
        return (p - 1) * (f + b + w)
    if kind == "interleaved":
        return (p - 1) * (f + b + w) / v
    return (p - 1) * (f + b - w)


def bubble_fraction(kind: str, p: int, m: int, v: int = 1, f=1, b=1, w=1) -> Fraction:
    """The bubble's share of the step: idle / (idle + m(f + b + w))."""
    idle = bubble_time(kind, p, m, v, f, b, w)
    return idle / (idle + m * (Fraction(f) + Fraction(b) + Fraction(w)))
