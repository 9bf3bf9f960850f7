"""A pipeline step's trace replayed on a modelled GPU cluster: sends, receives and the bubble (chapter 10).

A traced ``train_batch`` (``parallel/pipeline_trace.py``) records per rank, in the order it ran:

    "compute"   virtual stage j   {"phase": "forward" | "backward" | "weight-grad" (ZB's W), "micro": i,
                                   "chunk": c, "stage": j, "flops", "start"}: F, B or W of micro-batch i on stage j
    "p2p"       sequence no.      {"op": "send" | "recv", "nbytes", "peer" (global rank), "group": "pp", "tag",
                                   "issued", "waited"}: one point-to-point message (headers not counted)
    "p2p-drain" -1                the end of the step: the rank waits for its sends in flight

after a ``"trace-meta"`` record with ``"pipeline": True``. ``replay(traces, cluster)`` sees that
meta and hands the traces here. The replay, pure arithmetic:

* each rank has one compute stream: F, B and W run in the recorded order, FLOPs / the GPU's
  achieved FLOP/s (``Hardware.flops``);
* the k-th send from rank a to rank b with tag t pairs with the k-th receive at b from a with tag t
  (gloo's rule; sizes must agree); a send that pairs with nothing is a ``P2PMismatchError``;
* a send starts when it is issued and the link from a to b is free (one stream per direction:
  NVLink and the NICs are full duplex) and lasts alpha + bytes / beta on the link between the two
  ranks' places: NVLink inside a node, across nodes the GPU's share of the node's NICs (the rate
  ``time3d.mesh_links`` gives the PP sends). Ranks sit on the cluster's nodes as they sat on the
  recorded ones (``ranks_per_node``: ``zl.launch``'s simulated nodes);
* a receive blocks its rank's compute until its send has arrived; the sender does not wait
  (``isend``), except at ``"p2p-drain"``.

``model=`` (a ``ModelShape`` or preset) replays at a target's size: stage j's ops cost the target's FLOPs
for the layers ``split_blocks`` gives virtual stage j of the target's layer count (the head's on the last
one when the recorded last stage held a head); W is the matrices' weight gradients (the forward's matmul
FLOPs), B the rest of the backward; a message carries one micro-batch's activation in bf16, tokens x
hidden x 2 bytes. ``orders_trace`` builds a trace from per-rank schedule orders with given costs: the
schedules replayed at a size no laptop records. ``bubble``: 1 - the ranks' mean busy time / the step, as
``parallel.pipeline_bubble`` measures it on a real run.
"""
from __future__ import annotations

from dataclasses import dataclass

from zerolab.theory.network import Link
from zerolab.theory.replay_cluster import get_cluster
from zerolab.theory.replay_scale import ReplayError
from zerolab.theory.replay_scale import record_info as _info
from zerolab.theory.shapes import get_shape

OPS = {"forward": "F", "backward": "B", "weight-grad": "W"}
PHASES = {op: phase for phase, op in OPS.items()}


class P2PMismatchError(ReplayError):
    """The ranks' sends and receives do not pair up (a send nobody receives, a receive nobody sent, sizes apart)."""


@dataclass
class PipeReplay:
    """What ``replay_pipeline`` computed (module docstring)."""
    cluster: object
    step_seconds: float
    ops: list          # per rank [(op "F"|"B"|"W", micro-batch, chunk, start, end)]
    spans: list        # per rank [(kind, start, end, lane)]: compute and the sends it issued
    exposed_comm: list  # per rank, seconds its compute waited on a receive
    flops: float       # FLOPs of rank 0's ops

    @property
    def bubble(self) -> float:
        """1 - the ranks' mean busy time / (first op's start to the last op's end, any rank)."""
        t0 = min(o[3] for ops in self.ops for o in ops)
        t1 = max(o[4] for ops in self.ops for o in ops)
        busy = sum(sum(o[4] - o[3] for o in ops) for ops in self.ops) / len(self.ops)
        return 1.0 - busy / (t1 - t0)

    def plot(self, ax=None, title=None, unit=1e3):
        """One row per rank: F, B, W boxes numbered by micro-batch, each send's flight as a thin bar (ms)."""
        import matplotlib.pyplot as plt
        from matplotlib.figure import Figure
        if ax is None:
            ax = Figure(figsize=(10, 1.2 + 0.5 * len(self.ops)), layout="constrained").subplots()
        colors = {"F": "C0", "B": "C1", "W": "C2"}
        for r, ops in enumerate(self.ops):
            for op, i, c, s, e in ops:
                ax.broken_barh([(s * unit, (e - s) * unit)], (r - 0.35, 0.6), facecolors=colors[op],
                               edgecolor="white", linewidth=0.5)
                if (e - s) * unit > 0.025 * self.step_seconds * unit:
                    ax.text((s + e) / 2 * unit, r - 0.05, str(i), ha="center", va="center", fontsize=7, color="white")
            for kind, s, e, lane in self.spans[r]:
                if lane == "send":
                    ax.broken_barh([(s * unit, (e - s) * unit)], (r + 0.27, 0.1), facecolors="black")
        ax.set_yticks(range(len(self.ops)), [f"rank {r}" for r in range(len(self.ops))])
        ax.set_ylim(len(self.ops) - 0.5, -0.5)
        ax.set_xlim(0, self.step_seconds * unit * 1.01)
        ax.set_xlabel("modelled time (ms)" if unit == 1e3 else "modelled time (us)")
        handles = [plt.Rectangle((0, 0), 1, 1, color=c) for op, c in colors.items() if any(
            o[0] == op for ops in self.ops for o in ops)] + [plt.Rectangle((0, 0), 1, 1, color="black")]
        labels = [n for op, n in (("F", "forward"), ("B", "backward"), ("W", "weight grad"))
                  if any(o[0] == op for ops in self.ops for o in ops)] + ["send in flight"]
        ax.legend(handles, labels, fontsize=8, loc="upper left", bbox_to_anchor=(1.0, 1.0))
        ax.set_title(title or f"Replayed on {self.cluster} (modelled): {self.step_seconds * 1e3:.2f} ms, "
                              f"bubble {100 * self.bubble:.1f} %")
        return ax


def _parse(traces):
    metas, progs = [], []
    for r, events in enumerate(traces):
        meta = next((_info(e) for e in events if e[0] == "trace-meta"), None)
        if meta is None or not meta.get("pipeline"):
            raise ReplayError(f"rank {r}'s trace has no pipeline 'trace-meta' record: pass trace=[] to "
                              f"train_batch on every rank and replay the lists it filled")
        prog = []
        for e in events:
            info = _info(e)
            if e[0] == "compute":
                if info.get("flops") is None:
                    raise ReplayError(f"rank {r}: a compute span without FLOPs ({info.get('phase')} of micro-batch "
                                      f"{info.get('micro')} on stage {info.get('stage')})")
                prog.append(("compute", OPS[info["phase"]], info["micro"], info.get("chunk", 0), info["stage"],
                             info["flops"]))
            elif e[0] == "p2p":
                prog.append((info["op"], info["peer"], info["tag"], info["nbytes"]))
            elif e[0] == "p2p-drain":
                prog.append(("drain",))
        metas.append(meta)
        progs.append(prog)
    if len(traces) != metas[0]["world"]:
        raise ReplayError(f"{len(traces)} traces for a world of {metas[0]['world']} ranks: give every rank's trace")
    return metas, progs


def _pairs(progs):
    """Per rank, per message, its key ((src, dst, tag), k); sizes checked equal on both sides."""
    sends, recvs, keys = {}, {}, []
    for r, prog in enumerate(progs):
        mine = []
        for it in prog:
            if it[0] in ("send", "recv"):
                pair = (r, it[1], it[2]) if it[0] == "send" else (it[1], r, it[2])
                side = sends if it[0] == "send" else recvs
                side.setdefault(pair, []).append(it[3])
                mine.append((pair, len(side[pair]) - 1))
        keys.append(mine)
    for pair in sorted(set(sends) | set(recvs)):
        a, b = sends.get(pair, []), recvs.get(pair, [])
        if len(a) != len(b):
            raise P2PMismatchError(f"point-to-point messages do not pair up: rank {pair[0]} sent {len(a)} to rank "
                                   f"{pair[1]} (tag {pair[2]}) but rank {pair[1]} received {len(b)} from it")
        for k, (x, y) in enumerate(zip(a, b)):
            if x != y:
                raise P2PMismatchError(f"point-to-point message #{k} from rank {pair[0]} to rank {pair[1]} (tag "
                                       f"{pair[2]}): {x} bytes sent, {y} bytes received")
    return keys


def p2p_link(cluster, a: int, b: int, ranks_per_node: int) -> Link:
    """The link a message from recorded rank a to b runs on: NVLink on one node, else the GPU's NIC share."""
    node = cluster.hardware.node
    if ranks_per_node > node.gpus:
        raise ReplayError(f"the trace has {ranks_per_node} ranks per node, {cluster} has {node.gpus} GPUs a node")
    if a // ranks_per_node == b // ranks_per_node:
        return node.intra
    return node.nic_share()


class _Target:
    """FLOPs and message bytes of a target shape, per op and virtual stage (module docstring)."""

    def __init__(self, model, meta, split: bool):
        self.shape = s = get_shape(model)
        self.split = split                                 # B excludes W (a ZB trace): W is charged apart
        V = meta["pp"] * meta.get("v", 1)
        if V > s.layers:
            raise ReplayError(f"{V} virtual stages for {s.name}'s {s.layers} layers: every stage needs a layer")
        q, rem = divmod(s.layers, V)
        self.layers = [q + (j < rem) for j in range(V)]
        self.head, self.V = meta.get("head", False), V
        self.nbytes = s.tokens * s.hidden * 2                # bf16 activations, as a GPU run sends them
        self.w = s.tokens * 2 * s._matmuls(s.top_k)        # W: one matmul per weight, as the forward's

    def flops(self, op, j):
        s, n = self.shape, self.layers[j]
        head = self.head and j == self.V - 1
        if op == "F":
            return n * s.layer_flops("forward") + head * s.rest_flops("forward")
        w = n * self.w + head * s.rest_flops("forward")
        return w if op == "W" else n * s.layer_flops("backward") + head * s.rest_flops("backward") - w * self.split


def replay_pipeline(traces, cluster, model=None) -> PipeReplay:
    """Replay a traced pipeline step (module docstring); ``cluster`` as ``replay``'s."""
    cluster = get_cluster(cluster)
    metas, progs = _parse(traces)
    meta = metas[0]
    rpn = meta.get("ranks_per_node", meta["world"])
    nodes = -(-meta["world"] // rpn)
    if nodes > cluster.nodes or meta["world"] > cluster.gpus:
        raise ReplayError(f"the trace's {meta['world']} ranks sat on {nodes} node(s) of {rpn}; {cluster} has "
                          f"{cluster.nodes} node(s) of {cluster.hardware.node.gpus} GPUs")
    keys = _pairs(progs)
    split = any(it[0] == "compute" and it[1] == "W" for prog in progs for it in prog)
    target = _Target(model, meta, split) if model is not None else None
    rate, R = cluster.hardware.flops, len(progs)
    t, pc, mk = [0.0] * R, [0] * R, [0] * R
    ops, spans, waits = [[] for _ in range(R)], [[] for _ in range(R)], [0.0] * R
    arrive, free, flops = {}, {}, [0.0] * R
    last_send = [0.0] * R
    while True:
        moved = False
        for r in range(R):
            prog = progs[r]
            while pc[r] < len(prog):
                it = prog[pc[r]]
                if it[0] == "compute":
                    f = target.flops(it[1], it[4]) if target else it[5]
                    d = f / rate
                    ops[r].append((it[1], it[2], it[3], t[r], t[r] + d))
                    spans[r].append((PHASES[it[1]], t[r], t[r] + d, "compute"))
                    t[r] += d
                    flops[r] += f
                elif it[0] == "send":
                    key = keys[r][mk[r]]
                    (a, b, _), _k = key
                    link = p2p_link(cluster, a, b, rpn)
                    nbytes = target.nbytes if target else it[3]
                    start = max(t[r], free.get((a, b), 0.0))
                    arrive[key] = free[a, b] = start + link.latency + nbytes / link.bandwidth
                    spans[r].append(("send", start, arrive[key], "send"))
                    last_send[r] = max(last_send[r], arrive[key])
                    mk[r] += 1
                elif it[0] == "recv":
                    key = keys[r][mk[r]]
                    if key not in arrive:
                        break
                    if arrive[key] > t[r]:
                        waits[r] += arrive[key] - t[r]
                        t[r] = arrive[key]
                    mk[r] += 1
                elif it[0] == "drain":
                    t[r] = max(t[r], last_send[r])
                pc[r] += 1
                moved = True
        if all(pc[r] == len(progs[r]) for r in range(R)):
            break
        if not moved:
            stuck = [f"rank {r} at record {pc[r]} ({progs[r][pc[r]][0]} from rank {progs[r][pc[r]][1]})"
                     for r in range(R) if pc[r] < len(progs[r])]
            raise ReplayError("the pipeline replay cannot go on (a receive waits for a send issued after it): "
                              + "; ".join(stuck))
    return PipeReplay(cluster, max(t), ops, spans, waits, flops[0])


def orders_trace(orders, f, b, w=0.0, nbytes=0, v=1, ranks_per_node=None, head=False, dtype_bytes=2) -> list:
    """Per rank a pipeline trace of ``orders`` (per rank [("F"|"B"|"W", micro-batch[, chunk])], as
    ``parallel.schedule`` gives them) with F = ``f``, B = ``b``, W = ``w`` FLOPs (a schedule without W runs
    b + w in B; each a number or a list by virtual stage) and ``nbytes`` a message — what ``train_batch``
    records, with chosen costs."""
    p = len(orders)
    V = p * v
    split = any(a[0] == "W" for order in orders for a in order)
    f, b, w = ([x] * V if isinstance(x, (int, float)) else list(x) for x in (f, b, w))
    cost = {"F": f, "B": b if split else [x + y for x, y in zip(b, w)], "W": w}
    out = []
    for r, order in enumerate(orders):
        meta = {"pipeline": True, "rank": r, "world": p, "ranks_per_node": ranks_per_node or p, "pp": p, "v": v,
                "stage": r, "head": head, "dtype_bytes": dtype_bytes}
        tr = [("trace-meta", -1, 0.0, meta)]
        for a in order:
            op, i, c = (*a, 0)[:3]
            j = c * p + r
            msg = lambda kind, peer, tag: ("p2p", 0, 0.0, {"op": kind, "nbytes": nbytes, "peer": peer, "group": "pp",
                                                          "tag": tag, "issued": 0.0, "waited": 0.0})
            if op == "F" and j > 0:
                tr.append(msg("recv", (j - 1) % p, p2p_tag(v, "F", j)))
            if op == "B" and j < V - 1:
                tr.append(msg("recv", (j + 1) % p, p2p_tag(v, "B", j)))
            tr.append(("compute", j, 0.0, {"phase": PHASES[op], "micro": i, "chunk": c, "stage": j,
                                           "flops": cost[op][j], "start": 0.0}))
            if op == "F" and j < V - 1:
                tr.append(msg("send", (j + 1) % p, p2p_tag(v, "F", j + 1)))
            if op == "B" and j > 0:
                tr.append(msg("send", (j - 1) % p, p2p_tag(v, "B", j - 1)))
        tr.append(("p2p-drain", -1, 0.0, None))
        out.append(tr)
    return out


def p2p_tag(v: int, op: str, j: int) -> int:
    """The point-to-point tag of what virtual stage ``j`` receives: its input ("F") or its output's gradient
    ("B"); 0 without chunks (one stream per direction and pair of ranks). ``train_batch`` sends by it."""
    return 0 if v == 1 else 2 * j + (1 if op == "F" else 2)
