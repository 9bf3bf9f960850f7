"""Helpers for exercise 9 (the 1F1B schedule, chapter 10): the learner's per-stage orders checked as
rules, replayed on a model pipeline, and run on real ranks.

* ``order_problems(order, p, m, s)``: what is wrong with one stage's order (empty: fine) — every
  forward and backward exactly once, a micro-batch's backward after its forward, forwards and
  backwards each in micro-batch order, at most ``p - s`` micro-batches in flight.
* ``replay`` (``zerolab.book.runs3d``): the step of all stages' orders with unit costs; ``None``
  when they deadlock.
* ``train_with_orders(orders)``: ``len(orders)`` real ranks as a pipeline of Linear + Tanh blocks
  (``zerolab.parallel.train_batch``) run the given orders instead of the package's; returns the
  largest difference between their gradients and one process's. A deadlocking order would hang
  there: check it with ``replay`` first.
"""
from __future__ import annotations

import torch
from torch import nn

from zerolab.book.runs3d import replay

__all__ = ["order_problems", "replay", "train_with_orders", "in_flight"]


def in_flight(order) -> int:
    """The most micro-batches whose forward has run and whose backward has not, along ``order``."""
    live = peak = 0
    for op, _ in order:
        live += 1 if op == "F" else -1
        peak = max(peak, live)
    return peak


def order_problems(order, p: int, m: int, s: int) -> list:
    where = f"p={p}, m={m}, stage {s}"
    if not isinstance(order, list) or not all(isinstance(x, tuple) and len(x) == 2 for x in order):
        return [f"{where}: the order must be a list of (\"F\" | \"B\", micro-batch) tuples, got {order!r:.80}"]
    problems = []
    want = sorted([("F", i) for i in range(m)] + [("B", i) for i in range(m)])
    if sorted(order) != want:
        problems.append(f"{where}: each of the {m} forwards and backwards must appear exactly once; got {order}")
        return problems
    pos = {x: k for k, x in enumerate(order)}
    late = [i for i in range(m) if pos[("B", i)] < pos[("F", i)]]
    if late:
        problems.append(f"{where}: backward of micro-batch {late[0]} comes before its forward: {order}")
    for kind in ("F", "B"):
        seq = [i for op, i in order if op == kind]
        if seq != sorted(seq):
            problems.append(f"{where}: the {kind} steps must run in micro-batch order, got {seq}")
    if in_flight(order) > p - s:
        problems.append(f"{where}: {in_flight(order)} micro-batches in flight, 1F1B allows at most p - s = {p - s}: "
                        f"{order}")
    return problems


def _blocks(p, width=8, seed=3):
    torch.manual_seed(seed)
    return nn.Sequential(*[nn.Sequential(nn.Linear(width, width), nn.Tanh()) for _ in range(p)])


def _batches(m, width=8, rows=3):
    g = torch.Generator().manual_seed(11)
    return [(torch.randn(rows, width, generator=g), torch.randn(rows, width, generator=g)) for _ in range(m)]


def _mse(y, t):
    return ((y - t) ** 2).mean()


def _orders_worker(orders):
    import sys

    from zerolab.parallel import pipeline_stage, train_batch
    from zerolab.runtime.mesh import mesh as make_mesh
    p = len(orders)
    mesh = make_mesh(pp=p)
    # this rank (a process of its own) runs the learner's order: replace the schedule where train_batch finds it
    sys.modules[train_batch.__module__].schedule = lambda kind, m, pp, s: orders[s]
    stage = pipeline_stage(_blocks(p), mesh)
    train_batch(stage, mesh, _batches(len(orders[0]) // 2), _mse, "1f1b")
    return {n: prm.grad.clone() for n, prm in stage.named_parameters()}


def train_with_orders(orders, timeout: float = 60) -> float:
    """Largest |gradient difference| between the pipeline run with ``orders`` and one process."""
    from zerolab.runtime.launch import launch
    p, m = len(orders), len(orders[0]) // 2
    got = {}
    for part in launch(_orders_worker, p, args=(orders,), timeout=timeout, threads=1):
        got.update(part)
    model = _blocks(p)
    (sum(_mse(model(x), t) for x, t in _batches(m)) / m).backward()
    want = dict(model.named_parameters())
    if sorted(got) != sorted(want):
        raise AssertionError(f"the stages hold {sorted(got)}, the model {sorted(want)}")
    return max(float((got[n] - want[n].grad).abs().max()) for n in want)
