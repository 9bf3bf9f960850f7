"""``python -m zerolab bench --replay CLUSTER ...``: the bench's own zerolab runs, replayed on modelled GPUs (chapter 11).

The timed bench runs on CPU ranks, where gloo's collectives share the cores with the compute: its
seconds are this machine's. For GPUs the bench traces *ours* at every stage and world size — the
same model, batch and DeepSpeed config as its timed rows, with ``{"zerolab": {"trace": true}}``
and the ring pair of collectives (reduce-scatter + all-gather, what NCCL runs; gloo's pair is a
CPU tuning, chapter 4) — one optimizer step after a warm-up step, and replays each trace with
``zl.replay`` on every named cluster. Every number here is **modelled** (``theory.replay``), at the
traced model's own size; nothing is timed, so it is the same on every machine, bit for bit.
Results go to ``replay.json`` and ``replay.md`` beside ``bench.json``; a ``bench.md`` already
there (the timed run's tables) gets the replay table as a section of its own, replaced on the next
replay, so the measured and the modelled tables sit in one file, each labelled.
"""
from __future__ import annotations

import json
import os
import time

SCHEMA = "zerolab-bench-replay/1"
SOURCE = "modelled: zl.replay of a traced step, not measured"


def traced_config(stage: int, micro: int, overlap_comm=None, bucket=None) -> dict:
    """The bench's config for ours at ``stage`` (``peers.ds_config``), traced, with the ring pair."""
    from zerolab.bench import peers as bp
    cfg = bp.ds_config(stage, micro, overlap_comm=overlap_comm, bucket=bucket)
    cfg["zerolab"] = {"trace": True, "collectives": "reduce_scatter"}
    return cfg


def _traced_steps(preset: str, configs: dict, batch: int) -> dict:
    """Runs on every rank: per stage, ``engine.events`` of one step after a warm-up step."""
    import torch.distributed as dist
    from zerolab.bench import peers as bp
    from zerolab.book.models import synthetic_batch
    rank, world = dist.get_rank(), dist.get_world_size()
    out = {}
    for stage, cfg in configs.items():
        r = bp.build("ours", preset, stage, cfg)
        for k in range(2):
            x, y = synthetic_batch(preset, batch, seed=0, step=k, rank=rank, world_size=world)
            r.engine.events.clear()
            r.step(x, y)
        out[stage] = list(r.engine.events)
        r.close()
    return out


def replay_bench(clusters, stages=(0, 1, 2, 3), world_sizes=(2, 4), model="small", batch=8, overlap_comm=None,
                 bucket=None, timeout=600) -> dict:
    """Trace ours per world size (one ``zl.launch`` each) and replay every stage on every cluster."""
    from zerolab.bench.specs import model_params
    from zerolab.runtime.launch import launch
    from zerolab.theory.replay import get_cluster, replay
    clusters = [str(c) for c in clusters]
    for c in clusters:
        get_cluster(c)                          # ReplayError names the presets before anything runs
    if any(batch % w for w in world_sizes):
        raise ValueError(f"--batch {batch} must be divisible by every world size {list(world_sizes)}")
    result = dict(schema=SCHEMA, mode="replay", source=SOURCE,
                  settings=dict(model=model, params=model_params(model), batch=batch, stages=list(stages),
                                world_sizes=list(world_sizes), clusters=clusters, precision="fp32",
                                collectives="reduce_scatter", overlap_comm=overlap_comm, bucket=bucket,
                                date=time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())),
                  rows=[])
    for w in world_sizes:
        configs = {s: traced_config(s, batch // w, overlap_comm, bucket) for s in stages}
        per_rank = launch(_traced_steps, world_size=w, threads=1, timeout=timeout, args=(model, configs, batch))
        for s in stages:
            traces = [r[s] for r in per_rank]
            for c in clusters:
                rep = replay(traces, c)
                result["rows"].append(dict(stage=s, world_size=w, cluster=c, cluster_name=str(rep.cluster),
                                           gpus=rep.cluster.gpus, step_ms=1e3 * rep.step_seconds,
                                           exposed_ms=1e3 * rep.exposed_comm[0],
                                           compute_ms=1e3 * rep.compute_seconds[0], mfu=rep.mfu,
                                           source="modelled"))
    return result


def markdown(result: dict) -> str:
    """The README's replay table: modelled ms per step (exposed communication in brackets), per stage,
    world size of the recording and cluster."""
    s = result["settings"]
    cols = [(w, c) for w in s["world_sizes"] for c in s["clusters"]]
    by = {(r["stage"], r["world_size"], r["cluster"]): r for r in result["rows"]}
    head = ("| stage | " + " | ".join(f"{w} ranks → {c} (modelled ms)" for w, c in cols) + " |\n"
            "|---|" + "---|" * len(cols))
    lines = [f"Replayed on modelled clusters ({result['source']}): {s['model']} TinyGPT, "
             f"{s['params']:,} parameters, fp32, global batch {s['batch']}; step ms (exposed communication ms)",
             "", head]
    for stage in s["stages"]:
        cells = [f"{by[stage, w, c]['step_ms']:.3f} ({by[stage, w, c]['exposed_ms']:.3f})"
                 if (stage, w, c) in by else "-" for w, c in cols]
        lines.append(f"| {stage} | " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def text(result: dict) -> str:
    lines = [f"zerolab bench --replay: {result['source']}",
             f"{'stage':<7}{'ranks':>6}  {'cluster':<18}{'GPUs':>5}{'step ms':>10}{'exposed ms':>12}{'MFU':>7}"]
    for r in result["rows"]:
        lines.append(f"{r['stage']:<7}{r['world_size']:>6}  {r['cluster']:<18}{r['gpus']:>5}{r['step_ms']:>10.3f}"
                     f"{r['exposed_ms']:>12.3f}{r['mfu']:>7.1%}")
    return "\n".join(lines) + "\n"


START, END = "<!-- replayed (modelled) -->", "<!-- end replayed -->"


def into_bench_md(bench_md: str, replay_md: str) -> str:
    """``bench_md`` with its replayed section (between ``START`` and ``END``) set to ``replay_md``."""
    head = bench_md.split(START)[0].rstrip("\n")
    tail = bench_md.split(END, 1)[1].lstrip("\n") if START in bench_md and END in bench_md else ""
    return f"{head}\n\n{START}\n{replay_md}{END}\n" + (f"\n{tail}" if tail else "")


def save(result: dict, out: str) -> dict:
    """Write ``replay.json`` and ``replay.md`` into ``out``; a ``bench.md`` there gets the table too."""
    os.makedirs(out, exist_ok=True)
    paths = {"json": os.path.join(out, "replay.json"), "md": os.path.join(out, "replay.md")}
    md = markdown(result)
    with open(paths["md"], "w") as f:
        f.write(md)
    bench_md = os.path.join(out, "bench.md")
    if os.path.exists(bench_md):
        with open(bench_md) as f:
            text = f.read()
        with open(bench_md, "w") as f:
            f.write(into_bench_md(text, md))
        paths["bench_md"] = bench_md
    result["files"] = paths
    with open(paths["json"], "w") as f:
        json.dump(result, f, indent=1)
    print(f"wrote {', '.join(paths.values())}", flush=True)
    return paths
