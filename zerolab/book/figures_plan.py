"""The stage-choice procedure drawn from its own result (chapter 10).

``stage_choice_figure(plan, usable_bytes)`` takes what ``zl.choose_stage`` returned and
draws, for every candidate it weighed, the memory per GPU against the usable memory
(left) and the communication seconds per step against the compute (right), the chosen
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
    time.bar(range(len(cands)), [c.seconds for c in cands], color=colors)
    time.axhline(plan.compute_seconds, color="tab:red", linestyle=":", linewidth=1)
    time.set_ylabel("communication s per step")
    time.set_title(f"communication (dotted: compute {plan.compute_seconds:.2f} s)", fontsize=9)
    for ax in (mem, time):
        ax.set_xticks(range(len(cands)), names, fontsize=6)
    fitting = [c.name for c in cands if c.fits]
    alt = (f"Two bar charts over the {len(cands)} candidates choose_stage weighed for {title}. Left: memory per GPU "
           f"against the usable {usable_bytes / 1e9:.0f} GB; {len(fitting)} fit"
           + (f" ({', '.join(fitting)})" if fitting else "") + f". Right: communication per step against "
           f"{plan.compute_seconds:.2f} s of compute. Chosen: {plan.choice.name}, {plan.choice.device_bytes / 1e9:.0f} GB "
           f"and {plan.choice.seconds:.2f} s of communication.")
    return fig, alt
