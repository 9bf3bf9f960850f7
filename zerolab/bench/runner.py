"""``python -m zerolab bench``: our engines against PyTorch and DeepSpeed, side by side (chapter 12).

One ``zl.launch`` per world size runs every contender (``bench_peers``) in the
same rank processes, one thread per rank, on the same TinyGPT, config and
synthetic batches. Timing is interleaved: each round runs ``steps`` steps of
every contender in turn (the order rotates from round to round), so machine
noise falls on all of them alike; the ratio ours/peer compares medians from
the same run. A step's time is the slowest rank's, each step starting at a
barrier; warm-up steps are not timed.

Per contender and rank, memory is measured first, each contender in fresh
rank processes of its own (one ``zl.launch`` per contender: none inherits the
heap another freed, whose pages it would reuse without raising the resident
set, so the order of the contenders cannot favour anyone): *peak* = the
highest resident set while it is built and trained (VmHWM,
``measure.PeakMeter("hwm")``), *held* = what stays resident after its last
step, both above the resident set just before it was built. Resident, not
allocated: DeepSpeed's up-front ``reduce_bucket_size`` buffer (5e8 elements
by default) is never touched on CPU and does not count. Bytes per step: our
ledger; the peers' from the ring formulas. After the last step every contender's full parameters are compared with the
first contender's (max abs difference): all of them do the same maths.
Each round also times the floor (``floor.py``): one rank's micro-batch alone (and its
optimizer step, of which a sharded contender needs 1/N) and a bare all-reduce of Ψ;
each contender's *efficiency* is its floor / its median step.

``--overlap`` times only our engine: ``overlap_comm`` off and on (stage 3:
prefetch and overlap off and on), on raw loopback and on a simulated link
(``--link``, default "demo"), with buckets small enough (``--bucket``,
default Ψ/4) that there is something to overlap.
"""
from __future__ import annotations

import os
import statistics
import time
import warnings

from zerolab.bench import peers as bp
from zerolab.bench.floor import BareAllReduce, FloorCompute, floor_ms, with_floor
from zerolab.bench.report import ratios, speedups
from zerolab.bench.specs import compare_specs, model_params, overlap_specs

SCHEMA = "zerolab-bench/1"


# ---------------------------------------------------------------- one rank
def _stepper(preset, batch, total):
    """Every rank's batches for ``total`` steps and a function running one timed step of a runner."""
    import torch.distributed as dist
    from zerolab.book.models import synthetic_batch
    warnings.filterwarnings("ignore", category=FutureWarning)      # gloo's renamed collectives
    warnings.filterwarnings("ignore", category=DeprecationWarning)  # torch.jit inside the peers
    warnings.filterwarnings("ignore", module=r"deepspeed.*")
    rank, world = dist.get_rank(), dist.get_world_size()
    data = [synthetic_batch(preset, batch, seed=0, step=k, rank=rank, world_size=world) for k in range(total)]

    def one_step(r, cpu=None):
        x, y = data[r.steps]
        dist.barrier()
        c0, t0 = time.process_time(), time.perf_counter()
        r.step(x, y)
        t = time.perf_counter() - t0
        if cpu is not None:
            cpu.append(time.process_time() - c0)  # all threads of this rank (compute + gloo)
        return t
    return one_step


def _memory_main(spec, preset, batch, warmup):
    """Runs on every rank of a launch of its own: one contender's memory pass."""
    return _memory_pass(spec, preset, warmup, _stepper(preset, batch, warmup + 1))


def _rank_main(specs, preset, batch, steps, repeats, warmup):
    """Runs on every rank: build all contenders, time them round-robin, cross-check parameters."""
    import torch.distributed as dist
    one_step = _stepper(preset, batch, warmup + 1 + steps * repeats)
    runners, out = [], {s.key: dict(times=[], cpu=[], build_s=0.0) for s in specs}
    for spec in specs:
        t0 = time.perf_counter()
        r = bp.build(spec.kind, preset, spec.stage, spec.cfg)
        for _ in range(warmup + 1):
            one_step(r)
        out[spec.key]["build_s"] = time.perf_counter() - t0
        r.reset_bytes()  # the ledger counts the timed steps only
        runners.append((spec, r))
    fc = FloorCompute(preset)   # the floor (floor.py): one micro-batch alone, a bare all-reduce of Ψ
    ba = BareAllReduce(sum(p.numel() for p in fc.model.parameters()), dist.get_world_size())
    for _ in range(warmup + 1):
        one_step(fc), one_step(ba)
    out["_floor"] = dict(compute=[], optimizer=[], comm=[], comm_bytes=ba.bytes)
    for rnd in range(repeats):
        order = runners[rnd % len(runners):] + runners[:rnd % len(runners)]
        for spec, r in order:
            for _ in range(steps):
                out[spec.key]["times"].append(one_step(r, out[spec.key]["cpu"]))
        for _ in range(steps):   # the floor, in the same rounds
            out["_floor"]["compute"].append(one_step(fc))
            out["_floor"]["optimizer"].append(fc.optimizer_s[-1])
            out["_floor"]["comm"].append(one_step(ba))
    ref = None
    for spec, r in runners:
        full = r.full_params()  # collective: every rank calls it
        out[spec.key]["bytes_per_step"] = r.bytes_per_step
        out[spec.key]["bytes_source"] = r.bytes_source
        if ref is None:
            ref = full
        out[spec.key]["max_abs_diff"] = max(float((full[n] - ref[n]).abs().max()) for n in ref)
        r.close()
    return out


def _memory_pass(spec, preset, warmup, one_step) -> dict:
    """Resident bytes this contender adds on this rank: ``peak`` while it is built and
    trained (VmHWM, measure.PeakMeter("hwm")), ``held`` after the last step, both above
    the resident set just before it was built."""
    import gc
    from zerolab.runtime.measure import PeakMeter, status_kb, trim_heap
    gc.collect()
    trim_heap()
    anon0 = status_kb("RssAnon") or 0
    with PeakMeter("hwm") as pm:
        r = bp.build(spec.kind, preset, spec.stage, spec.cfg)
        for _ in range(warmup + 1):
            one_step(r)
    gc.collect()
    trim_heap()
    held = ((status_kb("RssAnon") or 0) - anon0) * 1024  # anonymous pages: data, not code
    r.close()
    del r
    gc.collect()
    return dict(peak=pm.peak, held=max(0, held), pid=os.getpid())


# ---------------------------------------------------------------- the parent
def run_world(specs, world_size, preset, batch, steps, repeats, warmup, memory, timeout,
              memory_main=None) -> dict:
    """Launch ``world_size`` ranks, run every contender, summarise per contender.
    ``memory_main``: another memory pass (same arguments and ``peak``/``held``/``pid`` keys as
    ``_memory_main``; the sweep's counts tensors): its per-rank dicts go into ``memory_ranks``."""
    from zerolab.runtime.launch import launch
    from zerolab.theory.memory import estimate
    os.environ.setdefault("DS_ACCELERATOR", "cpu")  # inherited by the ranks
    _preload({s.kind for s in specs})
    mem = {s.key: launch(memory_main or _memory_main, world_size=world_size, threads=1, timeout=timeout,
                         args=(s, preset, batch, warmup)) if memory else [dict(peak=None, held=None, pid=None)] * world_size
           for s in specs}   # fresh processes per contender: nobody reuses another's freed heap
    per_rank = launch(_rank_main, world_size=world_size, threads=1, timeout=timeout,
                      args=(specs, preset, batch, steps, repeats, warmup))
    for rank, pr in enumerate(per_rank):
        for s in specs:
            pr[s.key].update(mem[s.key][rank])
    rows, floor = [], floor_ms([pr["_floor"] for pr in per_rank])
    for spec in specs:
        ranks = [pr[spec.key] for pr in per_rank]
        step_s = [max(ts) for ts in zip(*(r["times"] for r in ranks))]  # the slowest rank's step
        cpu_s = [sum(cs) / len(cs) for cs in zip(*(r["cpu"] for r in ranks))]  # CPU seconds per rank
        q = statistics.quantiles(step_s, n=4) if len(step_s) > 1 else [step_s[0]] * 3
        rows.append(dict(
            key=spec.key, kind=spec.kind, stage=spec.stage, label=spec.label,
            library=bp.KINDS[spec.kind].library,
            median_ms=1e3 * statistics.median(step_s), q1_ms=1e3 * q[0], q3_ms=1e3 * q[2],
            times_ms=[1e3 * t for t in step_s],
            cpu_ms=1e3 * statistics.median(cpu_s),
            peak_bytes=[r["peak"] for r in ranks], held_bytes=[r["held"] for r in ranks],
            memory_pids=[r["pid"] for r in ranks],
            bytes_per_step=ranks[0]["bytes_per_step"], bytes_source=ranks[0]["bytes_source"],
            max_abs_diff=max(r["max_abs_diff"] for r in ranks),
            build_s=max(r["build_s"] for r in ranks),
            states_theory_bytes=estimate(model_params(preset), world_size, spec.stage, "fp32").total,
            link=spec.cfg.get("zerolab", {}).get("link"),
            overlap_comm=spec.cfg["zero_optimization"].get("overlap_comm")))
        with_floor(rows[-1], floor, world_size)
        peaks = [p for p in rows[-1]["peak_bytes"] if p is not None]
        rows[-1]["peak_minus_states_bytes"] = max(peaks) - rows[-1]["states_theory_bytes"] if peaks else None
        if memory_main is not None:
            rows[-1]["memory_ranks"] = mem[spec.key]
    return dict(world_size=world_size, contenders=rows, floor=floor)


def _preload(kinds) -> None:
    """Import what the peers import lazily (torch._dynamo alone takes ~3 s) once, in the
    parent: the forked ranks inherit it instead of each paying for it inside the run."""
    import importlib
    mods = ["zerolab.engine"] + (["torch._dynamo", "torch.nn.parallel"] if kinds - {"ours"} else [])
    mods += ["torch.distributed.fsdp"] if "fsdp2" in kinds else []
    mods += ["deepspeed", "deepspeed.comm.torch", "deepspeed.runtime.engine",
             "deepspeed.runtime.zero.muon.muon_optimizer"] if "deepspeed" in kinds else []  # imports inductor
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for m in mods:
            importlib.import_module(m)


def bench(world_sizes=(2, 4), stages=(0, 1, 2, 3), steps=2, repeats=10, model="small", out="build/bench",
          overlap=False, link=None, bucket=None, overlap_comm=None, batch=8, warmup=2, memory=True,
          timeout=1800, verbose=True) -> dict:
    """Run the benchmark; write ``bench.json`` (+ ``bench.png``) into ``out``; return the result."""
    import torch
    if any(batch % w for w in world_sizes):
        raise ValueError(f"--batch {batch} must be divisible by every world size {list(world_sizes)}")
    if link is not None and not overlap:
        raise ValueError("--link applies to --overlap runs (our engine only): the peers cannot use a "
                         "simulated link, so the side-by-side comparison runs on raw loopback")
    if steps < 1 or repeats < 1 or warmup < 0:
        raise ValueError("--steps and --repeats must be >= 1, --warmup >= 0")
    psi = model_params(model)
    link = link or "demo"
    if overlap:
        bucket = bucket or -(-psi // 4)
    result = dict(schema=SCHEMA, mode="overlap" if overlap else "compare",
                  settings=dict(model=model, params=psi, batch=batch, steps=steps, repeats=repeats, warmup=warmup,
                                threads_per_rank=1, backend="gloo", precision="fp32",
                                optimizer="Adam (lr 1e-3, no weight decay)", torch=torch.__version__,
                                deepspeed=_ds_version(), link=link if overlap else None,
                                bucket=bucket, overlap_comm=overlap_comm,
                                date=time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())),
                  notes=[], runs=[])
    for w in world_sizes:
        specs, notes = (overlap_specs(stages, w, batch, bucket, link) if overlap
                        else compare_specs(stages, w, batch, overlap_comm, bucket))
        result["notes"] += [n for n in notes if n not in result["notes"]]
        if not specs:
            continue
        t0 = time.perf_counter()
        world = run_world(specs, w, model, batch, steps, repeats, warmup, memory, timeout)
        world["seconds"] = time.perf_counter() - t0
        world["ratios" if not overlap else "speedups"] = ratios(world) if not overlap else speedups(world)
        world["max_abs_diff"] = max(r["max_abs_diff"] for r in world["contenders"])
        result["runs"].append(world)
        if verbose:
            from zerolab.bench.report import world_table
            print(world_table(result, world), flush=True)
    if out:
        from zerolab.bench.report import save
        save(result, out)
    return result


def _ds_version():
    if not bp.deepspeed_available():
        return None
    from importlib.metadata import version
    return version("deepspeed")
