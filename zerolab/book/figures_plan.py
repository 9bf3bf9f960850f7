"""The stage-choice procedure drawn from its own result (chapter 12).

``stage_choice_figure(plan, usable_bytes)`` takes what ``zl.choose_stage`` returned and
draws, for every candidate it weighed, the memory per GPU against the usable memory
(left) and the full step without compute — communication, offload traffic (PCIe, NVMe)
and the CPU optimizer, stacked (``plan.times``) — against the compute (right), the chosen
candidate marked. It returns ``(fig, alt)`` for ``plots.show(fig, alt=alt)``; the alt
text is computed from the same plan, so it cannot disagree with the bars.
"""
from __future__ import annotations

from zerolab.book.plots import new_axes


def stage_choice_figure(plan, usable_bytes: float, title: str = ""):
    """Memory and communication time of each candidate of ``plan`` (a ``choose_stage`` result)."""
    cands = list(plan.candidates)
    names = [c.name.replace(" + ", "\n+ ").replace("offload_optimizer=", "opt ").replace("offload_param=", "param ")
             for c in cands]
    colors = ["tab:green" if c == plan.choice else ("tab:blue" if c.fits else "tab:gray") for c in cands]
    fig, (mem, time) = new_axes(figsize=(11, 3.6), ncols=2)
    mem.bar(range(len(cands)), [c.device_bytes / 1e9 for c in cands], color=colors)
    mem.axhline(usable_bytes / 1e9, color="black", linestyle="--", linewidth=1)
    mem.set_yscale("log")
    mem.set_ylabel("GB per GPU")
    mem.set_title(f"{title}: memory (dashed: usable {usable_bytes / 1e9:.0f} GB)", fontsize=9)
    bottom = [0.0] * len(cands)
    for term, hatch in (("comm", ""), ("offload", "//"), ("optimizer", "xx")):
        vals = [c.times[term] for c in cands]
        time.bar(range(len(cands)), vals, bottom=bottom, color=colors, hatch=hatch, edgecolor="white",
                 label=term)
        bottom = [b + v for b, v in zip(bottom, vals)]
    time.axhline(plan.compute_seconds, color="tab:red", linestyle=":", linewidth=1)
    time.set_ylabel("s per step")
    time.set_title(f"comm (plain), offload (//), CPU Adam (xx); dotted: compute {plan.compute_seconds:.2f} s",
                   fontsize=8)
    for ax in (mem, time):
        ax.set_xticks(range(len(cands)), names, fontsize=6)
    fitting = [c.name for c in cands if c.fits]
    t = plan.times
    alt = (f"Two bar charts over the {len(cands)} candidates choose_stage weighed for {title}. Left: memory per GPU "
           f"against the usable {usable_bytes / 1e9:.0f} GB; {len(fitting)} fit"
           + (f" ({', '.join(fitting)})" if fitting else "") + ". Right: per step, communication, offload traffic "
           f"and the CPU optimizer stacked, against {plan.compute_seconds:.2f} s of compute. Chosen: "
           f"{plan.choice.name}, {plan.choice.device_bytes / 1e9:.0f} GB; {t['comm']:.2f} s of communication, "
           f"{t['offload']:.2f} s of offload traffic, {t['optimizer']:.2f} s of CPU Adam: bound by {plan.binding}.")
    return fig, alt
