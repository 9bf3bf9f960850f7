"""Choosing a ZeRO stage: the one procedure chapters 11, 12 and exercise 7 call (chapter 11).

    choose_stage(psi, n_gpus, gpu_bytes, activations, node="dgx-a100", grad_accum=g)

1. **Fit.** A candidate fits when its model states per GPU (``estimate(...).total``) plus
   ``activations`` are at most ``(1 - margin) x gpu_bytes``, and its host bytes at most
   ``host_bytes`` (when given).
2. **Least offload first.** Candidates come in levels: no offload (stages 0-3), then the
   optimizer on the CPU (stages 1-3), then parameters too (stage 3), then both on NVMe.
   Offload moves bytes over PCIe every step, so a level is tried only if none before fits.
3. **Least step time** within the level: communication (``step_comm_time`` on the given node
   or link, with ``grad_accum``) plus the offload terms, which are the same for every stage of
   a level.
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

**The full step.** Each candidate carries ``times``: ``{"compute", "comm", "offload",
"optimizer"}`` seconds per optimizer step for one rank, nothing overlapped — compute as given
(``compute_seconds``), the collectives, the offload traffic over PCIe and NVMe and the CPU
Adam (``theory.hardware.offload_step_seconds`` on the ``hardware`` preset: its PCIe, host
memory and NVMe; without ``hardware`` the node's preset of the same name, else ``"dgx-a100"``'s).
``plan.times`` is the chosen candidate's, ``plan.binding`` the term that bounds the step: a plan
that offloads the optimizer of 70B to one node's CPUs is bound by the CPU Adam, not by the
network.

``Plan.compute_ratio`` (communication / compute, when ``compute_seconds`` is given) says
whether data parallelism alone is enough: above 1 the step waits on the network unless
overlap hides it — the point to add tokens per step, ZeRO++, or tensor parallelism inside
the node.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field

from zerolab.theory.comm import step_comm_time
from zerolab.theory.hardware import HARDWARE, get_hardware, offload_step_seconds
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
    times: dict = field(default_factory=dict)   # compute, comm, offload, optimizer: seconds per step

    @property
    def step_seconds(self) -> float:
        """The full step, nothing overlapped (compute counts 0 when it was not given)."""
        return sum(v for v in self.times.values() if v is not None)

    @property
    def binding(self) -> str:
        """The term of ``times`` that bounds the step."""
        return max((k for k, v in self.times.items() if v is not None), key=lambda k: self.times[k])

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
    def times(self):
        return None if self.choice is None else self.choice.times

    @property
    def binding(self):
        return None if self.choice is None else self.choice.binding

    @property
    def compute_ratio(self):
        if self.choice is None or not self.compute_seconds:
            return None
        return self.choice.seconds / self.compute_seconds


def choose_stage(psi, n_gpus, gpu_bytes, activations=0, node=None, link=None, grad_accum=1, margin=0.1,
                 host_bytes=None, precision="mixed", optimizer="adam", compute_seconds=None,
                 allow_offload="nvme", hardware=None) -> Plan:
    """The procedure of the module docstring. ``node`` (a ``Node`` or preset name) or ``link``
    (one network for every collective) sets the communication time; one of them is needed, or
    ``hardware`` (a ``theory.HARDWARE`` preset), whose node is then used. ``hardware`` also sets
    PCIe, host memory and NVMe for the offload terms. ``allow_offload``: the most offload to
    consider, one of ``OFFLOAD``."""
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
    if hardware is not None:
        hw = get_hardware(hardware)
        node = hw.node if node is None and link is None else node
    else:
        hw = HARDWARE[node] if isinstance(node, str) and node in HARDWARE else HARDWARE["dgx-a100"]
    if node is None and link is None:
        raise ValueError("choose_stage needs node=, link= or hardware= (which network the collectives use)")
    net = dict(node=node) if node is not None else dict(link=link)
    rows, choice = [], None
    for level in LEVELS[: OFFLOAD.index(allow_offload) + 1]:
        fitting = []
        for stage, oo, op in level:
            est = estimate(psi, n_gpus, stage, precision, optimizer, oo, op)
            t = step_comm_time(psi, n_gpus, stage, grad_accum=grad_accum, dtype_bytes=dtype, **net)
            fits = est.total + activations <= usable and (host_bytes is None or est.host <= host_bytes)
            times = {"compute": compute_seconds, "comm": t,
                     **offload_step_seconds(psi, n_gpus, grad_accum, oo, op, hw)}
            rows.append(Candidate(stage, oo, op, est.total + activations, est.host, t, fits, times))
            if fits:
                fitting.append(rows[-1])
        if fitting and choice is None:
            def cost(c):
                return c.step_seconds - (compute_seconds or 0)
            fastest = min(cost(c) for c in fitting)
            choice = min((c for c in fitting if cost(c) <= fastest * (1 + TIE) or math.isclose(cost(c), fastest)),
                         key=lambda c: c.stage)
    return Plan(choice, rows, compute_seconds)
