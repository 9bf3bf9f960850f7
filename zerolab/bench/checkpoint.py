"""Checkpoint costs, measured: save/load seconds and bytes per rank, resharding, consolidation (chapter 8).

    python -m zerolab.bench.checkpoint [--model small] [--ranks 2 4] [--dir DIR] [--json out.json]

For each world size and stage 0-3 (TinyGPT ``small``, bf16, Adam, one training
step first) every rank saves, then a fresh engine loads: seconds and bytes
written per rank, set against the rank's model states (``engine.memory()``:
params + grads + optimizer). Then a checkpoint saved at the largest world size
is loaded at stage 3 on half as many ranks, measuring the anonymous memory
loading adds (``peak_memory("anon")``: sampled RssAnon; mapped file pages are page cache)
and the bytes it copies, against the full optimizer state (12Ψ bytes). Last, ``consolidate_fp32`` runs in a fresh
process: its peak RSS (VmHWM; file pages it maps count) against the output (4Ψ)
and one rank's shard file. Seconds are wall-clock on whatever disk ``--dir``
is on (sha256 and fsync included); they are noisy on a shared machine.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile

import torch.distributed as dist

from zerolab.engine import initialize
from zerolab.runtime.launch import launch
from zerolab.book.models import TinyGPT, loss_fn, synthetic_batch
from zerolab.runtime.measure import PeakMeter

ROWS = 4


def config(stage):
    return {"optimizer": {"type": "Adam", "params": {"lr": 1e-3}}, "bf16": {"enabled": True},
            # small parameters stay whole only below 1,000 elements, so stage 3's units are the blocks
            "zero_optimization": {"stage": stage, "stage3_param_persistence_threshold": 1000}}


def _engine(model_name, stage, seed=1):
    model = TinyGPT.preset(model_name, seed=seed)
    return model, initialize(model, config(stage))


def save_load_worker(model_name, root):
    """Inside a rank: per stage, one step, save, load into a fresh engine; this rank's figures."""
    out = {}
    for stage in range(4):
        model, engine = _engine(model_name, stage)
        x, y = synthetic_batch(model, ROWS * engine.world_size, step=0, rank=engine.rank,
                               world_size=engine.world_size)
        engine.backward(loss_fn(engine(x), y))
        engine.step()
        with PeakMeter("anon") as meter:
            engine.save_checkpoint(f"{root}/stage{stage}")
        save = {**engine.checkpoint_stats, "save_anon_peak": meter.peak}
        states = engine.memory()
        engine.close()
        _, fresh = _engine(model_name, stage, seed=2)
        fresh.load_checkpoint(f"{root}/stage{stage}")
        out[stage] = {**save, **fresh.checkpoint_stats, "model_states": states.params + states.grads + states.optimizer,
                      "psi": engine.flat.numel}
        fresh.close()
    return out


def reshard_worker(model_name, root, stage_saved):
    """Inside a rank: load a checkpoint saved at another world size and stage into stage 3."""
    model, engine = _engine(model_name, 3, seed=3)
    x, y = synthetic_batch(model, ROWS * engine.world_size, step=0, rank=engine.rank, world_size=engine.world_size)
    engine.backward(loss_fn(engine(x), y))   # one step first: the engine's own buffers are resident (torch.zeros
    engine.step()                            # maps untouched pages lazily), so the meter sees what loading adds
    with PeakMeter("anon") as meter:
        engine.load_checkpoint(f"{root}/stage{stage_saved}")
    s = engine.checkpoint_stats
    own = sum(t.numel() for t in engine.targets) * 12
    return {"anon_peak": meter.peak, "read": s["load_bytes_read"], "own_state": own,
            "largest_unit_state": max(t.numel() for t in engine.targets) * 12,
            "mapped": s["load_bytes_mapped"], "seconds": s["load_seconds"]}


CONSOLIDATE = """
import json, sys
from zerolab.runtime.measure import PeakMeter
from zerolab.engine.checkpoint.consolidate import consolidate_fp32
with PeakMeter("hwm") as m, PeakMeter("anon") as a:
    sd = consolidate_fp32(sys.argv[1])
out = sum({t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in sd.values()}.values())
print(json.dumps({"peak": m.peak, "anon_peak": a.peak, "output": out}))
"""


def consolidate_peak(tag_dir: str) -> dict:
    env = {**os.environ, "PYTHONPATH": os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))}
    r = subprocess.run([sys.executable, "-c", CONSOLIDATE, tag_dir], capture_output=True, text=True, env=env,
                       check=True)
    result = json.loads(r.stdout.strip().splitlines()[-1])
    shard = max(os.path.getsize(os.path.join(tag_dir, f)) for f in os.listdir(tag_dir) if "optim" in f)
    return {**result, "largest_shard_file": shard}


def run(model_name="small", ranks=(2, 4), root=None) -> dict:
    own_root = root is None
    root = root or tempfile.mkdtemp(prefix="zerolab-bench-ckpt-")
    try:
        results = {"save_load": {}, "model": model_name}
        for n in ranks:
            per_rank = launch(save_load_worker, world_size=n, args=(model_name, f"{root}/n{n}"), timeout=1200,
                                 threads=1)
            results["save_load"][n] = per_rank
        n = max(ranks)
        m = max(1, n // 2)
        results["reshard"] = {"from": (n, 1), "to": (m, 3),
                              "ranks": launch(reshard_worker, world_size=m, args=(model_name, f"{root}/n{n}", 1),
                                                 timeout=600, threads=1)}
        tag = os.path.join(root, f"n{n}", "stage3")
        tag = os.path.join(tag, open(os.path.join(tag, "latest")).read().strip())
        results["consolidate"] = consolidate_peak(tag)
        return results
    finally:
        if own_root:
            shutil.rmtree(root, ignore_errors=True)


def report(results: dict) -> str:
    MB = 1e6
    lines = [f"TinyGPT {results['model']}, bf16 + Adam (measured; wall-clock seconds, noisy)", "",
             f"{'N':>2} {'stage':>5} {'model states/rank':>18} {'written (max)':>13} {'save s':>7} {'load s':>7} "
             f"{'read (max)':>10} {'save: +anon (max)':>17}"]
    for n, per_rank in results["save_load"].items():
        for stage in range(4):
            rows = [r[stage] for r in per_rank]
            mx = lambda k: max(r[k] for r in rows)  # noqa: E731
            lines.append(f"{n:>2} {stage:>5} {mx('model_states') / MB:>15.1f} MB {mx('save_bytes') / MB:>10.1f} MB "
                         f"{mx('save_seconds'):>7.2f} {mx('load_seconds'):>7.2f} {mx('load_bytes_read') / MB:>7.1f} MB "
                         f"{mx('save_anon_peak') / MB:>14.1f} MB")
    psi = results["save_load"][next(iter(results["save_load"]))][0][0]["psi"]
    rs = results["reshard"]
    lines += ["", f"reshard: saved at {rs['from'][0]} ranks stage {rs['from'][1]}, loaded at {rs['to'][0]} ranks "
                  f"stage {rs['to'][1]}; full optimizer state 12Ψ = {12 * psi / MB:.1f} MB"]
    for r, x in enumerate(rs["ranks"]):
        lines.append(f"  rank {r}: anonymous memory while loading +{x['anon_peak'] / MB:.1f} MB (largest unit of its "
                     f"state {x['largest_unit_state'] / MB:.1f} MB); copied from files {x['read'] / MB:.1f} MB = its "
                     f"own state {x['own_state'] / MB:.1f} MB less padding; {x['seconds']:.2f} s")
    c = results["consolidate"]
    lines += ["", f"consolidate (fresh process): peak RSS +{c['peak'] / MB:.1f} MB (VmHWM, mapped file pages "
                  f"included), anonymous +{c['anon_peak'] / MB:.1f} MB, for an output of {c['output'] / MB:.1f} MB "
                  f"(4Ψ); largest shard file {c['largest_shard_file'] / MB:.1f} MB"]
    return "\n".join(lines)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m zerolab.bench.checkpoint", description=__doc__.split("\n")[0])
    p.add_argument("--model", default="small")
    p.add_argument("--ranks", type=int, nargs="+", default=[2, 4])
    p.add_argument("--dir", default=None, help="where to write the checkpoints (default: a temporary folder)")
    p.add_argument("--json", default=None, help="also write the figures as JSON")
    args = p.parse_args(argv)
    results = run(args.model, tuple(args.ranks), args.dir)
    print(report(results))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)
    return 0


if __name__ == "__main__" and not dist.is_initialized():
    sys.exit(main())
