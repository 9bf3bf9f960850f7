"""Where a traced collective runs on a modelled cluster, and a trace at a target model's size (``replay``).

**Placement.** The ``W`` recorded ranks stand for the cluster's ``G`` GPUs (weak scaling: each GPU
does what a recorded rank did). A recorded group becomes the group it stands for, with ``per_node``
of its ranks on each node it touches (the cluster's GPUs ``g`` per node; TP innermost, then PP,
DP outermost, as ``zl.mesh`` lays them):

    "tp"                           the same size, inside one node
    "pp"                           the same size, min(pp, g / tp) per node
    "dp", or every recorded rank   G / (tp·pp) ranks, min(that, g / (tp·pp)) per node
    inside one recorded node       the whole node if it was the whole recorded node, else the same size
    one rank per recorded node     one rank on each of the cluster's G / g nodes (needs two or more)

**Target size.** With ``model=`` (a ``theory.ModelShape``) each unit's bytes and FLOPs become the
target's, unit by unit: the recorded model must have the target's layer count; a collective's
elements are read as whole units (a layer or the rest), and each becomes the target's unit; each
stretch of compute is scaled by (target FLOPs / recorded FLOPs) of its unit's kind and phase.
"""
from __future__ import annotations

import re

from zerolab.theory.shapes import get_shape


class ReplayError(ValueError):
    """A trace the replay cannot replay: the message names the rank, collective or record."""


def record_info(e):
    """A trace record's details: ``.info`` (runtime/trace.py's Record) or a fourth field (hand-made traces)."""
    return getattr(e, "info", None) if len(e) < 4 else e[3]


def placement(members, group, meta, gpus, per_node_gpus):
    """``(size, per_node, kind)`` on the cluster of the recorded group ``members`` (module docstring)."""
    n, world, k = len(members), meta["world"], meta["ranks_per_node"]
    tp, pp = meta.get("tp", 1), meta.get("pp", 1)
    g = per_node_gpus
    if group == "tp":
        if n > g:
            raise ReplayError(f"a TP group of {n} ranks does not fit in a node of {g} GPUs")
        return n, n, "tp"
    if group == "pp":
        return n, min(n, max(1, g // tp)), "pp"
    if group == "dp" or n == world:
        if gpus % (tp * pp):
            raise ReplayError(f"the cluster's {gpus} GPUs are not a multiple of tp x pp = {tp * pp}")
        dp = gpus // (tp * pp)
        return dp, min(dp, max(1, g // (tp * pp))), "dp"
    nodes = {m // k for m in members}
    if len(nodes) == 1:
        return (g, g, "node") if n == k else (n, n, "node-part")
    if len(nodes) == n:
        if gpus // g < 2:
            raise ReplayError(f"the trace uses the inter-node tier (group {list(members)}: one rank per node) "
                              f"but the cluster has one node of {g} GPUs; replay it on two or more nodes")
        return gpus // g, 1, "inter"
    raise ReplayError(f"a collective on group {list(members)} ({group or 'no mesh name'}) that the cluster "
                      f"cannot place: neither a mesh group, the world, one node, nor one rank per node")


_BLOCK = re.compile(r"(^|\.)\d+$")


def unit_kinds(meta) -> list[str]:
    """Per recorded unit: "layer" (an element of a ModuleList: a transformer block) or "rest"."""
    return ["layer" if _BLOCK.search(name) else "rest" for name, _, _ in meta["units"]]


def count_passes(prog, meta) -> tuple[int, dict]:
    """Forward passes (micro-batches) in one rank's program, and its FLOPs by (unit kind, phase)."""
    names, passes, last, kinds = unit_kinds(meta), 0, None, {}
    for it in prog:
        if it[0] != "compute":
            continue
        if it[2] == "forward" and last != "forward":
            passes += 1
        last = it[2]
        kind = names[it[1]] if 0 <= it[1] < len(names) else "rest"
        kinds[kind, it[2]] = kinds.get((kind, it[2]), 0) + it[3]
    return passes, kinds


class Scaler:
    """The target's bytes and FLOPs for a trace's collectives and compute (module docstring)."""

    def __init__(self, model, meta, flops_by_kind: dict, passes: int):
        self.shape = get_shape(model)
        kinds = unit_kinds(meta)
        self.kinds = kinds
        layers = kinds.count("layer")
        if layers != self.shape.layers:
            raise ReplayError(f"the trace's model has {layers} layers (units that are ModuleList elements), the "
                              f"target {self.shape.name} has {self.shape.layers}: record a model with the target's "
                              f"layer count (at any width) so the engine's order is the target's, unit by unit")
        mp = meta.get("tp", 1) * meta.get("pp", 1)
        self.sizes = {}   # padded elements -> target elements, per kind
        rec = {"layer": 0, "rest": 0}
        for (name, numel, padded), kind in zip(meta["units"], kinds):
            rec[kind] += numel
        target = {"layer": self.shape.layers * self.shape.layer_params / mp, "rest": self.shape.rest_params / mp}
        self.per_element = {kind: target[kind] / rec[kind] if rec[kind] else 0.0 for kind in rec}
        self.units = [(padded, kind) for (_, _, padded), kind in zip(meta["units"], kinds)]
        self.psi_ratio = sum(target.values()) / max(1, sum(rec.values()))
        self.flop_ratio = {}
        for kind in ("layer", "rest"):
            for phase in ("forward", "backward"):
                per_pass = self.shape.layers * self.shape.layer_flops(phase) if kind == "layer" \
                    else self.shape.rest_flops(phase)
                got = flops_by_kind.get((kind, phase), 0)
                self.flop_ratio[kind, phase] = per_pass * passes / mp / got if got else 0.0

    def flops(self, unit: int, phase: str, flops: float) -> float:
        kind = self.kinds[unit] if 0 <= unit < len(self.kinds) else "rest"
        return flops * self.flop_ratio[kind, phase]

    def nbytes(self, nbytes: int, elem_bytes: int) -> float:
        """The target's bytes for a collective of ``nbytes`` carrying whole units of ``elem_bytes`` each."""
        numel = nbytes // max(1, elem_bytes)
        picked = _decompose(numel, self.units)
        if picked is None:           # not whole units (quantized payloads, flags): the model-wide ratio
            return nbytes * self.psi_ratio
        return sum(padded * self.per_element[kind] for padded, kind in picked) * elem_bytes

    def optimizer_numel(self, numel: int) -> float:
        return numel * self.psi_ratio


def _decompose(numel: int, units: list):
    """A sub-multiset of ``units`` ((padded, kind) pairs) whose sizes add up to ``numel``, else None."""
    for padded, kind in units:                  # one unit (the common case: stage 3, per-unit reductions)
        if padded == numel:
            return [(padded, kind)]
    sizes = {}
    for padded, kind in units:
        sizes.setdefault((padded, kind), 0)
        sizes[padded, kind] += 1
    keys = sorted(sizes, reverse=True)

    def go(i, left):
        if left == 0:
            return []
        if i == len(keys):
            return None
        (size, kind), most = keys[i], sizes[keys[i]]
        for c in range(min(most, left // size), -1, -1):
            rest = go(i + 1, left - c * size)
            if rest is not None:
                return [(size, kind)] * c + rest
        return None
    return go(0, numel) if numel > 0 else None
