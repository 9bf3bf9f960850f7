"""Choosing a ZeRO stage: the one procedure chapters 10, 11 and exercise 7 call (chapter 10).

    choose_stage(psi, n_gpus, gpu_bytes, activations, node="dgx-a100", grad_accum=g)

1. **Fit.** A candidate fits when its model states per GPU (``estimate(...).total``) plus
   ``activations`` are at most ``(1 - margin) x gpu_bytes``, and its host bytes at most
   ``host_bytes`` (when given).
2. **Least offload first.** Candidates come in levels: no offload (stages 0-3), then the
   optimizer on the CPU (stages 1-3), then parameters too (stage 3), then both on NVMe.
   Offload moves bytes over PCIe every step, so a level is tried only if none before fits.
3. **Least communication** (``step_comm_time`` on the given node or link, with ``grad_accum``)
   within the level.
4. **Tie-break: the lower stage.** Times within ``TIE`` (1 %) count as equal, and the lower
   stage wins. At g = 1 DDP, ZeRO-1 and ZeRO-2 send the same bytes; the lower stage stays
   as fast when accumulation is raised later (ZeRO-2 then sends (g+1)/2 times more), keeps
   whole gradients for clipping and debugging, and is the stage pipeline parallelism accepts
   (DeepSpeed's pipeline engine asserts stage < 2). The memory a higher stage would free is
   only worth having if something uses it — and then it belongs in ``activations``, where
   rule 1 sees it.

Under the ring model communication never falls with the stage (DDP = ZeRO-1 <= ZeRO-2 <= ZeRO-3
for every g), so the procedure returns the lowest stage that fits with the least offload; the
times are what it reports beside the choice, and what decides between variants that are not
ordered (ZeRO++ flags, other nodes).

``Plan.compute_ratio`` (communication / compute, when ``compute_seconds`` is given) says
whether data parallelism alone is enough: above 1 the step waits on the network unless
overlap hides it — the point to add tokens per step, ZeRO++, or tensor parallelism inside
the node.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field

from zerolab.theory.comm import step_comm_time
from zerolab.theory.memory import estimate

TIE = 0.01
OFFLOAD = ("none", "optimizer", "optimizer+params", "nvme")   # allow_offload: the most offload to try
# (stage, offload_optimizer, offload_param) by offload level
LEVELS = (((0, "none", "none"), (1, "none", "none"), (2, "none", "none"), (3, "none", "none")),
          ((1, "cpu", "none"), (2, "cpu", "none"), (3, "cpu", "none")),
          ((3, "cpu", "cpu"),),
          ((3, "nvme", "nvme"),))


@dataclass(frozen=True)
class Candidate:
    stage: int
    offload_optimizer: str
    offload_param: str
    device_bytes: int        # model states + activations per GPU
    host_bytes: int
    seconds: float           # communication per optimizer step
    fits: bool

    @property
    def name(self) -> str:
        off = "" if self.offload_optimizer == "none" else f" + offload_optimizer={self.offload_optimizer}"
        off += "" if self.offload_param == "none" else f" + offload_param={self.offload_param}"
        return ("DDP" if self.stage == 0 else f"ZeRO-{self.stage}") + off


@dataclass(frozen=True)
class Plan:
    """The chosen candidate (``None`` if nothing fits) and every candidate considered."""
    choice: Candidate | None
    candidates: list = field(default_factory=list)
    compute_seconds: float | None = None

    @property
    def stage(self):
        return None if self.choice is None else self.choice.stage

    @property
    def name(self) -> str:
        return "nothing fits" if self.choice is None else self.choice.name

    @property
    def compute_ratio(self):
        if self.choice is None or not self.compute_seconds:
            return None
        return self.choice.seconds / self.compute_seconds


def choose_stage(psi, n_gpus, gpu_bytes, activations=0, node=None, link=None, grad_accum=1, margin=0.1,
                 host_bytes=None, precision="mixed", optimizer="adam", compute_seconds=None,
                 allow_offload="nvme") -> Plan:
    """The procedure of the module docstring. ``node`` (a ``Node`` or preset name) or ``link``
    (one network for every collective) sets the communication time; one of them is needed.
    ``allow_offload``: the most offload to consider, one of ``OFFLOAD``."""
    if allow_offload not in OFFLOAD:
        raise ValueError(f"allow_offload={allow_offload!r} is not allowed; expected one of {OFFLOAD}")
    if gpu_bytes <= 0:
        raise ValueError(f"gpu_bytes must be > 0, got {gpu_bytes!r}")
    if not 0 <= margin < 1:
        raise ValueError(f"margin must be in [0, 1), got {margin!r}")
    if activations < 0:
        raise ValueError(f"activations must be >= 0 bytes, got {activations!r}")
    usable = (1 - margin) * gpu_bytes
    dtype = 4 if precision == "fp32" else 2
    net = dict(node=node) if node is not None else dict(link=link)
    rows, choice = [], None
    for level in LEVELS[: OFFLOAD.index(allow_offload) + 1]:
        fitting = []
        for stage, oo, op in level:
            est = estimate(psi, n_gpus, stage, precision, optimizer, oo, op)
            t = step_comm_time(psi, n_gpus, stage, grad_accum=grad_accum, dtype_bytes=dtype, **net)
            fits = est.total + activations <= usable and (host_bytes is None or est.host <= host_bytes)
            rows.append(Candidate(stage, oo, op, est.total + activations, est.host, t, fits))
            if fits:
                fitting.append(rows[-1])
        if fitting and choice is None:
            fastest = min(c.seconds for c in fitting)
            choice = min((c for c in fitting if c.seconds <= fastest * (1 + TIE) or math.isclose(c.seconds, fastest)),
                         key=lambda c: c.stage)
    return Plan(choice, rows, compute_seconds)
