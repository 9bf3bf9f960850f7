"""``python -m zerolab bench --sweep``: how memory and time grow with Ψ and N (README's sweep).

Points: TinyGPT ``small`` / ``medium`` / ``large`` (3.7M, 26.3M, 98.5M parameters)
x N ranks x ZeRO stage, each at a fixed global batch (*strong* scaling: ``global_batch``
rows split over N) and at a fixed batch per rank (*weak* scaling: ``micro_batch`` rows
each, N x as many in all); where the two coincide the point runs once and is listed
under both. Ours runs everywhere, one peer per stage (``SWEEP_PEERS``) at ``PEER_MODEL``.

Each (model, N, scaling) is one ``runner.run_world``: the step time (median of the
slowest rank, interleaved rounds), the floor and the efficiency as in the bench; its
memory pass (``_memory_main``, fresh rank processes per contender) counts *tensors*
with the torch profiler: ``held`` = tensor bytes the contender holds when a step starts,
``peak`` = the most it holds during that step. For ours the model states are read from
``engine.memory()`` between backward and step, where they are largest.

Memory against the formula: model states against ``zl.estimate(Ψ, N, stage, "fp32")``,
the rest of the peak against ``activations.rest_model`` (TinyGPT's activations plus the
engine's transient buffers). Where the contenders of a group would not fit together
(``MEM_BUDGET``), each runs in a launch of its own (no interleaving; said in the notes).
"""
from __future__ import annotations

import os
import time

from zerolab.bench import peers as bp
from zerolab.bench.specs import Spec, model_params

SWEEP_MODELS = ("small", "medium", "large")
SWEEP_PEERS = {0: "ddp", 1: "zero_redundancy", 2: "deepspeed", 3: "fsdp2"}   # one peer per stage
PEER_MODEL = "medium"
MEM_BUDGET = 8e9    # bytes of model states of a group, all ranks, above which contenders run one by one
MARK = "zerolab-sweep-step"


# ---------------------------------------------------------------- one rank
def _measured_step(r, x, y) -> dict | None:
    """One step of contender ``r``; ours: model states from ``engine.memory()`` between backward and step."""
    if r.kind != "ours":
        r.step(x, y)
        return None
    from zerolab.book.models import loss_fn
    e = r.engine
    e.comm.reset()
    e.backward(loss_fn(e(x), y))
    m = e.memory()
    e.step()
    r.steps += 1
    return dict(params=m.params, grads=m.grads, optimizer=m.optimizer, buffers=m.buffers)


def _window(prof, mark: str) -> tuple[int, int]:
    """(tensor bytes held when ``mark`` starts, the most held while it runs) from the profile's
    allocation events: a running sum from the start of the profile."""
    events = list(prof.profiler.kineto_results.events())
    span = [e for e in events if e.name() == mark]
    t0 = span[0].start_ns()
    t1 = t0 + span[0].duration_ns()
    mem = sorted((e.start_ns(), e.nbytes()) for e in events
                 if e.name() == "[memory]" and e.device_type().name == "CPU")
    running = held = 0
    peak = None
    for t, nbytes in mem:
        if t < t0:
            running += nbytes
            held = running
            continue
        if t > t1:
            break
        running += nbytes
        peak = running if peak is None else max(peak, running)
    return held, held if peak is None else max(held, peak)


def _memory_main(spec, preset, batch, warmup):
    """Runs on every rank of a launch of its own: build, ``warmup`` + 1 steps (the optimizer
    state exists after the first), then one measured step, all under the profiler."""
    import gc
    import torch.distributed as dist
    from torch.profiler import ProfilerActivity, profile, record_function
    from zerolab.book.models import synthetic_batch
    rank, world = dist.get_rank(), dist.get_world_size()
    data = [synthetic_batch(preset, batch, seed=0, step=k, rank=rank, world_size=world) for k in range(warmup + 2)]
    gc.collect()
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        r = bp.build(spec.kind, preset, spec.stage, spec.cfg)
        for k in range(warmup + 1):
            dist.barrier()
            r.step(*data[k])
        dist.barrier()
        with record_function(MARK):
            states = _measured_step(r, *data[-1])
    held, peak = _window(prof, MARK)
    r.close()
    return dict(peak=peak, held=held, states=states, pid=os.getpid())


# ---------------------------------------------------------------- the parent
def groups(models, world_sizes, global_batch: int, micro_batch: int) -> list[dict]:
    """One entry per (model, N, batch): ``scalings`` lists "strong" and/or "weak" (both where
    the strong point's batch per rank is ``micro_batch``)."""
    out = []
    for model in models:
        for n in world_sizes:
            if global_batch % n:
                raise ValueError(f"--batch {global_batch} must be divisible by every world size {list(world_sizes)}")
            strong = dict(model=model, world_size=n, batch=global_batch, scalings=["strong"])
            out.append(strong)
            if global_batch // n == micro_batch:
                strong["scalings"].append("weak")
            else:
                out.append(dict(model=model, world_size=n, batch=micro_batch * n, scalings=["weak"]))
    return out


def stage3_knobs(model: str) -> dict:
    """Stage 3 as FSDP2 runs it: nothing kept whole (DeepSpeed keeps parameters under 1e5 elements,
    every weight of small's blocks), one unit gathered ahead, a unit released after its forward, one
    unit's gradients reduced at a time. DeepSpeed's defaults (prefetch 5e7 elements, reuse distance
    1e9, overlap_comm on with a 5e8-element bucket) keep, at these sizes, the whole model gathered
    from forward to backward and every unit's full gradient in flight at once: about 8Ψ more at the
    peak than 16Ψ/N (TinyGPT small, 2 ranks: 60 MB for 30 MB of model states)."""
    from zerolab.bench.activations import largest_unit
    unit = largest_unit(model)
    return dict(stage3_param_persistence_threshold=0, stage3_prefetch_bucket_size=unit,
                stage3_max_reuse_distance=0, reduce_bucket_size=unit, allgather_bucket_size=unit)


def group_specs(model: str, stages, n: int, batch: int, peers: bool) -> list[Spec]:
    specs = []
    for s in stages:
        cfg = bp.ds_config(s, batch // n, **(stage3_knobs(model) if s == 3 else {}))
        specs.append(Spec(f"ours-{s}", "ours", s, bp.label("ours", s), cfg))
        kind = SWEEP_PEERS[s]
        if peers and (kind != "deepspeed" or bp.deepspeed_available()):
            specs.append(Spec(f"{kind}-{s}", kind, s, bp.label(kind, s), cfg))
    return specs


def entries(world: dict, model: str, psi: int, batch: int, scalings) -> list[dict]:
    """The sweep's rows from one ``run_world``: a row per contender and scaling."""
    from zerolab.bench.activations import engine_bytes, rest_model, step_bytes
    from zerolab.theory.memory import estimate
    n, out = world["world_size"], []
    for r in world["contenders"]:
        mem = r.get("memory_ranks") or [{}] * n
        states = [m.get("states") for m in mem]
        total = [s["params"] + s["grads"] + s["optimizer"] for s in states if s]
        peak = [m["peak"] for m in mem if m.get("peak") is not None]
        row = dict(model=model, psi=psi, world_size=n, stage=r["stage"], kind=r["kind"], label=r["label"],
                   global_batch=batch, micro_batch=batch // n,
                   model_state_bytes=max(total) if total else None,
                   model_states=states[0] if total else None,
                   estimate_bytes=estimate(psi, n, r["stage"], "fp32").total,
                   rest_model_bytes=rest_model(model, batch // n, n, r["stage"]) if r["kind"] == "ours" else None,
                   step_model_bytes=step_bytes(model, batch // n), engine_model_bytes=engine_bytes(model, r["stage"]),
                   peak_bytes=max(peak) if peak else None, peak_bytes_ranks=[m.get("peak") for m in mem],
                   held_bytes=max((m["held"] for m in mem if m.get("held") is not None), default=None),
                   median_ms=r["median_ms"], q1_ms=r["q1_ms"], q3_ms=r["q3_ms"], cpu_ms=r["cpu_ms"],
                   floor_ms=r["floor_ms"], efficiency=r["efficiency"], bytes_per_step=r["bytes_per_step"],
                   max_abs_diff=r["max_abs_diff"])
        if row["peak_bytes"] is not None and row["model_state_bytes"] is not None:
            row["rest_bytes"] = row["peak_bytes"] - row["model_state_bytes"]
            row["rest_ratio"] = row["rest_bytes"] / row["rest_model_bytes"]
        out += [dict(row, scaling=sc) for sc in scalings]
    return out


def sweep(models=SWEEP_MODELS, world_sizes=(1, 2, 4), stages=(0, 1, 2, 3), global_batch=4, micro_batch=1,
          steps=1, repeats=3, warmup=1, out="build/bench", timeout=1800, peers=True, verbose=True) -> dict:
    """Run the sweep; add ``sweep`` (the rows) to ``out/bench.json`` (made if missing), write
    ``sweep.png`` and ``sweep.md`` beside it; return the result."""
    from zerolab.bench.runner import run_world
    unknown = [m for m in models if m not in bp.BENCH_MODELS]
    if unknown:
        raise ValueError(f"unknown model(s) {unknown}; choose from {list(bp.BENCH_MODELS)}")
    if steps < 1 or repeats < 1 or warmup < 0 or micro_batch < 1:
        raise ValueError("--steps, --repeats and --micro-batch must be >= 1, --warmup >= 0")
    if any(not bp.ours_available(s) for s in stages):
        raise ValueError(f"zerolab implements stages {sorted(k for k in range(4) if bp.ours_available(k))}")
    from zerolab.theory.memory import estimate
    t_start, rows, runs, notes = time.perf_counter(), [], [], []
    for g in groups(models, world_sizes, global_batch, micro_batch):
        model, n, batch = g["model"], g["world_size"], g["batch"]
        psi = model_params(model)
        specs = group_specs(model, stages, n, batch, peers and model == PEER_MODEL)
        states = n * sum(estimate(psi, n, s.stage, "fp32").total for s in specs)
        together = states <= MEM_BUDGET
        if not together:
            notes.append(f"{model}, N={n}: {states / 1e9:.1f} GB of model states together; each contender "
                         f"timed in a launch of its own (not interleaved)")
        t0 = time.perf_counter()
        for part in ([specs] if together else [[s] for s in specs]):
            world = run_world(part, n, model, batch, steps, repeats, warmup, True, timeout, memory_main=_memory_main)
            world.update(model=model, batch=batch, scalings=g["scalings"])
            runs.append(world)
            rows += entries(world, model, psi, batch, g["scalings"])
        if verbose:
            from zerolab.bench.sweep_report import table
            print(f"{model} N={n} batch {batch} ({'+'.join(g['scalings'])}): {time.perf_counter() - t0:.0f} s\n"
                  + table([r for r in rows if r["model"] == model and r["world_size"] == n
                           and r["global_batch"] == batch]), flush=True)
    settings = dict(models=list(models), world_sizes=list(world_sizes), stages=list(stages),
                    global_batch=global_batch, micro_batch=micro_batch, steps=steps, repeats=repeats,
                    warmup=warmup, peers={s: SWEEP_PEERS[s] for s in stages} if peers else {},
                    peer_model=PEER_MODEL, seconds=time.perf_counter() - t_start,
                    date=time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()))
    result = dict(sweep=rows, sweep_settings=settings, sweep_notes=notes, sweep_runs=runs)
    if out:
        from zerolab.bench.sweep_report import save
        save(result, out)
    return result
