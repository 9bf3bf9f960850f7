"""The engine's real schedule replayed on a modelled GPU cluster: time you can trust without a GPU (chapters 3-14).

A traced run (``{"zerolab": {"trace": true}}``) records, per rank, its compute with the FLOPs
counted, every collective's issue and wait, and each optimizer update (``runtime/trace.py``).
``replay(traces, cluster)`` plays those records as a discrete-event simulation, pure arithmetic:

* each rank has one compute stream; a stretch of compute lasts FLOPs / the GPU's achieved FLOP/s
  (``Hardware.flops``, an assumption stated with the preset);
* each process group has one communication stream; its collectives run in issue order, and one
  starts when every member rank has issued it and the previous one on its stream has ended;
* a collective lasts its ring algorithm's alpha-beta time (``network.ring_steps``/``ring_bytes``) on
  the link its group runs at on the cluster: NVLink inside a node; across nodes the node's NICs,
  shared by the groups that cross beside it (``Node.group_link``; placement in ``replay_scale``);
* compute the engine made wait on a collective starts after it ends (a wait the engine only
  collected after a poll found it done does not block: on a GPU the engine would have gone on;
  the end of a backward waits for everything in flight);
* an optimizer update of n elements costs its HBM traffic, 28-30 bytes per element (``ADAM_HBM``),
  or with ``offload_optimizer`` the CPU Adam and the PCIe copies (``theory.offload``'s terms).

Same traces and cluster give the same numbers, bit for bit. ``model=`` replays the trace at a
target model's size (``replay_scale``).
"""
from __future__ import annotations

from dataclasses import dataclass, field

from zerolab.theory.hardware import ADAM_HOST_BYTES
from zerolab.theory.network import ring_bytes, ring_steps
from zerolab.theory.replay_cluster import Cluster, get_cluster
from zerolab.theory.replay_scale import ReplayError, Scaler, count_passes, placement
from zerolab.theory.replay_scale import record_info as _info

__all__ = ["Cluster", "Replay", "ReplayError", "get_cluster", "replay"]
ADAM_HBM = {True: 30, False: 28}   # HBM bytes per element of an Adam update: with an fp32 master / without
LANE = {"all_gather": "all-gather", "reduce_scatter": "reduce-scatter", "all_reduce": "reduce-scatter",
        "all_to_all": "reduce-scatter", "broadcast": "all-gather"}


@dataclass
class Replay:
    """What ``replay`` computed: seconds per optimizer step, per-rank timelines and their parts."""
    cluster: Cluster
    step_seconds: float
    spans: list            # per rank [(kind, start, end, lane)], as engine.events.spans gives them
    exposed_comm: list     # per rank, seconds per step compute waited on communication
    compute_seconds: list  # per rank, seconds per step of compute (forward, backward, optimizer)
    flops: float           # model FLOPs per step per rank (forward + backward, as counted)
    steps: int
    exposed_intervals: list = field(default_factory=list)   # per rank [(start, end)] of those waits

    @property
    def mfu(self) -> float:
        """Model FLOPs utilisation: counted FLOPs per step / (step seconds x the GPU's datasheet peak)."""
        return self.flops / (self.step_seconds * self.cluster.hardware.accelerator.bf16)

    def lanes(self) -> tuple[list, list]:
        """Rows and labels for ``zerolab.book.plots.plot_timeline`` (as ``events.lanes`` gives a real run's)."""
        rows, labels = [], []
        for r, spans in enumerate(self.spans):
            for lane in ("compute", "all-gather", "reduce-scatter"):
                rows.append([(k, s, e) for k, s, e, ln in spans if ln == lane])
                labels.append(f"rank {r} {lane}")
        return rows, labels

    def plot(self, ax=None, title=None):
        """The replayed timeline, one row per rank and stream (matplotlib; ms)."""
        import matplotlib.pyplot as plt
        rows, labels = self.lanes()
        if ax is None:
            _, ax = plt.subplots(figsize=(9, 1 + 0.35 * len(rows)))
        colors = {}
        for y, row in enumerate(rows):
            for kind, s, e in row:
                c = colors.setdefault(kind, f"C{len(colors)}")
                ax.broken_barh([(s * 1e3, (e - s) * 1e3)], (y - 0.35, 0.7), facecolors=c)
        ax.set_yticks(range(len(rows)), labels)
        ax.set_ylim(len(rows) - 0.5, -0.5)
        ax.set_xlabel("modelled time (ms)")
        ax.legend(handles=[plt.Rectangle((0, 0), 1, 1, color=c) for c in colors.values()], labels=list(colors),
                  fontsize=8, loc="upper left", bbox_to_anchor=(1.0, 1.0))
        ax.set_title(title or f"Replayed on {self.cluster} (modelled): {self.step_seconds * 1e3:.1f} ms per step")
        return ax


def _parse(traces):
    """Per rank: its meta record and its program [(kind, ...)], in the order the engine ran it."""
    metas, progs = [], []
    for r, events in enumerate(traces):
        meta = next((_info(e) for e in events if e[0] == "trace-meta"), None)
        if meta is None:
            raise ReplayError(f"rank {r}'s trace has no 'trace-meta' record: run the engine with "
                              f'{{"zerolab": {{"trace": true}}}} and return engine.events from each rank')
        prog = []
        for e in events:
            name, info = e[0], _info(e)
            if name == "compute":
                if info.get("flops") is None:
                    raise ReplayError(f"rank {r}: a compute span without FLOPs (unit {e[1]}, {info.get('phase')})")
                prog.append(("compute", e[1], info["phase"], info["flops"]))
            elif name == "coll-issued":
                prog.append(("issue", e[1], info))
            elif name == "coll-waited":
                prog.append(("wait", e[1], bool(info and info.get("soft"))))
            elif name == "coll-drain":
                prog.append(("drain",))
            elif name == "optimizer":
                prog.append(("opt", info["numel"]))
        metas.append(meta)
        progs.append(prog)
    if len({m["world"] for m in metas}) != 1 or len(traces) != metas[0]["world"]:
        raise ReplayError(f"{len(traces)} traces for a world of {metas[0]['world']} ranks: give every rank's trace")
    return metas, progs


def _collectives(progs):
    """Each rank's (sequence no. -> (group members, k-th on that group)); every group's collectives,
    checked to be the same on every member (op and size), else a ReplayError naming the first difference."""
    keys, by_group = [], {}
    for r, prog in enumerate(progs):
        count, mine = {}, {}
        for item in prog:
            if item[0] != "issue":
                continue
            info = item[2]
            g = tuple(info["members"])
            k = count.get(g, 0)
            count[g] = k + 1
            mine[item[1]] = (g, k)
            seen = by_group.setdefault(g, {}).setdefault(k, (r, info))
            if (seen[1]["op"], seen[1]["nbytes"]) != (info["op"], info["nbytes"]):
                raise ReplayError(f"ranks issued different collective sequences: on group {list(g)}, collective "
                                  f"#{k} is {seen[1]['op']} of {seen[1]['nbytes']} bytes on rank {seen[0]} "
                                  f"('{seen[1]['tag']}') but {info['op']} of {info['nbytes']} bytes on rank {r} "
                                  f"('{info['tag']}')")
        keys.append(mine)
    for g, ks in by_group.items():
        for r in g:
            n = sum(1 for key in keys[r].values() if key[0] == g)
            if n != len(ks):
                raise ReplayError(f"ranks issued different collective sequences: rank {r} issued {n} collectives "
                                  f"on group {list(g)}, another member {len(ks)}")
    return keys, by_group


def _durations(by_group, meta, cluster, scaler):
    """Seconds each collective takes on the cluster: {(group, k): seconds}."""
    node, g = cluster.hardware.node, cluster.hardware.node.gpus
    out = {}
    for members, ks in by_group.items():
        info0 = ks[0][1]
        size, per_node, kind = placement(members, info0["group"], meta, cluster.gpus, g)
        link = node.group_link(size=size, per_node=per_node)
        for k, (_, info) in ks.items():
            nbytes = info["nbytes"]
            if scaler is not None and not info["control"]:
                nbytes = scaler.nbytes(nbytes, meta["dtype_bytes"])
            if info["op"] == "all_to_all" and kind == "inter":   # 1/K of a rank's shard leaves the node
                nbytes = nbytes * meta["ranks_per_node"] / g
            out[members, k] = ring_steps(info["op"], size) * link.latency + \
                ring_bytes(info["op"], int(nbytes), size) / link.bandwidth
    return out


def _optimizer_seconds(numel, meta, cluster):
    hw = cluster.hardware
    if meta["offload"] == "none":
        return numel * ADAM_HBM[meta["master"]] / hw.accelerator.hbm
    on_node = min(cluster.gpus, hw.node.gpus)   # the node's host memory and drives, shared by its GPUs
    t = numel * ADAM_HOST_BYTES / (hw.host_memory / on_node) + 2 * numel * meta["dtype_bytes"] / hw.pcie
    if meta["offload"] == "nvme":
        t += 24 * numel / (hw.nvme / on_node)
    return t


def replay(traces, cluster="dgx-h100", model=None) -> Replay:
    """Replay each rank's trace (``engine.events`` of a traced run, one list per rank, as ``zl.launch``
    returns them) on ``cluster`` (a ``Cluster``, ``Hardware`` or preset name, ``"dgx-h100:2"`` for two
    nodes); ``model``: a ``theory.ModelShape`` or preset name (``theory.SHAPES``) to replay at that size.
    A pipeline step's traces (``train_batch(..., trace=)``) go to ``replay_pipe.replay_pipeline``."""
    cluster = get_cluster(cluster)
    if traces and traces[0] and (_info(traces[0][0]) or {}).get("pipeline"):   # a pipeline step: sends, receives
        from zerolab.theory.replay_pipe import replay_pipeline
        return replay_pipeline(traces, cluster, model)
    metas, progs = _parse(traces)
    meta = metas[0]
    if meta["world"] > cluster.gpus:
        raise ReplayError(f"the trace has {meta['world']} ranks but {cluster} has {cluster.gpus} GPUs")
    keys, by_group = _collectives(progs)
    passes, kinds = count_passes(progs[0], meta)
    scaler = Scaler(model, meta, kinds, passes) if model is not None else None
    dur = _durations(by_group, meta, cluster, scaler)
    dp_scale = meta["dp"] * meta.get("tp", 1) * meta.get("pp", 1) / cluster.gpus if meta["stage"] >= 1 else 1.0
    flops_rate = cluster.hardware.flops
    R = len(progs)
    t, pc = [0.0] * R, [0] * R
    spans = [[] for _ in range(R)]
    stalls = [[] for _ in range(R)]
    busy, counted = [0.0] * R, [0.0] * R
    issued, end = {}, {}
    free = {g: 0.0 for g in by_group}      # each group's stream: when it is idle again
    nxt = {g: 0 for g in by_group}         # the next collective to start on it
    waiting = [set() for _ in range(R)]    # issued, not yet waited for
    while True:
        moved = False
        for r in range(R):
            prog = progs[r]
            while pc[r] < len(prog):
                it = prog[pc[r]]
                if it[0] == "compute":
                    f = scaler.flops(it[1], it[2], it[3]) if scaler else it[3]
                    d = f / flops_rate
                    spans[r].append((it[2], t[r], t[r] + d, "compute"))
                    t[r] += d
                    busy[r] += d
                    counted[r] += f
                elif it[0] == "issue":
                    key = keys[r][it[1]]
                    issued.setdefault(key, {})[r] = t[r]
                    waiting[r].add(key)
                elif it[0] in ("wait", "drain"):
                    need = [keys[r][it[1]]] if it[0] == "wait" else sorted(waiting[r])
                    if it[0] == "wait" and it[2]:      # collected after a poll: no wait on a GPU
                        need = []
                    if any(k not in end for k in need):
                        break
                    until = max([t[r]] + [end[k] for k in need])
                    if until > t[r]:
                        stalls[r].append((t[r], until))
                    t[r] = until
                    waiting[r].difference_update(need)
                elif it[0] == "opt":
                    n = it[1] * (scaler.optimizer_numel(1) if scaler else 1) * dp_scale
                    d = _optimizer_seconds(n, meta, cluster)
                    spans[r].append(("optimizer step", t[r], t[r] + d, "compute"))
                    t[r] += d
                    busy[r] += d
                pc[r] += 1
                moved = True
        for g in sorted(by_group):
            while nxt[g] < len(by_group[g]):
                key = (g, nxt[g])
                got = issued.get(key, {})
                if len(got) < len(g):
                    break
                start = max(max(got.values()), free[g])
                end[key] = free[g] = start + dur[key]
                info = by_group[g][nxt[g]][1]
                for m in g:
                    spans[m].append((info["op"].replace("_", "-"), start, end[key], LANE.get(info["op"], "other")))
                nxt[g] += 1
                moved = True
        if all(pc[r] == len(progs[r]) for r in range(R)):
            break
        if not moved:
            stuck = [f"rank {r} at record {pc[r]} ({progs[r][pc[r]][0]})" for r in range(R) if pc[r] < len(progs[r])]
            raise ReplayError("the replay cannot go on (ranks issued different collective sequences, or a wait for "
                              "a collective a member never issued): " + "; ".join(stuck))
    steps = max(1, passes // max(1, meta["gas"]))
    makespan = max(t + [max((e for e in end.values()), default=0.0)])
    return Replay(cluster, makespan / steps, spans, [sum(e - s for s, e in st) / steps for st in stalls],
                  [b / steps for b in busy], counted[0] / steps, steps, stalls)

