"""ZeRO-Offload's step on modelled GPUs: the replay, with the host's part split by term (chapter 7).

``zl.replay`` (``theory.replay``) charges an offloaded optimizer update of n elements as one span
on the GPU's compute stream: the CPU Adam (30 n bytes through the host memory one GPU gets) plus
the PCIe copies (n 16-bit gradients down, n 16-bit parameters up), nothing overlapped — the GPU
waits for the host, as in a synchronous step (no delayed update). This module draws that span as
what it is made of:

* ``record(settings, model)``: one traced step per setting (``name -> zero_optimization``) on 2 CPU
  ranks (``zl.launch``; they stand for a node's GPUs) and on one rank in this process (a single
  GPU), a TinyGPT at toy width with ``model``'s layer count (``book.replayed``).
* ``single_gpu(hw)``: a ``Cluster`` of one GPU of a preset, the node's host memory to itself.
* ``replay(traces, cluster, model)``: an ``OffloadReplay``: ``zl.replay``'s result with each
  offloaded optimizer span cut into "PCIe: grads down", "CPU Adam" (and "NVMe: state", with the
  optimizer on NVMe) and "PCIe: params up", in the proportions of ``theory.offload.offload_seconds``'
  terms (whose sum is what the replay charged), on a PCIe lane and a host-CPU lane beside the GPU's.
  ``exposed()``: per step, the seconds the GPU waited on each (all of them: the step is serial).
* ``measured_lanes(events)``: the same traced run's wall clock on this laptop, in the same lanes.
* ``figure(...)``: measured and replayed timelines, one panel per cluster and setting.

Every number from ``replay`` is replayed on a modelled cluster; from ``measured_lanes``, measured
on this laptop.
"""
from __future__ import annotations

from dataclasses import dataclass

from zerolab.book import replayed
from zerolab.theory.hardware import get_hardware
from zerolab.theory.nodes import Node
from zerolab.theory.offload import offload_seconds
from zerolab.theory.replay import Cluster, Replay, get_cluster
from zerolab.theory.replay import replay as zl_replay

PCIE = ("optimizer: PCIe (grads down, params up)", "optimizer: CPU Adam (host memory)",
        "optimizer: NVMe (state in and out)")           # theory.offload's terms, in that order
HOST_LANES = ("PCIe", "host CPU")
HOST_COLORS = {"PCIe: grads down": "#17BECF", "PCIe: params up": "#0E7C86", "CPU Adam": "#7F7F7F",
               "NVMe: state in": "#BCBD22", "NVMe: state out": "#8C8C17"}   # beside plots.KIND_COLORS


def single_gpu(hw="dgx-h100") -> Cluster:
    """One GPU of the preset ``hw`` (a ``theory.HARDWARE`` name or ``Hardware``), its node's host memory,
    PCIe link and drives to itself: a workstation-like cluster of one."""
    hw = get_hardware(hw)
    node = Node(f"one {hw.accelerator.name}", 1, 1, hw.node.nic_bandwidth, hw.node.intra, hw.node.nic_latency)
    return Cluster(hw.with_(name=f"one {hw.accelerator.name} ({hw.name}'s host)", node=node))


def _meta(traces) -> dict:
    for e in traces[0]:
        if e[0] == "trace-meta":
            return getattr(e, "info", None) if len(e) < 4 else e[3]
    return {}


def host_shares(meta: dict, cluster: Cluster) -> dict:
    """Fractions of an offloaded optimizer span by term: ``{"PCIe", "CPU Adam", "NVMe"}``, from
    ``offload_seconds``' terms for one GPU of ``cluster`` (host memory shared by the GPUs on its node);
    the PCIe term scaled to the run's 16- or 32-bit copies. ``{}`` without optimizer offload."""
    device = meta.get("offload", "none")
    if device == "none":
        return {}
    t = offload_seconds(1e9, cluster.gpus, 1, 1, device, hw=cluster.hardware)
    parts = {"PCIe": t[PCIE[0]] * meta.get("dtype_bytes", 2) / 2, "CPU Adam": t[PCIE[1]], "NVMe": t.get(PCIE[2], 0.0)}
    total = sum(parts.values())
    return {k: v / total for k, v in parts.items()}


@dataclass
class OffloadReplay:
    """A ``Replay`` whose offloaded optimizer spans are split by term, on their own lanes."""
    replay: Replay
    spans: list          # per rank [(kind, start, end, lane)]; lanes: compute, all-gather, reduce-scatter, PCIe, host CPU
    offload: str         # the trace's offload_optimizer device

    cluster = property(lambda self: self.replay.cluster)
    step_seconds = property(lambda self: self.replay.step_seconds)

    def lane_names(self) -> tuple:
        base = ("compute", "all-gather", "reduce-scatter")
        return base + HOST_LANES if self.offload != "none" else base

    def lanes(self) -> tuple[list, list]:
        """Rows and labels for ``plots.plot_timeline``, as ``Replay.lanes`` (no PCIe or host lane without offload)."""
        rows, labels = [], []
        for r, spans in enumerate(self.spans):
            for lane in self.lane_names():
                rows.append([(k, s, e) for k, s, e, ln in spans if ln == lane])
                labels.append(f"rank {r} {'GPU compute' if lane == 'compute' else lane}")
        return rows, labels

    def exposed(self, rank: int = 0) -> dict:
        """Seconds per optimizer step the GPU waited on each: ``{"PCIe", "CPU Adam", "NVMe", "communication"}``
        (the replay runs the offloaded update serially, so every second of it is exposed)."""
        out = {"PCIe": 0.0, "CPU Adam": 0.0, "NVMe": 0.0}
        for kind, s, e, lane in self.spans[rank]:
            if lane in HOST_LANES:
                out[kind.split(":")[0]] += e - s
        out = {k: v / self.replay.steps for k, v in out.items()}
        out["communication"] = self.replay.exposed_comm[rank]
        return out


def split(rep: Replay, meta: dict) -> OffloadReplay:
    """``rep`` with each offloaded optimizer span (``meta``: the trace's "trace-meta") cut by ``host_shares``."""
    shares = host_shares(meta, rep.cluster)
    out = []
    for spans in rep.spans:
        mine = []
        for kind, s, e, lane in spans:
            if e == s:                       # a collective over one rank takes no time: nothing to draw
                continue
            if not shares or kind != "optimizer step":
                mine.append((kind, s, e, lane))
                continue
            d, t = e - s, s
            for name, share, where in (("PCIe: grads down", shares["PCIe"] / 2, "PCIe"),
                                       ("NVMe: state in", shares["NVMe"] / 2, "PCIe"),
                                       ("CPU Adam", shares["CPU Adam"], "host CPU"),
                                       ("NVMe: state out", shares["NVMe"] / 2, "PCIe"),
                                       ("PCIe: params up", shares["PCIe"] / 2, "PCIe")):
                if share:
                    mine.append((name, t, t + d * share, where))
                    t += d * share
        out.append(mine)
    return OffloadReplay(rep, out, meta.get("offload", "none"))


def replay(traces, cluster, model=replayed.TARGET) -> OffloadReplay:
    """``zl.replay(traces, cluster, model=model)``, split (``split``)."""
    return split(zl_replay(traces, get_cluster(cluster), model=model), _meta(traces))


def traced_step(configs: dict, layers: int, batch: int = replayed.BATCH) -> dict:
    """Runs on every rank: per setting, ``engine.events`` of its first optimizer step (ZeRO-1/2 need no
    warm-up step: their order of collectives is fixed from the start; ZeRO-3 learns its unit order in
    the first step, so use ``replayed.traced_steps`` there)."""
    for name, cfg in configs.items():
        if cfg["zero_optimization"].get("stage", 0) >= 3:
            raise ValueError(f"setting {name!r}: traced_step records a first step, which at ZeRO-3 has no "
                             f"unit order yet; use zerolab.book.replayed.traced_steps")
    return replayed.traced_steps(configs, layers, batch, warmup=False)


def record(settings: dict, model=replayed.TARGET, world_size: int = 2) -> dict:
    """``{"node": {name: traces of world_size ranks}, "one GPU": {name: [events]}}``: one traced step per
    setting (``name -> zero_optimization`` keys at stage 1 or 2, on top of ``replayed.config``'s),
    launched on ``world_size`` ranks and run on one rank in this process; a TinyGPT at toy width with
    ``model``'s layer count."""
    from zerolab.runtime.launch import launch
    from zerolab.theory.shapes import get_shape
    configs = {name: replayed.config(zero) for name, zero in settings.items()}
    layers = get_shape(model).layers
    per_rank = launch(traced_step, world_size=world_size, args=(configs, layers), threads=1, timeout=600)
    one = traced_step(configs, layers)
    return {"node": {name: [r[name] for r in per_rank] for name in configs},
            "one GPU": {name: [events] for name, events in one.items()}}


def measured_lanes(events) -> tuple[list, list]:
    """One rank's traced run on this laptop (wall clock) as rows for ``plots.plot_timeline``: compute
    (forward, backward — from the trace's compute records — and the optimizer step), all-gather,
    reduce-scatter, each ``(kind, start, end)`` in seconds since the first record."""
    from zerolab.engine.events import spans
    from zerolab.runtime.trace import info_of
    rows = {"compute": [], "all-gather": [], "reduce-scatter": []}
    for e in events:
        info = info_of(e)
        if e[0] == "compute" and info:
            rows["compute"].append((info["phase"], info["start"], e[2]))
    for kind, s, e, lane in spans([tuple(ev[:3]) for ev in events]):
        rows.setdefault(lane, []).append((kind, s, e))
    t0 = min((s for row in rows.values() for _, s, _ in row), default=0.0)
    return ([[(k, s - t0, e - t0) for k, s, e in row] for row in rows.values()],
            [f"rank 0 {'CPU compute' if lane == 'compute' else lane}" for lane in rows])


def figure(measured: dict, replays: dict, rank: int = 0):
    """Panels, top to bottom: each setting's ``measured`` events (``{name: one rank's events}``, on this
    laptop), then each cluster's ``replays`` (``{cluster label: {name: OffloadReplay}}``); the panels of
    one cluster share its time axis, so a longer step is a longer row."""
    from matplotlib.figure import Figure
    from zerolab.book import plots
    panels = [("measured", n) for n in measured] + [(c, n) for c, reps in replays.items() for n in reps]
    heights = [3 if c == "measured" else len(replays[c][n].lane_names()) for c, n in panels]
    fig = Figure(figsize=(10, 1.0 + 0.42 * sum(heights) + 0.55 * len(panels)), layout="constrained")
    axes = fig.subplots(len(panels), 1, squeeze=False, height_ratios=heights)[:, 0]
    for ax, (c, n) in zip(axes, panels):
        if c == "measured":
            rows, labels = measured_lanes(measured[n])
            plots.plot_timeline(rows, ax=ax, labels=labels,
                                title=f"{n}: measured on this laptop (TinyGPT at toy width, CPU ranks over gloo)")
            ax.set_xlabel("wall time on this laptop since the step began (ms)")
            ax.set_xlim(0, 1.02e3 * max(max((e for row in measured_lanes(m)[0] for _, _, e in row), default=0)
                                         for m in measured.values()))
            continue
        rep = replays[c][n]
        plots.plot_timeline(rep, ax=ax, ranks=[rank], colors=HOST_COLORS,
                            title=f"{n}: replayed on {rep.cluster} (modelled), {rep.step_seconds:.3f} s per step")
        ax.set_xlim(0, 1.02e3 * max(r.step_seconds for r in replays[c].values()))
    return fig
