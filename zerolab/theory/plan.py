"""Choosing a ZeRO stage: the one procedure chapters 12, 14 and exercise 7 call (chapter 12).

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

**Choosing a mesh** (chapter 10). With ``tp=``/``pp=`` given as the sizes allowed, every mesh
DP x TP x PP = N of them is a candidate beside the stage and the offload, by the same rules: a mesh
is allowed when TP stays inside a node (it all-reduces every block), PP has at most ``layers`` stages
and runs only ZeRO-0/1 (DeepSpeed's pipeline engine asserts stage < 2; zerolab's refuses 2/3), and the
batch splits into whole micro-batches per DP rank. Memory: ``estimate(..., tp=, pp=, replicated=)``
plus ``activations`` / tp (Megatron with sequence parallelism splits them by tp; 1F1B's first stage
keeps p micro-batches of L/p blocks, one micro-batch's worth of the whole model), or
``activations(tp, pp)`` when a function is given. Time: the whole step of ``theory.time3d`` — compute,
TP's all-reduces on NVLink, PP's sends and bubble (p - 1)/(m + p - 1), the DP ZeRO traffic over the
node's NICs, offload — since compute and the bubble differ between meshes: ``times`` holds
``{"compute", "bubble", "comm", "offload", "optimizer"}``, and ``candidate.axes`` the comm by group. Ties (within ``TIE``) go
to the least model parallelism, then the lower stage. ``plan.dp``, ``plan.tp``, ``plan.pp`` hold the
mesh (``dp = n_gpus`` for a plan without choices), ``plan.why`` the rule's answer in words.

``Plan.compute_ratio`` (communication / compute, when ``compute_seconds`` is given) says
whether data parallelism alone is enough: above 1 the step waits on the network unless
overlap hides it — the point to add tokens per step, ZeRO++, or tensor parallelism inside
the node.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field

from zerolab.theory.comm import step_comm_time
from zerolab.theory.hardware import HARDWARE, get_hardware, offload_step_seconds, with_node
from zerolab.theory.memory import estimate
from zerolab.theory.time3d import mesh_step_times

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
    dp: int = 0              # the mesh (3D): DP x TP x PP = n_gpus; today's plans: dp = n_gpus
    tp: int = 1
    pp: int = 1
    axes: dict = field(default_factory=dict)    # a mesh's times["comm"] by group: {"tp", "pp", "dp"} seconds

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
        mesh = f"TP={self.tp} x PP={self.pp} x DP={self.dp}, " if (self.tp, self.pp) != (1, 1) else ""
        return mesh + ("DDP" if self.stage == 0 else f"ZeRO-{self.stage}") + off


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
    def dp(self):
        return None if self.choice is None else self.choice.dp

    @property
    def tp(self):
        return None if self.choice is None else self.choice.tp

    @property
    def pp(self):
        return None if self.choice is None else self.choice.pp

    @property
    def why(self) -> str:
        """The rule's answer in words: what fits, at which offload level, what it costs, what binds it."""
        if self.choice is None:
            return "nothing fits: no candidate's model states plus activations are within the GPU (and host) memory"
        c, rows = self.choice, self.candidates
        fits = [r for r in rows if r.fits]
        level = [r for r in fits if (r.offload_optimizer, r.offload_param) == (c.offload_optimizer, c.offload_param)]
        return (f"{c.name}: {len(fits)} of {len(rows)} candidates fit in memory; the least offload that fits is "
                f"{'none' if c.offload_optimizer == 'none' else c.name.split(' + ', 1)[1]}, and among its {len(level)} "
                f"candidates this one has the shortest step ({c.step_seconds:.3g} s, ties within {TIE:.0%} to the "
                f"less model parallelism and the lower stage), bound by {c.binding}")

    @property
    def compute_ratio(self):
        if self.choice is None or not self.compute_seconds:
            return None
        return self.choice.seconds / self.compute_seconds


def choose_stage(psi, n_gpus, gpu_bytes, activations=0, node=None, link=None, grad_accum=1, margin=0.1,
                 host_bytes=None, precision="mixed", optimizer="adam", compute_seconds=None,
                 allow_offload="nvme", hardware=None, *, tp=1, pp=1, layers=None, hidden=None, seq=None,
                 micro_batch=None, batch=None, replicated=0, recompute=False) -> Plan:
    """The procedure of the module docstring. ``node`` (a ``Node`` or preset name) or ``link``
    (one network for every collective) sets the communication time; one of them is needed, or
    ``hardware`` (a ``theory.HARDWARE`` preset), whose node is then used. ``hardware`` also sets
    PCIe, host memory and NVMe for the offload terms. ``allow_offload``: the most offload to
    consider, one of ``OFFLOAD``.

    ``tp``, ``pp``: the sizes allowed (an int or a tuple, e.g. ``tp=(1, 2, 4, 8), pp=(1, 2, 4)``); with
    more than 1 the procedure chooses a mesh too (``plan.dp``, ``plan.tp``, ``plan.pp``; module docstring,
    "Choosing a mesh"), and needs ``node`` or ``hardware`` and the model's ``layers``, ``hidden``, ``seq``,
    ``micro_batch``; ``batch`` (sequences per step, all ranks) defaults to n_gpus·micro_batch·grad_accum."""
    tps, pps = _sizes("tp", tp), _sizes("pp", pp)
    if (tps, pps) != ((1,), (1,)):
        return _choose_mesh(psi, n_gpus, gpu_bytes, activations, node, link, grad_accum, margin, host_bytes,
                            precision, optimizer, compute_seconds, allow_offload, hardware, tps, pps, layers, hidden,
                            seq, micro_batch, batch, replicated, recompute)
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
            rows.append(Candidate(stage, oo, op, est.total + activations, est.host, t, fits, times, n_gpus))
            if fits:
                fitting.append(rows[-1])
        if fitting and choice is None:
            def cost(c):
                return c.step_seconds - (compute_seconds or 0)
            fastest = min(cost(c) for c in fitting)
            choice = min((c for c in fitting if cost(c) <= fastest * (1 + TIE) or math.isclose(cost(c), fastest)),
                         key=lambda c: c.stage)
    return Plan(choice, rows, compute_seconds)


def _sizes(name, v) -> tuple:
    vs = (v,) if isinstance(v, int) and not isinstance(v, bool) else tuple(v) if isinstance(v, (tuple, list)) else None
    if not vs or any(isinstance(x, bool) or not isinstance(x, int) or x < 1 for x in vs):
        raise ValueError(f"{name} must be an integer >= 1 or a tuple of them (the sizes allowed), got {v!r}")
    return tuple(sorted(set(vs)))


def _near(cands):
    fastest = min(c.step_seconds for c in cands)
    return [c for c in cands if c.step_seconds <= fastest * (1 + TIE) or math.isclose(c.step_seconds, fastest)]


def _pick(fitting):
    """Least step time; within TIE the least model parallelism (tp·pp), the fastest mesh of those, and of
    that mesh's candidates within TIE the lower stage."""
    near = _near(fitting)
    least = min(c.tp * c.pp for c in near)
    best = min((c for c in near if c.tp * c.pp == least), key=lambda c: c.step_seconds)
    return min(_near([c for c in fitting if (c.tp, c.pp) == (best.tp, best.pp)]), key=lambda c: c.stage)


def _choose_mesh(psi, n, gpu_bytes, activations, node, link, grad_accum, margin, host_bytes, precision, optimizer,
                 compute_seconds, allow_offload, hardware, tps, pps, layers, hidden, seq, micro_batch, batch,
                 replicated, recompute) -> Plan:
    """Choosing a mesh (module docstring): every (tp, pp) allowed that divides n, TP inside a node, PP with
    ZeRO-0/1 only; rule 1 (fit) and 2 (least offload) over all of them, then rule 3 on the full step."""
    if allow_offload not in OFFLOAD:
        raise ValueError(f"allow_offload={allow_offload!r} is not allowed; expected one of {OFFLOAD}")
    if gpu_bytes <= 0 or not 0 <= margin < 1:
        raise ValueError(f"gpu_bytes must be > 0 and margin in [0, 1), got {gpu_bytes!r}, {margin!r}")
    if link is not None or (node is None and hardware is None):
        raise ValueError("choosing a mesh (tp=/pp= choices) needs node= or hardware= (GPUs and NICs per node), "
                         "not link=")
    hw = get_hardware(hardware) if hardware is not None else \
        with_node(HARDWARE[node] if isinstance(node, str) and node in HARDWARE else HARDWARE["dgx-a100"], node)
    if hardware is not None and node is not None:
        hw = with_node(hw, node)
    missing = [k for k, v in dict(layers=layers, hidden=hidden, seq=seq, micro_batch=micro_batch).items() if v is None]
    if missing:
        raise ValueError(f"choosing a mesh (tp={tps}, pp={pps}) needs {', '.join(k + '=' for k in missing)}: TP and "
                         f"PP traffic and the bubble depend on the model's shape and micro-batch")
    batch = n * micro_batch * grad_accum if batch is None else batch
    dtype = 4 if precision == "fp32" else 2
    usable = (1 - margin) * gpu_bytes
    meshes = [(t, p) for t in tps for p in pps
              if n % (t * p) == 0 and t <= hw.gpus_per_node and p <= layers and batch % (n // (t * p) * micro_batch) == 0]
    if not meshes:
        raise ValueError(f"no mesh of tp in {tps}, pp in {pps} fits n_gpus={n}: tp*pp must divide n_gpus, tp be at "
                         f"most the GPUs per node ({hw.gpus_per_node}), pp at most layers ({layers}), and the batch "
                         f"({batch} sequences) split into whole micro-batches of {micro_batch} per DP rank")
    rows, choice = [], None
    for level in LEVELS[: OFFLOAD.index(allow_offload) + 1]:
        fitting = []
        for t, p in meshes:
            dp, m = n // (t * p), batch // (n // (t * p) * micro_batch)
            act = activations(t, p) if callable(activations) else activations / t
            for stage, oo, op in level:
                if p > 1 and stage > 1:   # DeepSpeed's pipeline engine (and zerolab's) refuse ZeRO-2/3 with PP
                    continue
                est = estimate(psi, n, stage, precision, optimizer, oo, op, tp=t, pp=p, replicated=replicated)
                times = mesh_step_times(psi, n, stage, t, p, m, micro_batch, seq, hidden, layers, hw, oo, op, dtype,
                                        replicated, compute_seconds, 8 if recompute else 6)
                fits = est.total + act <= usable and (host_bytes is None or est.host <= host_bytes)
                axes = {k: times.pop(k) for k in ("tp", "pp", "dp")}
                times["comm"] = sum(axes.values())
                rows.append(Candidate(stage, oo, op, est.total + act, est.host, times["comm"], fits, times, dp, t, p,
                                      axes))
                if fits:
                    fitting.append(rows[-1])
        if fitting and choice is None:
            choice = _pick(fitting)
    return Plan(choice, rows, compute_seconds)
