"""What each ZeRO stage sends per optimizer step, and how long it takes (chapters 2, 11).

Pure arithmetic on top of ``zerolab.theory.network`` (ring_bytes, Link): a step is a
list of collectives (``CommOp``); bytes one rank sends = the sum of their ring
bytes; time = the sum of their alpha-beta times. ``zerolab.theory.memory``
re-exports everything here.

Per optimizer step with g = ``grad_accum`` micro-batches, M = Ψ·dtype_bytes
(the 16-bit model size; Ψ padded to a multiple of N) and ring factor
r = (N-1)/N, one rank sends:

    stage 0 (DDP)  all-reduce grads once, at the accumulation boundary    2·M·r
    stage 1        reduce-scatter grads at the boundary + all-gather
                   updated params after the step                          2·M·r
    stage 2        reduce-scatter grads every micro-batch (a rank keeps
                   only its gradient shard, so it cannot wait) +
                   all-gather params after the step                  (g+1)·M·r
    stage 3        every micro-batch: all-gather params for forward, again
                   for backward, reduce-scatter grads; nothing after
                   the step (each rank updates its own shard in place)   3g·M·r

(DDP's ``no_sync`` and DeepSpeed's stage 0/1 defer the reduction to the
boundary; persistence thresholds and reuse-distance caching that skip some
stage-3 re-gathers are not modelled.)

ZeRO++ flags (stage 3 only; chapter 9), as zerolab's engine runs them:
  * quantized_weights (qwZ): *both* weight all-gathers (forward and backward,
    as DeepSpeed quantizes every fetch) move int8 plus one fp32 scale per
    ``weight_group`` elements of each rank's shard: about M/2 each.
  * hpz (hierarchical partitioning, ``hpz=H`` or True for H = gpus_per_node):
    after the forward gather each group of H ranks of a node keeps a
    secondary partition, so the backward all-gather (16-bit) runs among
    those H ranks only.
  * quantized_gradients (qgZ): the reduce-scatter becomes two int4
    all-to-alls with one fp32 scale per ``gradient_group`` elements of each
    rank's shard: among the K ranks of a node (the whole tensor, swizzled),
    then among the M = N/K ranks with the same local index (1/K of it,
    summed over the node).
``units`` (element counts of the engine's units, default one unit of Ψ)
makes the padding and the scales exact: each unit is padded to N shards and
quantized shard by shard, as the engine does.

Inside and across nodes (gpus_per_node = K). ``split_intra_inter`` splits
what one rank sends by the rule the engine's ledger uses
(``runtime/comm.py``): a ring over all N ranks has N links, of which one
per node crosses a node boundary, so a fraction (nodes)/N = 1/K of each
rank's ring bytes crosses; a group inside a node crosses nothing, and the
inter-node all-to-all only crosses. Per rank that is one NIC's traffic on a
node with one NIC per GPU; K times it is what a node sends across, the
ZeRO++ paper's accounting: ZeRO-3's 3M cross-node volume becomes
0.5M + 0 + 0.25M = 0.75M with all three (plus the scales).

3D (chapter 10): with ``tp``/``pp`` > 1 the DP ops above run over each rank's model-parallel slice
among n/(tp·pp) ranks, beside the TP and PP ops of ``theory.comm3d``; each ``CommOp`` names its
mesh group (``axis``) and ``by_axis`` sums the bytes per group, what the ledger books under
``engine.comm.total_bytes(group=...)`` (tests/test_comm3d.py).
"""
from __future__ import annotations

from dataclasses import dataclass

from zerolab.theory.checks import check_psi_n, mesh_share
from zerolab.theory.comm3d import check_shape, dp_gpus_per_node, model_parallel_ops
from zerolab.theory.context import with_context
from zerolab.theory.experts import with_experts
from zerolab.theory.network import ring_bytes
from zerolab.theory.nodes import get_node, node_from_links


def quantized_bytes(length: int, bits: int, group: int) -> int:
    """Bytes of ``length`` elements block-quantized to ``bits`` (8 or 4) with one fp32 scale per
    ``group`` elements: the payload (int4: two per byte) plus 4 bytes per group."""
    if bits not in (4, 8) or group < 1:
        raise ValueError(f"bits must be 4 or 8 and group >= 1, got bits={bits!r}, group={group!r}")
    return (length if bits == 8 else -(-length // 2)) + 4 * max(1, -(-length // group))


@dataclass(frozen=True)
class CommOp:
    """One kind of collective in a step."""
    op: str          # "all_reduce" | "reduce_scatter" | "all_gather" | "all_to_all" | "broadcast" | "send"
    what: str        # "grads" | "params" | "params-forward" | "params-backward" | "grads-intra" | "grads-inter"
    #                  TP: "act-forward" | "act-backward" | "loss"; PP: "activations" | "activation-grads" | "loss"
    group: int       # ranks taking part
    nbytes: int      # full tensor size (all-reduce tensor, RS input, AG output, all-to-all input)
    count: int       # how many times per optimizer step
    inter_node: bool # does the group span nodes? (its ranks sit on more than one node)
    inter_share: float = 0.0  # fraction of each rank's bytes that crosses nodes (module docstring)
    axis: str = "dp"          # the mesh group it runs in: "dp" | "tp" | "pp" (chapter 10, ``theory.comm3d``)
    per_node: int | None = None   # the group's ranks on one node: the groups beside it share the NICs (``op_link``)

    @property
    def bytes_each(self) -> int:
        """Bytes one rank sends for one of these collectives (a point-to-point "send": its tensor)."""
        return self.nbytes if self.op == "send" else ring_bytes(self.op, self.nbytes, self.group)

    @property
    def bytes(self) -> int:
        """Bytes one rank sends for all ``count`` of them."""
        return self.count * self.bytes_each

    @property
    def inter_bytes(self) -> int:
        """The part of ``bytes`` that crosses nodes."""
        return self.count * round(self.bytes_each * self.inter_share)


def _check(psi, n_gpus, stage, dtype_bytes, grad_accum, gpus_per_node):
    psi, n = check_psi_n(psi, n_gpus)
    if stage not in (0, 1, 2, 3):
        raise ValueError(f"stage={stage!r} is not allowed; expected one of (0, 1, 2, 3)")
    if dtype_bytes not in (1, 2, 4):
        raise ValueError(f"dtype_bytes must be one of (1, 2, 4), got {dtype_bytes!r}")
    if isinstance(grad_accum, bool) or not isinstance(grad_accum, int) or grad_accum < 1:
        raise ValueError(f"grad_accum must be an integer >= 1, got {grad_accum!r}")
    if gpus_per_node is not None and (not isinstance(gpus_per_node, int) or gpus_per_node < 1):
        raise ValueError(f"gpus_per_node must be None or an integer >= 1, got {gpus_per_node!r}")
    return psi, n


def _hpz_size(hpz, k, n) -> int:
    if hpz is True:
        return k
    if hpz is False or hpz is None or hpz == 1:
        return 1
    if isinstance(hpz, bool) or not isinstance(hpz, int) or hpz < 1 or k % hpz:
        raise ValueError(f"hpz must be a bool or a partition size dividing gpus_per_node ({k}), got {hpz!r}")
    return hpz


def comm_breakdown(psi, n_gpus, stage, dtype_bytes=2, grad_accum=1, gpus_per_node=None,
                   quantized_weights=False, quantized_gradients=False, hpz=False,
                   units=None, weight_group=8000, gradient_group=4096, *, tp=1, pp=1, replicated=0,
                   layers=None, hidden=None, micro_batch=None, seq=None, act_bytes=None, qkv_fused=True,
                   sequence_parallel=False, pp_rank=None, cp=1, cp_method="ulysses", ep=1,
                   moe=None) -> list[CommOp]:
    """The collectives one optimizer step runs on one rank (see the module docstring).

    3D (chapter 10): ``n_gpus`` counts every GPU; with ``tp``/``pp`` > 1 the DP ops (``axis="dp"``)
    are the ZeRO formula over the rank's model-parallel slice (``checks.mesh_share``: Ψ/(tp·pp) plus the
    ``replicated`` parameters every TP rank keeps whole) among n_gpus/(tp·pp) ranks, and the TP and PP
    ops (``axis="tp"``, ``"pp"``) those of ``theory.comm3d``'s docstring: ``layers``, ``hidden``,
    ``micro_batch`` (sequences per micro-batch and DP rank), ``seq``, ``act_bytes`` (default
    ``dtype_bytes``), ``qkv_fused`` (False: TinyGPT's separate q, k, v), ``sequence_parallel``;
    ``grad_accum`` = micro-batches per step. ``pp_rank``: the stage whose TP and PP ops to list (None:
    the one that sends the most). ``units`` and the ZeRO++ flags apply to the DP ops. Each op's
    ``bytes`` is what the engine's ledger books on that rank: ``engine.comm.total_bytes(group=axis)``.
    ``cp`` > 1: ZeRO over dp·cp ranks (``axis="dp_cp"``) and the "cp" group's ops (``theory.context``).
    Experts (chapter 11): with ``ep`` > 1 ``psi`` counts the dense parameters and ``moe`` the MoE layers;
    their all-to-alls (``axis="ep"``) and expert-gradient all-reduce (``"edp"``) follow (``theory.experts``).
    """
    if ep != 1 or moe is not None:
        return with_experts(comm_breakdown, CommOp, dict(locals()))
    if cp != 1:
        return with_context(comm_breakdown, CommOp, dict(locals()))
    if (tp, pp) != (1, 1):   # (replicated changes nothing without model parallelism)
        return _breakdown_3d(psi, n_gpus, stage, dtype_bytes, grad_accum, gpus_per_node,
                             dict(quantized_weights=quantized_weights, quantized_gradients=quantized_gradients,
                                  hpz=hpz, units=units, weight_group=weight_group, gradient_group=gradient_group),
                             tp, pp, replicated, layers, hidden, micro_batch, seq, act_bytes, qkv_fused,
                             sequence_parallel, pp_rank)
    psi, n = _check(psi, n_gpus, stage, dtype_bytes, grad_accum, gpus_per_node)
    if stage < 3 and (quantized_weights or quantized_gradients or hpz):
        raise ValueError(f"ZeRO++ (quantized_weights, quantized_gradients, hpz) needs stage 3, got stage={stage}")
    if hpz and gpus_per_node is None:
        raise ValueError("hpz=True needs gpus_per_node (the secondary partition lives inside a node)")
    units = [psi] if units is None else [int(u) for u in units]
    if sum(units) != psi or min(units) < 1:
        raise ValueError(f"units must be positive element counts adding up to psi ({psi}), got sum {sum(units)}")
    shards = [-(-u // n) for u in units]              # S per unit: padded to N shards
    m = sum(shards) * n * dtype_bytes                 # 16-bit model bytes, padded unit by unit
    g = grad_accum
    k = min(n, gpus_per_node or n)                    # ranks per node
    nodes = -(-n // k)
    world = dict(group=n, per_node=k, inter_node=nodes > 1, inter_share=nodes / n if nodes > 1 else 0.0)
    if stage == 0:
        return [CommOp("all_reduce", "grads", nbytes=m, count=1, **world)]
    if stage in (1, 2):
        return [CommOp("reduce_scatter", "grads", nbytes=m, count=1 if stage == 1 else g, **world),
                CommOp("all_gather", "params", nbytes=m, count=1, **world)]
    h = _hpz_size(hpz, k, n)
    weights = n * sum(quantized_bytes(s, 8, weight_group) for s in shards) if quantized_weights else m
    ops = [CommOp("all_gather", "params-forward", nbytes=weights, count=g, **world),
           CommOp("all_gather", "params-backward", nbytes=m, count=g, group=h, per_node=h, inter_node=False) if h > 1 else
           CommOp("all_gather", "params-backward", nbytes=weights, count=g, **world)]
    if not quantized_gradients:
        return ops + [CommOp("reduce_scatter", "grads", nbytes=m, count=g, **world)]
    r = sum(shards)                                   # a rank's gradient shard, elements
    if 1 < k < n:
        if n % k:
            raise ValueError(f"quantized_gradients across nodes needs gpus_per_node ({k}) to divide n_gpus ({n})")
        return ops + [CommOp("all_to_all", "grads-intra", group=k, per_node=k,
                             nbytes=n * quantized_bytes(r, 4, gradient_group), count=g, inter_node=False),
                      CommOp("all_to_all", "grads-inter", group=nodes, per_node=1,   # one rank on each node
                             nbytes=nodes * quantized_bytes(r, 4, gradient_group), count=g, inter_node=True,
                             inter_share=1.0)]
    return ops + [CommOp("all_to_all", "grads", group=n, per_node=k, nbytes=n * quantized_bytes(r, 4, gradient_group),
                         count=g, inter_node=nodes > 1, inter_share=1.0 if nodes > 1 else 0.0)]


def _breakdown_3d(psi, n_gpus, stage, dtype_bytes, grad_accum, gpus_per_node, zero, tp, pp, replicated, layers,
                  hidden, micro_batch, seq, act_bytes, qkv_fused, sequence_parallel, pp_rank) -> list[CommOp]:
    act_bytes = dtype_bytes if act_bytes is None else act_bytes
    check_shape(tp, pp, layers, hidden, micro_batch, seq, act_bytes, pp_rank)
    psi_mp, n_dp = mesh_share(psi, n_gpus, tp, pp, replicated)
    _check(psi, n_gpus, stage, dtype_bytes, grad_accum, gpus_per_node)
    dp = comm_breakdown(psi_mp, n_dp, stage, dtype_bytes, grad_accum, dp_gpus_per_node(gpus_per_node, tp, pp),
                        **zero)
    _, mp = model_parallel_ops(tp, pp, grad_accum, layers, hidden, micro_batch, seq, act_bytes, pp_rank,
                               gpus_per_node, qkv_fused, sequence_parallel)
    return dp + [CommOp(**d) for d in mp]


def by_axis(ops: list[CommOp], scope: str | None = None) -> dict:
    """{"dp": bytes, "tp": bytes, "pp": bytes} one rank sends per step, by mesh group; ``scope="inter"``:
    only the bytes that cross nodes, ``"intra"``: the rest (as ``engine.comm.total_bytes(group=, scope=)``)."""
    if scope not in (None, "intra", "inter"):
        raise ValueError(f"scope must be None, 'intra' or 'inter', got {scope!r}")
    out = {"dp": 0, "tp": 0, "pp": 0}
    for op in ops:
        inter = op.inter_bytes
        out[op.axis] = out.get(op.axis, 0) + (inter if scope == "inter" else
                                              op.bytes - inter if scope == "intra" else op.bytes)
    return out


def comm_volume(psi, n_gpus, stage, dtype_bytes=2, grad_accum=1, gpus_per_node=None,
                quantized_weights=False, quantized_gradients=False, hpz=False, **zeropp) -> int:
    """Bytes one rank sends per optimizer step (ring algorithms; chapter 2).

    g = 1: 2Ψ(N-1)/N·dtype_bytes for stages 0-2, 3Ψ(N-1)/N·dtype_bytes for
    stage 3. With g micro-batches: stages 0, 1 unchanged, stage 2 (g+1)/2
    times, stage 3 g times (module docstring).
    """
    return sum(op.bytes for op in comm_breakdown(
        psi, n_gpus, stage, dtype_bytes, grad_accum, gpus_per_node,
        quantized_weights, quantized_gradients, hpz, **zeropp))


def split_intra_inter(ops: list[CommOp]) -> dict:
    """{"intra": bytes, "inter": bytes} one rank sends, split by the ring links that cross nodes
    (module docstring; the engine's ledger books the same, ``engine.comm.total_bytes(scope=...)``)."""
    inter = sum(op.inter_bytes for op in ops)
    return {"intra": sum(op.bytes for op in ops) - inter, "inter": inter}


def op_link(op: CommOp, node):
    """The link ``op`` runs at on ``node`` (a ``theory.Node``): inside one node its fabric; a group whose
    ranks sit on several nodes, ``op.per_node`` on each, shares the NICs with the groups beside it
    (``Node.group_link``: 8 one-rank-per-node groups of a DGX get one NIC each)."""
    if not op.inter_node:
        return node.intra
    if op.per_node is None:
        raise ValueError(f"CommOp {op.op} of {op.what!r} crosses nodes but has no per_node (its ranks on one node): "
                         f"which groups share the NICs is unknown")
    return node.group_link(size=op.group, per_node=op.per_node)


def step_comm_time(psi, n_gpus, stage, link=None, inter_link=None, bucket_elems=None, dtype_bytes=2,
                   grad_accum=1, gpus_per_node=None, quantized_weights=False,
                   quantized_gradients=False, hpz=False, node=None) -> float:
    """Seconds of communication per step in the alpha-beta model, no overlap.

    ``node``: a ``zerolab.theory.Node`` or preset name (``"dgx-a100"``, ``"dgx-h100"``,
    ``"cloud-100gbe"``): GPUs per node, NICs per node, the fabric inside. A collective
    whose group's ranks sit on several nodes runs at min(NVLink, NICs x NIC speed x its share of them)
    (``op_link``, ``theory.nodes``: qgZ's one-rank-per-node all-to-all gets an eighth of a node's NICs).
    Or, without ``node``: ``link`` (a ``zerolab.Link`` or preset name) for collectives
    inside a node, or all of them, and ``inter_link`` for those that span nodes (needs
    ``gpus_per_node``) — a node with ONE NIC of that speed. ``bucket_elems``: each
    collective is split into ceil(Ψ / bucket_elems) buckets, each paying the latency of
    its ring steps (the reason bucket sizes matter on slow links).
    """
    nd = get_node(node)
    if nd is not None:
        if link is not None or inter_link is not None:
            raise ValueError("give either node=... or link/inter_link, not both (a node names its own links)")
        if gpus_per_node is not None and gpus_per_node != nd.gpus:
            raise ValueError(f"gpus_per_node={gpus_per_node} contradicts node {nd.name!r} ({nd.gpus} GPUs)")
        gpus_per_node = nd.gpus
    elif link is None:
        raise ValueError("step_comm_time needs node=... (zerolab.theory.NODES) or link=... (zerolab.LINKS)")
    else:
        nd = node_from_links(link, inter_link, gpus_per_node)
    ops = comm_breakdown(psi, n_gpus, stage, dtype_bytes, grad_accum, gpus_per_node,
                         quantized_weights, quantized_gradients, hpz)
    psi = int(round(psi))
    if bucket_elems is not None and bucket_elems < 1:
        raise ValueError(f"bucket_elems must be None or >= 1, got {bucket_elems!r}")
    buckets = 1 if bucket_elems is None else -(-psi // int(bucket_elems))
    total = 0.0
    for op in ops:
        lk = op_link(op, nd)
        one = lk.time(op.op, op.nbytes, op.group)                     # whole tensor at once
        extra = (buckets - 1) * lk.time(op.op, 0, op.group)           # latency of the other buckets
        total += op.count * (one + extra)
    return total
