"""What each ZeRO stage sends per optimizer step, and how long it takes (chapters 2, 10).

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

ZeRO++ flags (stage 3 only), as in the ZeRO++ paper's accounting:
  * quantized_weights (qwZ): the forward all-gather moves int8 instead of
    16-bit weights: M/2 (quantization scales ignored).
  * quantized_gradients (qgZ): the gradient reduce-scatter moves int4 instead
    of 16-bit: M/4 (its hierarchical intra-node all-to-all step and scales
    are not modelled separately).
  * hpz (hierarchical partitioning): each node keeps a secondary copy of the
    parameters sharded over its ``gpus_per_node`` GPUs, so the backward
    all-gather runs inside the node (group of gpus_per_node ranks).
With ``gpus_per_node``, a collective over all N ranks that spans more than
one node is counted as inter-node (in a ring every hop carries the same bytes,
so the slowest link sets the pace); one inside a node is intra-node. So
ZeRO-3's 3M cross-node volume becomes 0.5M + 0 + 0.25M = 0.75M with all three.
"""
from __future__ import annotations

from dataclasses import dataclass

from zerolab.theory.checks import check_psi_n
from zerolab.theory.network import ring_bytes
from zerolab.theory.nodes import get_node, node_from_links


@dataclass(frozen=True)
class CommOp:
    """One kind of collective in a step."""
    op: str          # "all_reduce" | "reduce_scatter" | "all_gather"
    what: str        # "grads" | "params" | "params-forward" | "params-backward"
    group: int       # ranks taking part
    nbytes: int      # full tensor size (all-reduce tensor, RS input, AG output)
    count: int       # how many times per optimizer step
    inter_node: bool # does the group span nodes?

    @property
    def bytes_each(self) -> int:
        """Bytes one rank sends for one of these collectives."""
        return ring_bytes(self.op, self.nbytes, self.group)

    @property
    def bytes(self) -> int:
        """Bytes one rank sends for all ``count`` of them."""
        return self.count * self.bytes_each


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


def comm_breakdown(psi, n_gpus, stage, dtype_bytes=2, grad_accum=1, gpus_per_node=None,
                   quantized_weights=False, quantized_gradients=False, hpz=False) -> list[CommOp]:
    """The collectives one optimizer step runs (see the module docstring)."""
    psi, n = _check(psi, n_gpus, stage, dtype_bytes, grad_accum, gpus_per_node)
    if stage < 3 and (quantized_weights or quantized_gradients or hpz):
        raise ValueError(f"ZeRO++ (quantized_weights, quantized_gradients, hpz) needs stage 3, got stage={stage}")
    if hpz and gpus_per_node is None:
        raise ValueError("hpz=True needs gpus_per_node (the secondary partition lives inside a node)")
    m = -(-psi // n) * n * dtype_bytes               # 16-bit model bytes, padded to N shards
    g = grad_accum
    spans = gpus_per_node is not None and n > gpus_per_node
    world = dict(group=n, inter_node=spans)
    if stage == 0:
        return [CommOp("all_reduce", "grads", nbytes=m, count=1, **world)]
    if stage in (1, 2):
        return [CommOp("reduce_scatter", "grads", nbytes=m, count=1 if stage == 1 else g, **world),
                CommOp("all_gather", "params", nbytes=m, count=1, **world)]
    node = min(n, gpus_per_node) if hpz else n
    return [CommOp("all_gather", "params-forward", nbytes=m // 2 if quantized_weights else m, count=g, **world),
            CommOp("all_gather", "params-backward", nbytes=m, count=g,
                   **(dict(group=node, inter_node=False) if hpz else world)),
            CommOp("reduce_scatter", "grads", nbytes=m // 4 if quantized_gradients else m, count=g, **world)]


def comm_volume(psi, n_gpus, stage, dtype_bytes=2, grad_accum=1, gpus_per_node=None,
                quantized_weights=False, quantized_gradients=False, hpz=False) -> int:
    """Bytes one rank sends per optimizer step (ring algorithms; chapter 2).

    g = 1: 2Ψ(N-1)/N·dtype_bytes for stages 0-2, 3Ψ(N-1)/N·dtype_bytes for
    stage 3. With g micro-batches: stages 0, 1 unchanged, stage 2 (g+1)/2
    times, stage 3 g times (module docstring).
    """
    return sum(op.bytes for op in comm_breakdown(
        psi, n_gpus, stage, dtype_bytes, grad_accum, gpus_per_node,
        quantized_weights, quantized_gradients, hpz))


def split_intra_inter(ops: list[CommOp]) -> dict:
    """{"intra": bytes, "inter": bytes} one rank sends, by where its group lives."""
    inter = sum(op.bytes for op in ops if op.inter_node)
    return {"intra": sum(op.bytes for op in ops) - inter, "inter": inter}


def step_comm_time(psi, n_gpus, stage, link=None, inter_link=None, bucket_elems=None, dtype_bytes=2,
                   grad_accum=1, gpus_per_node=None, quantized_weights=False,
                   quantized_gradients=False, hpz=False, node=None) -> float:
    """Seconds of communication per step in the alpha-beta model, no overlap.

    ``node``: a ``zerolab.theory.Node`` or preset name (``"dgx-a100"``, ``"dgx-h100"``,
    ``"cloud-100gbe"``): GPUs per node, NICs per node, the fabric inside. A collective
    whose group spans nodes runs at min(NVLink, NICs x NIC speed) (``theory.nodes``).
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
        lk = nd.link_for(op.group if op.inter_node else 1)
        one = lk.time(op.op, op.nbytes, op.group)                     # whole tensor at once
        extra = (buckets - 1) * lk.time(op.op, 0, op.group)           # latency of the other buckets
        total += op.count * (one + extra)
    return total
