"""Conceptual figures for offload (chapter 7), drawn from zerolab's own estimate and cost model.

* ``tier_figure``: where each byte of model state lives — device, host, NVMe — per rank, for
  each offload setting, read from ``zl.estimate``.
* ``offload_path_figure``: the data path of one optimizer step under offload, with the bytes
  per owned parameter on each arrow, recovered from ``theory.offload.offload_seconds``
  (seconds × the bandwidth it used), so the picture is the arithmetic the chapter prints.

Each returns ``(fig, alt)`` for ``plots.show(fig, alt=alt)``, as ``zerolab.book.figures`` does.
"""
from __future__ import annotations

from zerolab.theory import offload as cost
from zerolab.theory.hardware import get_hardware
from zerolab.theory.memory import estimate

TIERS = ("total", "host", "nvme")           # estimate's fields: device (model states), host, NVMe
TIER_NAMES = {"total": "device", "host": "host RAM", "nvme": "NVMe"}
SETTINGS = ((2, "none", "none"), (2, "cpu", "none"), (3, "none", "none"), (3, "cpu", "none"),
            (3, "cpu", "cpu"), (3, "nvme", "nvme"))


def tiers(psi, n, settings=SETTINGS) -> list[dict]:
    """``[{"label", "total", "host", "nvme"}]``: bytes per rank in each tier, from ``zl.estimate``."""
    out = []
    for stage, oo, op in settings:
        e = estimate(psi, n, stage, offload_optimizer=oo, offload_param=op).as_dict()
        out.append({"label": f"ZeRO-{stage}\nopt {oo}\nparams {op}", **{t: e[t] for t in TIERS}})
    return out


def tier_figure(psi=7e9, n=8, settings=SETTINGS, ax=None):
    """Stacked bars: GB per rank on the device, in host RAM and on NVMe, one bar per setting."""
    from zerolab.book.plots import new_axes
    ax = ax or new_axes(figsize=(8.5, 3.8))[1]
    rows = tiers(psi, n, settings)
    bottom = [0.0] * len(rows)
    for t, color in zip(TIERS, ("tab:blue", "tab:orange", "tab:gray")):
        vals = [r[t] / 1e9 for r in rows]
        ax.bar(range(len(rows)), vals, bottom=bottom, color=color, label=TIER_NAMES[t])
        bottom = [b + v for b, v in zip(bottom, vals)]
    ax.set_xticks(range(len(rows)), [r["label"] for r in rows], fontsize=7)
    ax.set_ylim(0, 1.08 * max(bottom))       # headroom: the tallest stack does not touch the frame
    ax.set_xlabel("setting: ZeRO stage, optimizer offload, parameter offload")
    ax.set_ylabel("GB per rank (model states)")
    ax.set_title(f"Where the bytes live: Ψ = {psi / 1e9:g}B, N = {n}, mixed-precision Adam (zl.estimate)")
    ax.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.01, 1.0))    # beside the bars, not over them
    alt = (f"Stacked bars of model-state bytes per rank for Ψ = {psi / 1e9:g}B on {n} ranks: "
           + "; ".join(r["label"].replace("\n", ", ") + ": " + ", ".join(
               f"{TIER_NAMES[t]} {r[t] / 1e9:.2f} GB" for t in TIERS) for r in rows) + ".")
    return ax.figure, alt


def path_bytes(hw=None) -> dict:
    """Bytes per owned parameter per optimizer step on each path, from ``offload_seconds``' terms."""
    hw = get_hardware(hw or "dgx-a100")
    psi, n = 1e9, 1                        # shard = psi: seconds × bandwidth / shard = bytes per parameter
    t = cost.offload_seconds(psi, n, 1, 1, "nvme", "none", hw)
    share = hw.per_gpu(n)                  # the bandwidths offload_seconds divided by
    return {"pcie": t["optimizer: PCIe (grads down, params up)"] * share["pcie"] / psi,
            "host": t["optimizer: CPU Adam (host memory)"] * share["host_memory"] / psi,
            "nvme": t["optimizer: NVMe (state in and out)"] * share["nvme"] / psi}


def offload_path_figure(hw=None, ax=None):
    """Boxes GPU, host (CPU Adam) and NVMe; arrows carry the bytes per parameter of one step."""
    from zerolab.book.plots import new_axes
    ax = ax or new_axes(figsize=(8.5, 3.0))[1]
    b = path_bytes(hw)
    boxes = {"GPU\n16-bit params": 0.1, "host RAM: CPU Adam\nfp32 grads, master, m, v": 0.5, "NVMe\n(ZeRO-Infinity)": 0.9}
    for text, x in boxes.items():
        ax.text(x, 0.5, text, ha="center", va="center", fontsize=9,
                bbox=dict(boxstyle="round", facecolor="white", edgecolor="black"))
    arrows = [(0.2, 0.62, 0.38, f"grads down {b['pcie'] / 2:g} B"), (0.38, 0.38, 0.2, f"params up {b['pcie'] / 2:g} B"),
              (0.62, 0.62, 0.8, f"state written {b['nvme'] / 2:g} B"), (0.8, 0.38, 0.62, f"state read {b['nvme'] / 2:g} B")]
    for x0, y, x1, label in arrows:
        ax.annotate("", (x1, y), (x0, y), arrowprops=dict(arrowstyle="-|>", lw=1.6))
        ax.text((x0 + x1) / 2, y + (0.07 if y > 0.5 else -0.07), label, ha="center", va="center", fontsize=8)
    ax.text(0.5, 0.12, f"CPU Adam: {b['host']:g} B through host memory", ha="center", fontsize=8)
    ax.set_xlim(0, 1), ax.set_ylim(0, 1), ax.axis("off")
    ax.set_title("One optimizer step under offload: bytes per owned parameter (theory.offload)")
    alt = (f"Data path of one offloaded optimizer step, bytes per owned parameter: over PCIe the 16-bit gradient "
           f"goes down ({b['pcie'] / 2:g} B) and the 16-bit parameter comes up ({b['pcie'] / 2:g} B); the CPU Adam "
           f"step moves {b['host']:g} B through host memory; with the optimizer on NVMe its fp32 state is read "
           f"({b['nvme'] / 2:g} B) and written back ({b['nvme'] / 2:g} B).")
    return ax.figure, alt
