"""Chapter 10's modern pipeline schedules (interleaved 1F1B, zero bubble): runs and the figure, kept out of the cells.

* ``train_runs([(kind, v), ...], steps, m)`` (one schedule: ``train_run(kind, v, steps, m)``): TinyGPT
  "micro" with 4 layers (untied head) on ``zl.launch``'s 2 ranks as a pipeline (``pipeline_stage(model, mesh, virtual=v)``), trained ``steps`` Adam steps of
  ``m`` micro-batches with ``train_batch(..., kind)``; returns the whole model's state (both ranks'
  parameters under their original names), the losses, per rank the sends, the Linears it holds, the
  deferred weight passes its last step's W operations ran and that step's trace (``train_batch(...,
  trace=)``: what ``zl.replay`` replays on a modelled cluster). ``reference(steps, m)``: the same steps
  in one process. ``max_difference(a, b)``: the largest |difference| between two states.
* ``SleepBlock``: a Linear that *sleeps* ``secs`` in forward, in B and in W (its W filed through
  ``pipeline_zb.deferred()`` under a split backward, else slept inside the backward), so that the
  measured timeline is the schedule's; ``timeline_run(kind, v, m)`` measures one step on 2 ranks.
* ``schedule_figure(p, m, v)``: the schedules' orders simulated with unit costs
  (``theory.bubble.simulate``), one panel per schedule, ranks as rows.
"""
from __future__ import annotations

import time

import torch
from torch import nn

from zerolab.parallel.pipeline import pipeline_stage, schedule, train_batch
from zerolab.parallel.pipeline_stats import pipeline_bubble
from zerolab.parallel.pipeline_zb import deferred
from zerolab.runtime.launch import launch
from zerolab.runtime.mesh import mesh as make_mesh
from zerolab.theory.bubble import simulate

LR, ROWS = 3e-3, 2


def gpt():
    from zerolab.book.models import TinyGPT
    return TinyGPT.preset("micro", n_layer=4, key_bias=False, tie_weights=False, seed=1)


def batches(model, step, m):
    from zerolab.book.models import synthetic_batch
    x, y = synthetic_batch(model, m * ROWS, seed=7, step=step)
    return [(x[i * ROWS:(i + 1) * ROWS], y[i * ROWS:(i + 1) * ROWS]) for i in range(m)]


def _train_worker(cases, steps, m):
    from zerolab.book.models import loss_fn
    mesh = make_mesh(pp=2)
    out = {}
    for kind, v in cases:
        model = gpt()
        stage = pipeline_stage(model, mesh, virtual=v)
        opt = torch.optim.Adam(stage.parameters(), lr=LR)
        losses, sent = [], mesh.ledger.count("send")
        trace = []                                      # the last step, traced for the replay on modelled GPUs
        for step in range(steps):
            opt.zero_grad()
            losses.append(train_batch(stage, mesh, batches(model, step, m), loss_fn, kind,
                                      trace=trace if step == steps - 1 else None))
            opt.step()
        out[kind] = {"state": {n: t.detach().clone() for n, t in stage.state_dict().items()}, "losses": losses,
                     "sends": mesh.ledger.count("send") - sent, "weight_passes": stage.pipeline_stats["weight_passes"],
                     "linears": sum(isinstance(q, nn.Linear) for q in stage.modules()), "trace": trace}
    return out


def train_runs(cases, steps: int = 3, m: int = 4) -> dict:
    """{kind: the pipeline's trained model} for each (kind, v) of ``cases``, one launch of 2 ranks
    (module docstring): {"state", "losses", "sends" per rank}."""
    results = launch(_train_worker, 2, args=(list(cases), steps, m), timeout=300, threads=1)
    return {kind: {"state": {**results[0][kind]["state"], **results[1][kind]["state"]},
                   "losses": results[0][kind]["losses"], "sends": [r[kind]["sends"] for r in results],
                   "weight_passes": [r[kind]["weight_passes"] for r in results],
                   "linears": [r[kind]["linears"] for r in results], "traces": [r[kind]["trace"] for r in results]}
            for kind, _ in cases}


def train_run(kind: str, v: int = 1, steps: int = 3, m: int = 4) -> dict:
    """One schedule's ``train_runs``."""
    return train_runs([(kind, v)], steps, m)[kind]


def reference(steps: int = 3, m: int = 4) -> dict:
    """The same training in one process: the model's state and the losses."""
    from zerolab.book.models import loss_fn
    model = gpt()
    opt = torch.optim.Adam(model.parameters(), lr=LR)
    losses = []
    for step in range(steps):
        opt.zero_grad()
        loss = sum(loss_fn(model(x), y) for x, y in batches(model, step, m)) / m
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return {"state": {n: t.detach().clone() for n, t in model.state_dict().items()}, "losses": losses}


def max_difference(a: dict, b: dict) -> float:
    if sorted(a) != sorted(b):
        raise AssertionError(f"the states hold different names: {sorted(set(a) ^ set(b))}")
    return max(float((a[n] - b[n]).abs().max()) for n in a)


# ---------------------------------------------------------------- the measured timeline, with sleeping blocks
class _Sleep(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, secs):
        ctx.secs, ctx.store = secs, deferred()
        time.sleep(secs)
        return x.view_as(x)

    @staticmethod
    def backward(ctx, g):
        time.sleep(ctx.secs)                                 # B
        if ctx.store is not None:
            ctx.store.append(lambda: time.sleep(ctx.secs))   # W, when the schedule splits the backward
        else:
            time.sleep(ctx.secs)                             # W inside the one backward
        return g, None


class SleepBlock(nn.Module):
    """A Linear + tanh that sleeps ``secs`` in forward, in B and in W."""

    def __init__(self, width=32, secs=0.02, seed=0):
        super().__init__()
        torch.manual_seed(seed)
        self.lin, self.secs = nn.Linear(width, width), secs

    def forward(self, x):
        return _Sleep.apply(torch.tanh(self.lin(x)), self.secs)


def _timeline_worker(kind, v, m, secs, steps):
    mesh = make_mesh(pp=2)
    model = nn.Sequential(*[SleepBlock(secs=secs, seed=k) for k in range(4)])
    stage = pipeline_stage(model, mesh, virtual=v)
    g = torch.Generator().manual_seed(1)
    data = [(torch.randn(4, 32, generator=g), torch.randn(4, 32, generator=g)) for _ in range(m)]
    out = []
    for _ in range(steps + 1):                     # the first step warms up connections and threads
        torch.distributed.barrier()
        train_batch(stage, mesh, data, nn.functional.mse_loss, kind)
        out.append(stage.pipeline_stats)
    return out[1:]


def timeline_run(kind: str, v: int = 1, m: int = 4, secs: float = 0.1, steps: int = 2) -> dict:
    """Measured on 2 ranks: per step the bubble over both ranks (``pipeline_bubble``), and the last
    step's per-rank stats."""
    res = launch(_timeline_worker, 2, args=(kind, v, m, secs, steps), timeout=300, threads=1)
    return {"bubbles": [pipeline_bubble([r[k] for r in res]) for k in range(steps)], "stats": [r[-1] for r in res]}


# ---------------------------------------------------------------- the figure
COLORS = {"F": "#4C72B0", "B": "#DD8452", "W": "#55A868"}
KINDS = (("1f1b", 1), ("interleaved", 2), ("zb-h1", 1))


def schedule_figure(p: int = 4, m: int = 8, v: int = 2):
    """Per schedule, its per-rank orders simulated with f = b = w = 1 (one forward pass = 1 time unit)."""
    from zerolab.book.plots import new_axes
    from matplotlib.patches import Rectangle
    from zerolab.theory.bubble import idle_time
    fig, _ = new_axes(figsize=(10, 6))
    fig.clear()
    axes = fig.subplots(len(KINDS), 1, sharex=True)
    parts = []
    for ax, (kind, vv) in zip(axes, KINDS):
        vv = v if kind == "interleaved" else 1
        timeline = simulate([schedule(kind, m, p, s, vv) if vv > 1 else schedule(kind, m, p, s) for s in range(p)],
                            vv)
        for r, ops in enumerate(timeline):
            for op, i, c, a, e in ops:
                ax.add_patch(Rectangle((float(a), r - 0.4), float(e - a), 0.8, facecolor=COLORS[op],
                                       edgecolor="white", linewidth=0.5, alpha=0.6 + 0.4 * (c == 0)))
                ax.text(float(a + e) / 2, r, str(i), ha="center", va="center", fontsize=6, color="white")
        end = max(float(e[4]) for ops in timeline for e in ops)
        idle = idle_time(timeline)
        ax.set_xlim(0, 3 * m + 3 * (p - 1) + 0.5)                 # 1F1B's step: the longest
        ax.set_ylim(p - 0.5, -0.5)
        ax.set_yticks(range(p), [f"rank {r}" for r in range(p)], fontsize=7)
        ax.set_ylabel("rank", fontsize=7)
        label = f"{kind}" + (f" (v = {vv} chunks per rank; pale: chunk 1)" if vv > 1 else "")
        ax.set_title(f"{label}: step {end:g} units, idle {float(idle):g} per rank", fontsize=8)
        parts.append(f"{kind}: step {end:g} time units, idle {float(idle):g} per rank")
    axes[-1].set_xlabel("time (units of one forward pass of a stage; F blue, B orange, W green)", fontsize=8)
    fig.suptitle(f"Pipeline schedules simulated with unit costs: p = {p} ranks, m = {m} micro-batches", fontsize=9)
    return fig, "Gantt charts of three pipeline schedules, simulated. " + "; ".join(parts) + "."
