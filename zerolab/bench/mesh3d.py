"""``python -m zerolab bench --meshes 2x2x1 1x1x2``: ours under TP and PP beside PyTorch's (chapter 10).

One ``zl.launch`` per mesh (``dp x tp x pp`` ranks) runs ours and its torch peer
(``peers3d``) in the same rank processes, on the same untied TinyGPT, the same
global batches and steps. A mesh with tp > 1 and pp = 1 runs our ZeRO-3 under
``zl.tensor_parallel`` beside DTensor TP + FSDP2 (ZeRO-3 on the DP dimension);
a mesh ``dp x 1 x pp`` runs our ZeRO-1 pipeline (1F1B) beside
``torch.distributed.pipelining``'s ``Schedule1F1B`` (with FSDP2 per stage when
dp > 1: ZeRO-3, which ours refuses with PP); any other mesh runs ours alone (a
note says so). Timing as the DP bench (``runner.py``): interleaved
rounds, the order rotating, each step starting at a barrier, a step's time
the slowest rank's, warm-up steps untimed; ours ÷ peer compares medians from
the same run. Memory: per contender, in rank processes of its own, the peak
resident set while it is built and trained (VmHWM) above the resident set
before, per rank. Correctness: every step's loss per contender, and after
the last step the full parameters of the peer against ours (max abs
difference; Adam turns rounding on gradients near zero into up to ±lr).
"""
from __future__ import annotations

import statistics
import time
import warnings

from zerolab.bench import peers3d as p3

SCHEMA = "zerolab-bench-3d/1"
FAR = 1e-4   # a parameter element further than this from ours (a tenth of one Adam step, lr 1e-3) is counted


def contenders(dims) -> tuple[list, str | None]:
    """[(kind, stage, label)] for mesh ``dims`` = (dp, tp, pp), and a note when ours runs alone."""
    dp, tp, pp = dims
    if pp == 1:
        ours = [("ours", 3, f"zerolab TP={tp} x ZeRO-3 DP={dp}")]
        if tp > 1:
            return ours + [("torch_tp", 3, f"DTensor TP={tp} (parallelize_module) + FSDP2 DP={dp}")], None
        return ours, f"mesh {dp}x{tp}x{pp}: no tensor or pipeline parallelism, no 3D peer (the DP bench covers it)"
    ours = [("ours", 1, f"zerolab PP={pp} 1F1B" + (f" x TP={tp}" if tp > 1 else "") + f" x ZeRO-1 DP={dp}")]
    if tp == 1:   # dp > 1: the peer shards with FSDP2 (ZeRO-3); ours runs at most ZeRO-1 with PP
        fsdp = f" + FSDP2 DP={dp}" if dp > 1 else ""
        return ours + [("torch_pp", 3 if dp > 1 else 0, f"torch.distributed.pipelining PP={pp} Schedule1F1B{fsdp}")], None
    return ours, (f"mesh {dp}x{tp}x{pp}: the torch pipelining peer is built for tp = 1 only "
                  f"(TP inside traced stages would need DTensor there): ours alone")


def _batches(preset, batch, total):
    from zerolab.book.models import synthetic_batch
    return [synthetic_batch(preset, batch, seed=0, step=k) for k in range(total)]   # the global batch


def _timed(r, x, y, losses):
    import torch.distributed as dist
    dist.barrier()
    t0 = time.perf_counter()
    losses.append(r.step(x, y))
    return time.perf_counter() - t0


def _rank_main(dims, cont, preset, batch, micro, steps, repeats, warmup):
    """Every rank: build the contenders, time them round-robin, compare their parameters."""
    warnings.filterwarnings("ignore")
    data = _batches(preset, batch, warmup + steps * repeats)
    runners, out = [], {}
    for kind, stage, _ in cont:
        t0 = time.perf_counter()
        r = p3.KINDS[kind](preset, dims, stage, micro, batch)
        out[kind] = dict(times=[], losses=[], build_s=0.0)
        for k in range(warmup):
            _timed(r, *data[k], out[kind]["losses"])
        out[kind]["build_s"] = time.perf_counter() - t0
        if kind == "ours":
            r.mesh.ledger.reset()
        runners.append((kind, r))
    for rnd in range(repeats):
        order = runners[rnd % len(runners):] + runners[:rnd % len(runners)]
        for kind, r in order:
            for k in range(steps):
                x, y = data[warmup + rnd * steps + k]
                out[kind]["times"].append(_timed(r, x, y, out[kind]["losses"]))
    ref = None
    for kind, r in runners:
        full = r.full_params()   # a collective: every rank, the same order
        ref = full if ref is None else ref
        out[kind]["max_abs_diff"] = max(float((full[n] - ref[n]).abs().max()) for n in ref)
        out[kind]["n_params"] = sum(t.numel() for t in full.values())
        out[kind]["n_far"] = sum(int(((full[n] - ref[n]).abs() > FAR).sum()) for n in ref)
        if kind == "ours":
            out[kind]["bytes_per_step"] = {g: r.mesh.ledger.total_bytes(group=g) // (steps * repeats)
                                           for g in ("dp", "tp", "pp")}
        r.close()
    return out


def _memory_main(dims, kind, stage, preset, batch, micro, warmup):
    """One contender in fresh rank processes: resident bytes it adds while built and trained."""
    import gc
    from zerolab.runtime.measure import PeakMeter, status_kb, trim_heap
    warnings.filterwarnings("ignore")
    data = _batches(preset, batch, warmup + 1)
    gc.collect()
    trim_heap()
    anon0 = status_kb("RssAnon") or 0
    with PeakMeter("hwm") as pm:
        r = p3.KINDS[kind](preset, dims, stage, micro, batch)
        for x, y in data:
            r.step(x, y)
    held = ((status_kb("RssAnon") or 0) - anon0) * 1024
    r.close()
    return dict(peak=pm.peak, held=max(0, held))


def _probe_main(dims, preset, batch, micro):
    warnings.filterwarnings("ignore")
    return p3.probe_ddp(preset, dims, micro, batch, steps=3)


def ddp_probe(dims, preset, batch, micro) -> str | None:
    """dp x 1 x pp, dp > 1: does torch's pipelining run with DDP per stage? Its error text, or None."""
    from zerolab.runtime.launch import launch
    try:
        errs = launch(_probe_main, world_size=dims[0] * dims[2], threads=1, timeout=120,
                      args=(dims, preset, batch, micro))
    except Exception as e:   # a rank hung or died: the launcher's first line
        return f"the probe did not finish: {str(e).splitlines()[0]}"
    return next((e for e in errs if e), None)


def run_mesh(dims, preset, batch, micro, steps, repeats, warmup, memory, timeout) -> dict:
    """One mesh: launch dp*tp*pp ranks, run ours and its peer, summarise per contender."""
    from zerolab.runtime.launch import launch
    n = dims[0] * dims[1] * dims[2]
    cont, note = contenders(dims)
    mem = {kind: launch(_memory_main, world_size=n, threads=1, timeout=timeout,
                        args=(dims, kind, stage, preset, batch, micro, warmup))
           if memory else [dict(peak=None, held=None)] * n for kind, stage, _ in cont}
    per_rank = launch(_rank_main, world_size=n, threads=1, timeout=timeout,
                      args=(dims, cont, preset, batch, micro, steps, repeats, warmup))
    rows = []
    for kind, stage, label in cont:
        ranks = [pr[kind] for pr in per_rank]
        step_s = [max(ts) for ts in zip(*(r["times"] for r in ranks))]
        q = statistics.quantiles(step_s, n=4) if len(step_s) > 1 else [step_s[0]] * 3
        rows.append(dict(kind=kind, stage=stage, label=label, library=p3.KINDS[kind].library,
                         median_ms=1e3 * statistics.median(step_s), q1_ms=1e3 * q[0], q3_ms=1e3 * q[2],
                         times_ms=[1e3 * t for t in step_s], losses=ranks[0]["losses"],
                         peak_bytes=[m["peak"] for m in mem[kind]], held_bytes=[m["held"] for m in mem[kind]],
                         max_abs_diff=max(r["max_abs_diff"] for r in ranks),
                         n_far=max(r["n_far"] for r in ranks), n_params=ranks[0]["n_params"],
                         build_s=max(r["build_s"] for r in ranks),
                         bytes_per_step=ranks[0].get("bytes_per_step")))
    world = dict(mesh="x".join(map(str, dims)), dp=dims[0], tp=dims[1], pp=dims[2], world_size=n,
                 micro_batches=micro, contenders=rows, note=note)
    if dims[0] > 1 and dims[1] == 1 and dims[2] > 1:   # DDP per stage instead of FSDP2, at pp and at micro
        world["ddp_probe"] = {m: ddp_probe(dims, preset, batch, m) for m in sorted({dims[2], micro})}
        said = "; ".join(f"{m} micro-batches: " + (f"fails: {err}" if err else "runs")
                         for m, err in world["ddp_probe"].items())
        world["note"] = ((note + "; ") if note else "") + f"torch pipelining with DDP per stage (3 steps): {said}"
    ours = rows[0]
    world["ratios"] = [dict(peer=r["label"], peer_kind=r["kind"], ours_ms=ours["median_ms"], peer_ms=r["median_ms"],
                            ratio=ours["median_ms"] / r["median_ms"],
                            peak_ratio=_peak_ratio(ours, r)) for r in rows[1:]]
    return world


def _peak_ratio(ours, peer):
    a, b = [x for x in ours["peak_bytes"] if x], [x for x in peer["peak_bytes"] if x]
    return max(a) / max(b) if a and b else None


def bench_3d(meshes=("2x2x1", "1x1x2"), model="small", batch=8, micro=None, steps=2, repeats=5, warmup=2,
             memory=True, out="build/bench", timeout=900, verbose=True) -> dict:
    """Run every mesh; write ``bench3d.json`` and ``bench3d.md`` into ``out`` ('' = none)."""
    import torch
    dims_list = [p3.parse_mesh(m) if isinstance(m, str) else tuple(m) for m in meshes]
    if steps < 1 or repeats < 1 or warmup < 1:
        raise ValueError("--meshes runs need --steps and --repeats >= 1 and --warmup >= 1")
    result = dict(schema=SCHEMA, mode="meshes", runs=[], notes=[],
                  settings=dict(model=model, params=sum(p.numel() for p in p3.build_model(model).parameters()),
                                tied=False, batch=batch, steps=steps, repeats=repeats, warmup=warmup,
                                threads_per_rank=1, backend="gloo", precision="fp32",
                                optimizer="Adam (lr 1e-3, no weight decay)", torch=torch.__version__,
                                date=time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())))
    for dims in dims_list:
        m = micro or (1 if dims[2] == 1 else 2 * dims[2])   # 1F1B needs at least pp micro-batches
        t0 = time.perf_counter()
        try:
            world = run_mesh(dims, model, batch, m, steps, repeats, warmup, memory, timeout)
        except Exception as e:   # a contender that cannot run here: its error text, verbatim
            world = dict(mesh="x".join(map(str, dims)), error=f"{type(e).__name__}: {e}", contenders=[], ratios=[])
        world["seconds"] = time.perf_counter() - t0
        if world.get("note"):
            result["notes"].append(world["note"])
        result["runs"].append(world)
        if verbose:
            print(table(result, world), flush=True)
    if out:
        import json
        import os
        os.makedirs(out, exist_ok=True)
        with open(os.path.join(out, "bench3d.md"), "w") as f:
            f.write(markdown(result))
        with open(os.path.join(out, "bench3d.json"), "w") as f:
            json.dump(result, f, indent=1)
        if verbose:
            print(f"wrote {out}/bench3d.json, {out}/bench3d.md", flush=True)
    return result


def _mb(values):
    vals = [v for v in values if v]
    return " ".join(f"{v / 1e6:.0f}" for v in vals) if vals else "-"


def table(result, world) -> str:
    s = result["settings"]
    lines = [f"zerolab bench --meshes {world['mesh']} (dp x tp x pp): {s['model']} TinyGPT untied "
             f"({s['params'] / 1e6:.2f}M params), gloo, 1 thread/rank, global batch {s['batch']}, "
             f"{world.get('micro_batches', '?')} micro-batch(es) per DP rank, {s['repeats']} rounds x {s['steps']} steps"]
    if world.get("error"):
        return "\n".join(lines + [f"  could not run: {world['error']}"]) + "\n"
    lines.append(f"{'contender':<58}{'median ms':>10}{'IQR ms':>12}{'peak MB per rank':>20}{'max|Δp|':>9}"
                 f"{'>1e-4':>7}{'loss 1':>9}")
    for r in world["contenders"]:
        iqr = f"{r['q1_ms']:.0f}-{r['q3_ms']:.0f}"
        lines.append(f"{r['label']:<58}{r['median_ms']:>10.1f}{iqr:>12}{_mb(r['peak_bytes']):>20}"
                     f"{r['max_abs_diff']:>9.0e}{r['n_far']:>7}{r['losses'][0]:>9.4f}")
    for q in world["ratios"]:
        peak = f", peak memory {q['peak_ratio']:.2f}x" if q["peak_ratio"] else ""
        lines.append(f"ours / {q['peer']}: step time {q['ratio']:.2f}x ({q['ours_ms']:.1f} / {q['peer_ms']:.1f} ms)"
                     f"{peak}; < 1 means ours is faster or smaller")
    lines.append(f"max|Δp|, >1e-4: final parameters against ours (largest difference; elements further than "
                 f"{FAR:g}, of {world['contenders'][0]['n_params']}); loss 1: the first step's loss")
    if world.get("note"):
        lines.append(f"note: {world['note']}")
    return "\n".join(lines) + "\n"


def markdown(result) -> str:
    """The README's table: per mesh, ours ÷ peer median step time and peak resident memory."""
    lines = ["| mesh (dp×tp×pp) | ours | peer | ours ms | peer ms | time ours ÷ peer | peak MB/rank ours | "
             "peak MB/rank peer | peak ours ÷ peer | max abs Δ params (elements > 1e-4) |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for w in result["runs"]:
        if w.get("error"):
            lines.append(f"| {w['mesh']} | - | - | - | - | could not run: {w['error']} | | | | |")
            continue
        ours = w["contenders"][0]
        for q, peer in zip(w["ratios"], w["contenders"][1:]):
            pk = f"{q['peak_ratio']:.2f}" if q["peak_ratio"] else "-"
            lines.append(f"| {w['mesh']} | {ours['label']} | {peer['label']} | {q['ours_ms']:.1f} | "
                         f"{q['peer_ms']:.1f} | {q['ratio']:.2f} | {_mb(ours['peak_bytes'])} | "
                         f"{_mb(peer['peak_bytes'])} | {pk} | {peer['max_abs_diff']:.0e} "
                         f"({peer['n_far']} of {peer['n_params']}) |")
    return "\n".join(lines) + "\n"
