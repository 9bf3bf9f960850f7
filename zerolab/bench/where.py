"""Where the time of one sweep point goes: ``python -m zerolab.bench.where --model medium --ranks 2 --stage 3``.

One contender (``--kind``: ours or a peer) built as the sweep builds it, 2 steps of warm-up,
then ``--steps`` steps under the torch profiler on every rank; rank 0's self CPU time per step,
by kind of operator:

    compute      matrix products, attention, norms, activations, the loss, the optimizer's kernels
    collectives  c10d calls (gloo: the time to issue, or all of it for a blocking call)
    grad hooks   autograd's AccumulateGrad, self time: the engine's gradient hooks in Python and
                 the waits for the collectives they issue
    copies       copy_, cat, fills and other data movement
    peer ops     a peer's own named regions (FSDP's all-gather/reduce bookkeeping)
    other        the step's wall time minus all of the above: Python between operators

On a shared machine the wall times include time the rank waited for a core; the split is
what counts.
"""
from __future__ import annotations

import argparse
import collections
import time

KINDS = (("grad hooks", ("accumulategrad",)),
         ("peer ops", ("fsdp::", "deepspeed")),      # before collectives: "FSDP::all_gather (blocks.3)"
         ("collectives", ("c10d::", "gloo", "allreduce", "allgather", "all_gather", "reduce_scatter", "broadcast")),
         ("compute", ("aten::mm", "aten::addmm", "aten::bmm", "attention", "layer_norm", "gelu", "softmax",
                      "nll_loss", "embedding", "_fused_adam", "aten::add", "aten::mul", "aten::sum", "aten::div")),
         ("copies", ("copy_", "aten::cat", "fill_", "zero_", "clone", "index", "narrow", "contiguous", "_to_copy")))


def kind_of(name: str) -> str:
    name = name.lower()
    return next((k for k, keys in KINDS if any(s in name for s in keys)), "other ops")


def _rank_main(kind, model, stage, batch, steps):
    import torch.distributed as dist
    from torch.profiler import ProfilerActivity, profile
    from zerolab.bench import peers as bp
    from zerolab.bench.sweep import stage3_knobs
    from zerolab.book.models import synthetic_batch
    n = dist.get_world_size()
    cfg = bp.ds_config(stage, batch // n, **(stage3_knobs(model) if stage == 3 else {}))
    r = bp.build(kind, model, stage, cfg)
    data = [synthetic_batch(model, batch, step=k, rank=dist.get_rank(), world_size=n) for k in range(steps + 2)]
    for k in range(2):
        r.step(*data[k])
    dist.barrier()
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        t0 = time.perf_counter()
        for k in range(2, steps + 2):
            r.step(*data[k])
        wall = time.perf_counter() - t0
    split = collections.Counter()
    for e in prof.key_averages():
        split[kind_of(e.key)] += e.self_cpu_time_total / 1e3 / steps
    split["other"] = 1e3 * wall / steps - sum(split.values())
    top = sorted(((e.self_cpu_time_total / 1e3 / steps, e.key) for e in prof.key_averages()), reverse=True)[:8]
    r.close()
    return dict(wall_ms=1e3 * wall / steps, split=dict(split), top=top)


def where(kind="ours", model="medium", ranks=2, stage=3, batch=4, steps=3, timeout=1200) -> dict:
    """Rank 0's split of one step (ms), see the module docstring."""
    import os
    from zerolab.runtime.launch import launch
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    return launch(_rank_main, world_size=ranks, threads=1, timeout=timeout, args=(kind, model, stage, batch, steps))[0]


def main(argv=None) -> int:
    from zerolab.bench import peers as bp
    p = argparse.ArgumentParser(prog="python -m zerolab.bench.where", description=__doc__.split("\n")[0])
    p.add_argument("--kind", choices=sorted(bp.KINDS), default="ours")
    p.add_argument("--model", choices=sorted(bp.BENCH_MODELS), default="medium")
    p.add_argument("--ranks", type=int, default=2)
    p.add_argument("--stage", type=int, choices=range(4), default=3)
    p.add_argument("--batch", type=int, default=4, help="global batch (the sweep's strong-scaling batch)")
    p.add_argument("--steps", type=int, default=3)
    a = p.parse_args(argv)
    out = where(a.kind, a.model, a.ranks, a.stage, a.batch, a.steps)
    parts = ", ".join(f"{k} {v:.0f}" for k, v in sorted(out["split"].items(), key=lambda kv: -kv[1]))
    print(f"{a.kind} {a.model} N={a.ranks} stage {a.stage}: {out['wall_ms']:.0f} ms per step (rank 0): {parts}")
    print("  top self times (ms): " + ", ".join(f"{name} {t:.0f}" for t, name in out["top"]))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
