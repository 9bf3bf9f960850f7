"""Printing and saving ``zerolab bench`` results: the text table, bench.json, bench.png (chapter 10)."""
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
    lines = [head, f"{'contender':<{width}}{'median ms':>10}{'IQR ms':>12}{'CPU ms':>8}{'held MB':>9}{'peak MB':>9}"
                   f"{'16Ψ/N MB':>9}{'algo MB/step':>13}{'max|Δp|':>9}"]
    for r in world["contenders"]:
        iqr = f"{r['q1_ms']:.0f}-{r['q3_ms']:.0f}"
        sent = f"{r['bytes_per_step'] / MB:.2f}" + ("" if r["bytes_source"] == "ledger" else "*")
        lines.append(f"{r['label']:<{width}}{r['median_ms']:>10.1f}{iqr:>12}{r['cpu_ms']:>8.0f}{_mb(r['held_bytes']):>9}"
                     f"{_mb(r['peak_bytes']):>9}{r['states_theory_bytes'] / MB:>9.1f}{sent:>13}"
                     f"{r['max_abs_diff']:>9.0e}")
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
    lines.append("CPU ms: CPU seconds per step of one rank (all its threads), mean over ranks; held/peak: resident MB the contender adds, max over ranks (VmHWM); 16Ψ/N: fp32 Adam model "
                 "states of its stage (theory); algo MB/step: algorithm bytes sent per step (the ring algorithm's bytes for "
                 "each call's sizes: our ledger, * = ring formulas; gloo itself moves ~2x for reduce-scatter); max|Δp|: final "
                 "parameters vs the first row")
    return "\n".join(lines) + "\n"


def text(result: dict) -> str:
    parts = [world_table(result, w) for w in result["runs"]]
    parts += [f"note: {n}\n" for n in result["notes"]]
    return "\n".join(parts)


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


def save(result: dict, out: str) -> dict:
    """Write ``bench.json`` (or ``overlap.json``) and the matching PNG into ``out``."""
    os.makedirs(out, exist_ok=True)
    stem = "overlap" if result["mode"] == "overlap" else "bench"
    paths = {"json": os.path.join(out, f"{stem}.json")}
    try:
        png = plot(result, os.path.join(out, f"{stem}.png"))
        if png:
            paths["png"] = png
    except ImportError:
        result["notes"].append("matplotlib is not installed: no plot")
    result["files"] = paths
    with open(paths["json"], "w") as f:
        json.dump(result, f, indent=1)
    print(f"wrote {', '.join(paths.values())}", flush=True)
    return paths
