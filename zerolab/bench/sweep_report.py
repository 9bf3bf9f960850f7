"""The sweep's text table, README tables (``sweep.md``), log-log figure (``sweep.png``) and its
place in ``bench.json`` (the list ``sweep``, beside whatever a compare run wrote there)."""
from __future__ import annotations

import json
import os

MB = 1e6


def _mb(v) -> str:
    return "-" if v is None else f"{v / MB:.1f}"


def _ratio(v) -> str:
    return "-" if v is None else f"{v:.2f}"


def table(rows: list[dict]) -> str:
    """One line per row: memory measured against the formula, time against the floor."""
    head = (f"{'model':<7}{'N':>3} {'scaling':<7}{'stage':>6} {'contender':<30}{'states MB':>10}{'formula':>8}"
            f"{'peak MB':>8}{'rest MB':>8}{'modelled':>9}{'ratio':>6}{'ms':>8}{'floor':>7}{'eff':>6}")
    lines = [head]
    for r in rows:
        lines.append(f"{r['model']:<7}{r['world_size']:>3} {r['scaling']:<7}{r['stage']:>6} {r['label'][:29]:<30}"
                     f"{_mb(r['model_state_bytes']):>10}{_mb(r['estimate_bytes']):>8}{_mb(r['peak_bytes']):>8}"
                     f"{_mb(r.get('rest_bytes')):>8}{_mb(r.get('rest_model_bytes')):>9}{_ratio(r.get('rest_ratio')):>6}"
                     f"{r['median_ms']:>8.0f}{r['floor_ms']:>7.0f}{r['efficiency']:>6.2f}")
    return "\n".join(lines) + "\n"


def markdown(result: dict) -> str:
    """The README's sweep tables: ours per point (strong scaling; weak-scaling time beside it), then
    ours ÷ peer at the peer model."""
    rows = result["sweep"]
    ours = [r for r in rows if r["kind"] == "ours"]
    weak = {(r["model"], r["world_size"], r["stage"]): r for r in ours if r["scaling"] == "weak"}
    out = ["| model (Ψ) | N | stage | model states MB (formula) | peak MB | rest ÷ modelled | step ms "
           "(strong) | eff | step ms (weak) |", "|---|---|---|---|---|---|---|---|---|"]
    for r in ours:
        if r["scaling"] != "strong":
            continue
        w = weak.get((r["model"], r["world_size"], r["stage"]))
        same = "=" if r["model_state_bytes"] == r["estimate_bytes"] else "≠"
        out.append(f"| {r['model']} ({r['psi'] / 1e6:.1f}M) | {r['world_size']} | {r['stage']} | "
                   f"{_mb(r['model_state_bytes'])} {same} {_mb(r['estimate_bytes'])} | {_mb(r['peak_bytes'])} | "
                   f"{_ratio(r.get('rest_ratio'))} | {r['median_ms']:.0f} | {r['efficiency']:.2f} | "
                   + (f"{w['median_ms']:.0f} |" if w else "- |"))
    peers = [r for r in rows if r["kind"] != "ours" and r["scaling"] == "strong"]
    if peers:
        by = {(r["model"], r["world_size"], r["stage"], r["scaling"]): r for r in ours}
        ns = sorted({r["world_size"] for r in peers})
        out += ["", "| stage | ours ÷ peer, step time (peak MB ours / peer) | " + " | ".join(f"N = {n}" for n in ns)
                + " |", "|---|---|" + "---|" * len(ns)]
        for stage, label in dict.fromkeys((r["stage"], r["label"]) for r in peers):
            cells = []
            for n in ns:
                p = next((r for r in peers if r["stage"] == stage and r["world_size"] == n), None)
                o = by.get((p["model"], n, stage, "strong")) if p else None
                cells.append(f"{o['median_ms'] / p['median_ms']:.2f} ({_mb(o['peak_bytes'])} / {_mb(p['peak_bytes'])})"
                             if p and o else "-")
            out.append(f"| {stage} | vs {label} | " + " | ".join(cells) + " |")
    return "\n".join(out) + "\n"


def plot(result: dict, path: str) -> str | None:
    """Log-log: peak memory per rank and step time (ours, strong scaling), against Ψ at the largest N
    and against N at each model; dashed: the formula (memory) and the floor (time)."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    ours = [r for r in result["sweep"] if r["kind"] == "ours" and r["scaling"] == "strong" and r["peak_bytes"]]
    if not ours:
        return None
    n_max = max(r["world_size"] for r in ours)
    fig, axes = plt.subplots(2, 2, figsize=(9, 6.5))
    stages = sorted({r["stage"] for r in ours})
    for (row, key, formula, ylabel) in ((0, "peak_bytes", "formula_bytes", "peak per rank (MB)"),
                                        (1, "median_ms", "floor_ms", "step time (ms)")):
        for s in stages:
            pts = sorted(((r["psi"], r) for r in ours if r["stage"] == s and r["world_size"] == n_max),
                         key=lambda p: p[0])
            xs = [p for p, _ in pts]
            scale = MB if row == 0 else 1
            axes[row, 0].plot(xs, [r[key] / scale for _, r in pts], "o-", color=f"C{s}", label=f"stage {s}")
            axes[row, 0].plot(xs, [_formula(r, formula) / scale for _, r in pts], "--", color=f"C{s}", lw=1)
            for m, marker in zip(sorted({r["model"] for r in ours}, key=lambda m: _psi(ours, m)), "os^"):
                pts = sorted(((r["world_size"], r) for r in ours if r["stage"] == s and r["model"] == m),
                             key=lambda p: p[0])
                if len(pts) > 1:
                    axes[row, 1].plot([n for n, _ in pts], [r[key] / scale for _, r in pts], marker + "-",
                                      color=f"C{s}", label=f"{m}, stage {s}" if row == 0 else None, ms=4)
                    axes[row, 1].plot([n for n, _ in pts], [_formula(r, formula) / scale for _, r in pts], "--",
                                      color=f"C{s}", lw=0.8)
        axes[row, 0].set_ylabel(ylabel)
    for ax in axes.flat:
        ax.set_xscale("log")
        ax.set_yscale("log")
    ns = sorted({r["world_size"] for r in ours})
    for ax in axes[:, 1]:
        ax.set_xticks(ns, [str(n) for n in ns])
        ax.minorticks_off()
    axes[1, 0].set_xlabel(f"Ψ (parameters), N = {n_max}")
    axes[1, 1].set_xlabel("N ranks (fixed global batch)")
    for ax, size in ((axes[0, 0], 7), (axes[0, 1], 6)):
        if ax.get_legend_handles_labels()[0]:
            ax.legend(fontsize=size, ncol=1 if size == 7 else 2)
    axes[0, 0].set_title("solid: measured; dashed: zl.estimate + activation model", fontsize=8)
    axes[0, 1].set_title("dashed (time rows): the floor", fontsize=8)
    fig.suptitle("zerolab sweep: TinyGPT fp32 Adam, gloo on CPU, ours", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=80, metadata={"Software": None})
    plt.close(fig)
    return path


def _formula(r: dict, key: str) -> float:
    return r["estimate_bytes"] + r["rest_model_bytes"] if key == "formula_bytes" else r[key]


def _psi(rows, model) -> int:
    return next(r["psi"] for r in rows if r["model"] == model)


def _key(r: dict) -> tuple:
    return r["model"], r["world_size"], r["stage"], r["kind"], r["scaling"]


def save(result: dict, out: str) -> dict:
    """Add the sweep's rows to the list ``sweep`` of ``out/bench.json``, keeping what a compare run
    wrote there (or making a minimal one) and the points of earlier sweeps that this one did not
    measure again (so ``--models large --world-sizes 4`` adds to a sweep of the smaller sizes);
    ``sweep_settings``, ``sweep_notes`` and ``sweep_runs`` collect each run's. Writes ``sweep.png``
    and ``sweep.md`` (of all the points) beside it."""
    from zerolab.bench.runner import SCHEMA
    os.makedirs(out, exist_ok=True)
    path = os.path.join(out, "bench.json")
    doc = dict(schema=SCHEMA, mode="sweep", settings={}, notes=[], runs=[])
    if os.path.exists(path):
        with open(path) as f:
            doc = json.load(f)
    new = {_key(r) for r in result["sweep"]}
    doc["sweep"] = [r for r in doc.get("sweep", []) if _key(r) not in new] + result["sweep"]
    doc["sweep_settings"] = doc.get("sweep_settings", []) + [result["sweep_settings"]]
    doc["sweep_notes"] = doc.get("sweep_notes", []) + result["sweep_notes"]
    doc["sweep_runs"] = doc.get("sweep_runs", []) + result["sweep_runs"]
    result = doc
    files = {"json": path, "md": os.path.join(out, "sweep.md")}
    try:
        if plot(result, os.path.join(out, "sweep.png")):
            files["png"] = os.path.join(out, "sweep.png")
    except ImportError:
        doc["sweep_notes"] = doc.get("sweep_notes", []) + ["matplotlib is not installed: no figure"]
    with open(files["md"], "w") as f:
        f.write(markdown(result))
    doc["sweep_files"] = files
    with open(path, "w") as f:
        json.dump(doc, f, indent=1)
    print(f"wrote {', '.join(files.values())}", flush=True)
    return files
