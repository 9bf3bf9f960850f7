"""Printing and saving ``zerolab bench`` results: the text table, bench.json, bench.png,
bench.md (the README's tables, rendered from the run; chapter 12)."""
from __future__ import annotations

import json
import os

MB = 1e6


def ratios(world: dict) -> list[dict]:
    """ours / peer median step time, per stage, from the same run."""
    rows = {r["key"]: r for r in world["contenders"]}
    out = []
    for r in world["contenders"]:
        ours = rows.get(f"ours-{r['stage']}")
        if r["kind"] != "ours" and ours is not None:
            out.append(dict(stage=r["stage"], peer=r["label"], peer_key=r["key"], ours_ms=ours["median_ms"],
                            peer_ms=r["median_ms"], ratio=ours["median_ms"] / r["median_ms"],
                            cpu_ratio=ours["cpu_ms"] / r["cpu_ms"]))
    return out


def speedups(world: dict) -> list[dict]:
    """--overlap: serial / overlapped median step time per stage and link."""
    rows = {r["key"]: r for r in world["contenders"]}
    out = []
    for r in world["contenders"]:
        if "-overlap-" in r["key"]:
            serial = rows[r["key"].replace("-overlap-", "-serial-")]
            out.append(dict(stage=r["stage"], link=r["link"] or "loopback", serial_ms=serial["median_ms"],
                            overlap_ms=r["median_ms"], speedup=serial["median_ms"] / r["median_ms"]))
    return out


def _mb(values) -> str:
    vals = [v for v in values if v is not None]
    return f"{max(vals) / MB:.1f}" if vals else "-"


def world_table(result: dict, world: dict) -> str:
    """One world size: a row per contender, then ours/peer ratios (or overlap speed-ups)."""
    s = result["settings"]
    head = (f"zerolab bench: {s['model']} TinyGPT ({s['params'] / 1e6:.2f}M params), {world['world_size']} ranks, "
            f"gloo, 1 thread/rank, global batch {s['batch']}, {s['repeats']} interleaved rounds x {s['steps']} steps\n"
            f"config shared by ours and DeepSpeed: fp32, Adam, reduce/allgather_bucket_size "
            f"{s.get('bucket') or '5e8 (default)'}, overlap_comm "
            + ("per row" if result["mode"] == "overlap" else
               {None: "default (off for stages 0-2)", True: "on", False: "off"}[s.get("overlap_comm")])
            + (f"; simulated link {s['link']} where named" if result["mode"] == "overlap" else ""))
    width = max([46] + [len(r["label"]) + 1 for r in world["contenders"]])
    lines = [head, f"{'contender':<{width}}{'median ms':>10}{'IQR ms':>12}{'CPU ms':>8}{'floor ms':>9}{'eff':>6}"
                   f"{'held MB':>9}{'peak MB':>9}{'16Ψ/N MB':>9}{'peak-16Ψ/N':>11}{'algo MB/step':>13}{'max|Δp|':>9}"]
    for r in world["contenders"]:
        iqr = f"{r['q1_ms']:.0f}-{r['q3_ms']:.0f}"
        sent = f"{r['bytes_per_step'] / MB:.2f}" + ("" if r["bytes_source"] == "ledger" else "*")
        over = r.get("peak_minus_states_bytes")
        lines.append(f"{r['label']:<{width}}{r['median_ms']:>10.1f}{iqr:>12}{r['cpu_ms']:>8.0f}"
                     f"{r.get('floor_ms', float('nan')):>9.1f}{r.get('efficiency', float('nan')):>6.2f}"
                     f"{_mb(r['held_bytes']):>9}{_mb(r['peak_bytes']):>9}{r['states_theory_bytes'] / MB:>9.1f}"
                     f"{'-' if over is None else f'{over / MB:.1f}':>11}{sent:>13}{r['max_abs_diff']:>9.0e}")
    if world.get("ratios"):
        lines.append("ours / peer (median step time, same run; < 1 means ours is faster; CPU: CPU time per step):")
        for q in world["ratios"]:
            lines.append(f"  stage {q['stage']}  vs {q['peer']:<38} {q['ratio']:.2f}x "
                         f"({q['ours_ms']:.1f} / {q['peer_ms']:.1f} ms)   CPU {q['cpu_ratio']:.2f}x")
    if world.get("speedups"):
        lines.append("overlap_comm speed-up (serial / overlapped median step time):")
        for q in world["speedups"]:
            lines.append(f"  stage {q['stage']}  {q['link']:<10} {q['speedup']:.2f}x "
                         f"({q['serial_ms']:.1f} -> {q['overlap_ms']:.1f} ms)")
    if world.get("floor"):
        f = world["floor"]
        lines.append(f"floor, same run: one rank's micro-batch alone {f['compute_ms']:.1f} ms (of which the optimizer "
                     f"step {f.get('optimizer_ms', float('nan')):.1f} ms; sharded rows need 1/N of it) + a bare "
                     f"all-reduce of Ψ fp32 {f['comm_ms']:.1f} ms ({f['comm_bytes'] / MB:.2f} MB sent), scaled to "
                     f"each row's bytes")
    lines.append("CPU ms: CPU seconds per step of one rank (all its threads), mean over ranks; floor: the step with no "
                 "overhead (bench/floor.py); eff: floor / median; held/peak: resident MB the contender adds, max over "
                 "ranks (VmHWM); 16Ψ/N: fp32 Adam model states of its stage (theory); peak-16Ψ/N: the rest of the "
                 "peak (activations, buffers, temporaries); algo MB/step: algorithm bytes sent per step (the ring algorithm's bytes for "
                 "each call's sizes: our ledger, * = ring formulas; gloo itself moves ~2x for reduce-scatter); max|Δp|: final "
                 "parameters vs the first row")
    return "\n".join(lines) + "\n"


def text(result: dict) -> str:
    parts = [world_table(result, w) for w in result["runs"]]
    parts += [f"note: {n}\n" for n in result["notes"]]
    return "\n".join(parts)


def markdown(result: dict) -> str:
    """The README's two tables from one compare run: ours ÷ peer median step time (CPU time in
    brackets), then every contender's efficiency, resident peak and peak above 16Ψ/N, per world size."""
    runs = [w for w in result["runs"] if w.get("ratios") is not None]
    ns = [w["world_size"] for w in runs]
    head = "| stage | peer | " + " | ".join(f"{n} ranks" for n in ns) + " |\n|---|---|" + "---|" * len(ns)
    keys = list(dict.fromkeys((q["stage"], q["peer_key"], q["peer"]) for w in runs for q in w["ratios"]))
    by = {(w["world_size"], q["peer_key"]): q for w in runs for q in w["ratios"]}
    lines = [head]
    for stage, key, label in keys:
        cells = [f"{by[n, key]['ratio']:.2f} ({by[n, key]['cpu_ratio']:.2f})" if (n, key) in by else "-" for n in ns]
        lines.append(f"| {stage} | {label} | " + " | ".join(cells) + " |")
    mem = ["", "| stage | contender | " + " | ".join(f"eff {n}" for n in ns) + " | "
           + " | ".join(f"peak MB {n}" for n in ns) + " | " + " | ".join(f"peak−16Ψ/N MB {n}" for n in ns)
           + " |", "|---|---|" + "---|" * (3 * len(ns))]
    rows = {(w["world_size"], r["key"]): r for w in runs for r in w["contenders"]}
    for key, label, stage in dict.fromkeys((r["key"], r["label"], r["stage"]) for w in runs for r in w["contenders"]):
        got = [rows.get((n, key)) for n in ns]
        eff = [f"{r['efficiency']:.2f}" if r and r.get("efficiency") is not None else "-" for r in got]
        peak = [_mb(r["peak_bytes"]) if r else "-" for r in got]
        rest = [f"{r['peak_minus_states_bytes'] / MB:.1f}" if r and r.get("peak_minus_states_bytes") is not None
                else "-" for r in got]
        mem.append(f"| {stage} | {label} | " + " | ".join(eff + peak + rest) + " |")
    return "\n".join(lines + mem) + "\n"


SHORT = {"ddp": "DDP", "zero_redundancy": "ZeroRedundancy\nOptimizer", "fsdp2": "FSDP2", "deepspeed": "DeepSpeed"}


def plot(result: dict, path: str) -> str | None:
    """Bar chart: ours/peer ratios (compare; wall time solid, CPU time hatched) or overlap
    speed-ups, one colour per world size."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    key = "speedups" if result["mode"] == "overlap" else "ratios"
    bars = [(w["world_size"], q) for w in result["runs"] for q in w.get(key, [])]
    if not bars:
        return None
    fig, ax = plt.subplots(figsize=(max(6, 0.9 * len(bars) + 2), 4))
    sizes = sorted({n for n, _ in bars})
    for i, (n, q) in enumerate(bars):
        color = f"C{sizes.index(n)}"
        label = f"N = {n}" if all(m != n for m, _ in bars[:i]) else None
        if key == "ratios":
            ax.bar(i - 0.2, q["ratio"], 0.4, color=color, label=label)
            ax.bar(i + 0.2, q["cpu_ratio"], 0.4, color=color, alpha=0.45, hatch="//")
        else:
            ax.bar(i, q["speedup"], 0.6, color=color, label=label)
    if key == "ratios":
        names = [f"stage {q['stage']}\nvs\n{SHORT[q['peer_key'].split('-')[0]]}" for _, q in bars]
        ylabel = "ours / peer step time\n(solid: wall median, hatched: CPU)"
    else:
        names = [f"stage {q['stage']}\n{q['link']}" for _, q in bars]
        ylabel = "serial / overlapped step time"
    ax.axhline(1.0, color="k", lw=1, ls="--")
    ax.set_xticks(range(len(bars)), names, fontsize=7)
    ax.set_ylabel(ylabel)
    ax.legend(fontsize=8)
    s = result["settings"]
    ax.set_title(f"zerolab bench ({s['model']} TinyGPT, gloo, 1 thread/rank)"
                 + (f", link {s['link']}" if key == "speedups" else ", no simulated link"), fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def plot_memory(result: dict, path: str) -> str | None:
    """Peak resident MB per contender (max over ranks), grouped by stage, one panel per world
    size; the model states of the stage (16Ψ/N, theory) as a black tick on each bar."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    runs = [w for w in result["runs"] if any(r["peak_bytes"] and r["peak_bytes"][0] is not None
                                             for r in w["contenders"])]
    if not runs or result["mode"] == "overlap":
        return None
    fig, axes = plt.subplots(1, len(runs), figsize=(5.5 * len(runs), 3.8), squeeze=False)
    for ax, w in zip(axes[0], runs):
        rows = [r for r in w["contenders"] if r["peak_bytes"][0] is not None]
        for i, r in enumerate(rows):
            color = "C0" if r["kind"] == "ours" else "0.6"
            ax.bar(i, max(r["peak_bytes"]) / MB, 0.7, color=color)
            ax.plot([i - 0.35, i + 0.35], [r["states_theory_bytes"] / MB] * 2, color="k", lw=2)
        names = [f"{r['stage']}: " + ("ours" if r["kind"] == "ours" else
                                      SHORT.get(r["kind"], r["kind"]).replace("\n", " ")) for r in rows]
        ax.set_xticks(range(len(rows)), names, fontsize=7, rotation=60)
        ax.set_ylabel("peak resident MB per rank")
        ax.set_title(f"N = {w['world_size']} (blue: zerolab; black: 16Ψ/N)", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def save(result: dict, out: str) -> dict:
    """Write ``bench.json`` (or ``overlap.json``) and the matching PNG into ``out``."""
    os.makedirs(out, exist_ok=True)
    stem = "overlap" if result["mode"] == "overlap" else "bench"
    paths = {"json": os.path.join(out, f"{stem}.json")}
    try:
        png = plot(result, os.path.join(out, f"{stem}.png"))
        if png:
            paths["png"] = png
        mem = plot_memory(result, os.path.join(out, f"{stem}_memory.png"))
        if mem:
            paths["memory_png"] = mem
    except ImportError:
        result["notes"].append("matplotlib is not installed: no plot")
    if result["mode"] == "compare":
        paths["md"] = os.path.join(out, f"{stem}.md")
        with open(paths["md"], "w") as f:
            f.write(markdown(result))
    result["files"] = paths
    with open(paths["json"], "w") as f:
        json.dump(result, f, indent=1)
    print(f"wrote {', '.join(paths.values())}", flush=True)
    return paths
