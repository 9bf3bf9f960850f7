"""Profiling one training step with torch.profiler: communication share and MFU (chapter 13).

``profile_step`` runs inside every rank of ``zl.launch``: it trains a ``TinyGPT``
preset with ``zl.initialize`` for a few warm-up steps, then records the next
``steps`` under ``torch.profiler`` and returns a summary (nothing is printed in
the children):

* ``step_seconds``: wall time per step, measured around the profiled steps;
* ``comm_seconds``: the profiler's self CPU time of the collectives per step
  (events named by the process-group backend: ``gloo:``, ``nccl:``, ``c10d::``
  and ``record_param_comms``), so their share of the step can be read;
* ``ledger_comm_seconds``: the same collectives timed by the engine's own
  ledger (issue to completion), a cross-check that does not need the profiler;
* ``top``: the five most expensive operators by self CPU time;
* ``peak_flops``: this process's measured matmul FLOP/s (a ``size`` × ``size``
  fp32 matmul, best of a few), the peak the MFU is taken against on CPU;
* ``flops_per_step``: 6·Ψ·tokens, the model FLOPs of forward + backward.

MFU = flops_per_step / (step_seconds × peak_flops). On a GPU one would take the
peak from the data sheet (an A100's 312 TFLOP/s in bf16); on a CPU there is no
data sheet worth trusting, so the same process measures its own matmul.
"""
from __future__ import annotations

import time

import torch

COMM_MARKERS = ("gloo:", "nccl:", "c10d::", "record_param_comms")


def is_comm(name: str) -> bool:
    """Whether a profiler event is a collective (named by the process-group backend)."""
    return any(m in name for m in COMM_MARKERS)


def matmul_flops(size: int = 256, repeat: int = 5) -> float:
    """Measured FLOP/s of a ``size`` x ``size`` fp32 matmul in this process (best of ``repeat``)."""
    a, b = torch.randn(size, size), torch.randn(size, size)
    a @ b                                                  # warm-up
    best = float("inf")
    for _ in range(repeat):
        t0 = time.perf_counter()
        a @ b
        best = min(best, time.perf_counter() - t0)
    return 2 * size ** 3 / best


def profile_step(config, preset="micro", steps=2, warmup=1, batch_per_rank=2, seed=7) -> dict:
    """Inside a launched rank: profile ``steps`` training steps; return the summary (module docstring)."""
    import torch.distributed as dist
    from torch.profiler import ProfilerActivity, profile

    from zerolab.book.models import loss_fn, synthetic_batch
    from zerolab.book.runs import make_model
    from zerolab.engine import initialize

    rank, n = (dist.get_rank(), dist.get_world_size()) if dist.is_initialized() else (0, 1)
    model = make_model(preset)
    engine = initialize(model, config)
    psi = sum(p.numel() for p in model.parameters())

    def one_step(step):
        x, y = synthetic_batch(model, n * batch_per_rank, seed=seed, step=step)
        x, y = x[rank * batch_per_rank:(rank + 1) * batch_per_rank], y[rank * batch_per_rank:(rank + 1) * batch_per_rank]
        engine.backward(loss_fn(engine(x), y))
        engine.step()
        return x.numel()

    for s in range(warmup):
        one_step(s)
    seen = len(engine.comm.records)
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        t0 = time.perf_counter()
        tokens = sum(one_step(warmup + s) for s in range(steps)) / steps
        wall = (time.perf_counter() - t0) / steps
    events = prof.key_averages()
    comm = sum(e.self_cpu_time_total for e in events if is_comm(e.key)) / 1e6 / steps
    top = sorted(events, key=lambda e: e.self_cpu_time_total, reverse=True)[:5]
    out = {"rank": rank, "world_size": n, "psi": psi, "tokens_per_step": tokens * n,
           "step_seconds": wall, "comm_seconds": comm,
           "ledger_comm_seconds": sum(r.seconds for r in engine.comm.records[seen:]) / steps,
           "comm_ops": sorted({e.key for e in events if is_comm(e.key)}),
           "top": [(e.key, e.self_cpu_time_total / 1e6 / steps) for e in top],
           "flops_per_step": 6 * psi * tokens * n, "peak_flops": matmul_flops()}
    engine.close()
    return out


def mfu(summary: dict) -> float:
    """Model FLOPs utilisation of the whole job: 6Ψ·tokens / (step time × N × one rank's peak)."""
    return summary["flops_per_step"] / (summary["step_seconds"] * summary["world_size"] * summary["peak_flops"])
