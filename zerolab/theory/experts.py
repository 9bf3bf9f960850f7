"""Expert parallelism in numbers: capacity, all-to-all bytes and memory per rank (chapter 11).

A mixture-of-experts layer (``zerolab.parallel.experts``) with E experts, top-k routing and
capacity factor c gives each expert C = ceil(c * k * T / E) slots for a rank's T tokens. Its
dispatch buffer holds E * C rows of h elements; every step it crosses the expert-parallel group
of ep ranks four times, as an all-to-all of that whole buffer:

    forward: dispatch (tokens to their experts' ranks), combine (outputs home);
    backward: the same two again (an all-to-all's gradient is the same all-to-all; the dispatch's
              is skipped when the layer's input needs no gradient, e.g. raw inputs: then 3).

Under the ring model (``network.ring_bytes``) one rank sends (ep - 1)/ep of each all-to-all's
tensor (the chunk for itself stays), so per layer and step

    bytes = 4 * E * C * h * b * (ep - 1) / ep       (b = bytes per element)
          ~ 4 * c * k * T * h * b * (ep - 1) / ep   (E * C ~ c * k * T),

about 4 c k h b bytes per token: unlike ZeRO's bytes, which follow the parameters, they follow the
tokens, whatever the experts' size. ``alltoall_bytes`` is the exact count (the ledger books it
under ``group="ep"``); ``comm.comm_breakdown(..., ep=, moe=)`` lists the collectives.

Memory (``moe_memory``): each rank keeps E/ep experts, Ψ_E/ep of the Ψ_E expert parameters, and
ZeRO shards them over the *expert-data-parallel* group: the dp/ep ranks that hold the same experts
(not the dp ranks: the others hold different experts). The dense parameters shard over all dp.
"""
from __future__ import annotations

import math

from zerolab.theory.memory import estimate
from zerolab.theory.network import ring_bytes


def expert_capacity(tokens: int, num_experts: int, k: int, capacity_factor: float) -> int:
    """Slots per expert for ``tokens`` tokens on one rank: ceil(capacity_factor * k * tokens / E)."""
    return math.ceil(capacity_factor * k * tokens / num_experts)


def _check(tokens, hidden, k, capacity_factor, num_experts, ep):
    for name, v in (("tokens", tokens), ("hidden", hidden), ("k", k), ("num_experts", num_experts), ("ep", ep)):
        if isinstance(v, bool) or not isinstance(v, int) or v < 1:
            raise ValueError(f"{name} must be an integer >= 1, got {v!r}")
    if k > num_experts or num_experts % ep:
        raise ValueError(f"need k <= num_experts and ep dividing num_experts; got k={k}, num_experts={num_experts}, "
                         f"ep={ep}")
    if not capacity_factor > 0:
        raise ValueError(f"capacity_factor must be > 0, got {capacity_factor!r}")


def alltoall_tensor_bytes(tokens, hidden, k, capacity_factor, num_experts, dtype_bytes=4) -> int:
    """The size of one all-to-all's tensor, the (E, C, h) buffer: E * C * h * dtype_bytes."""
    return num_experts * expert_capacity(tokens, num_experts, k, capacity_factor) * hidden * dtype_bytes


def alltoall_bytes(tokens, hidden, k, capacity_factor, num_experts, ep, dtype_bytes=4, backward=True,
                   layers=1) -> int:
    """Bytes one rank sends per step in the ep group's all-to-alls: dispatch + combine, forward (and
    backward: ``backward=True``), for ``layers`` MoE layers of ``tokens`` tokens each on this rank."""
    _check(tokens, hidden, k, capacity_factor, num_experts, ep)
    one = ring_bytes("all_to_all", alltoall_tensor_bytes(tokens, hidden, k, capacity_factor, num_experts,
                                                         dtype_bytes), ep)
    return layers * (4 if backward else 2) * one


def bytes_per_token(hidden, k, capacity_factor, ep, dtype_bytes=2, backward=True) -> float:
    """Bytes one rank sends per token and MoE layer, the limit of many tokens: (4 or 2) c k h b (ep-1)/ep."""
    return (4 if backward else 2) * capacity_factor * k * hidden * dtype_bytes * (ep - 1) / ep


def moe_memory(dense_params, expert_params, dp, ep, stage, precision="mixed", optimizer="adam") -> dict:
    """Model-state bytes per rank: the ``dense_params`` under ZeRO ``stage`` over the dp ranks, this
    rank's ``expert_params / ep`` expert parameters under the same stage over the dp/ep ranks of its
    expert-data-parallel group. {"dense": Estimate, "experts": Estimate, "total": bytes}."""
    for name, v in (("dp", dp), ("ep", ep)):
        if isinstance(v, bool) or not isinstance(v, int) or v < 1:
            raise ValueError(f"{name} must be an integer >= 1, got {v!r}")
    if dp % ep:
        raise ValueError(f"ep={ep} must divide dp={dp}: expert parallelism is carved out of the data-parallel ranks")
    if expert_params % ep:
        raise ValueError(f"expert_params={expert_params} must be a multiple of ep={ep} (E/ep whole experts a rank)")
    dense = estimate(dense_params, dp, stage, precision, optimizer)
    experts = estimate(expert_params // ep, dp // ep, stage, precision, optimizer)
    return {"dense": dense, "experts": experts, "total": dense.total + experts.total}


def active_params(dense_params, expert_params_each, num_experts, k) -> dict:
    """Total and active (used per token) parameters of a model whose MoE layers hold ``num_experts``
    experts of ``expert_params_each`` parameters in all (summed over layers), top-``k`` routed."""
    return {"total": dense_params + num_experts * expert_params_each, "active": dense_params + k * expert_params_each}


MOE_KEYS = ("tokens", "hidden", "k", "capacity_factor", "num_experts", "layers", "expert_params", "act_bytes")


def experts_ops(dp, ep, moe, grad_accum=1, dtype_bytes=2, gpus_per_node=None, stride=1) -> list:
    """The experts' collectives per optimizer step on one rank, as ``comm.CommOp`` fields (``comm_breakdown``'s
    ``ep=``, ``moe=``): ``moe`` = {"tokens": per rank and micro-batch, "hidden", "k", "capacity_factor",
    "num_experts", "layers" (MoE layers, default 1), "expert_params" (Ψ_E, all experts of all layers; default 0:
    no edp op), "act_bytes" (default ``dtype_bytes``)}. An ep group's ranks are ``stride`` (tp*pp) apart."""
    if not isinstance(moe, dict) or set(moe) - set(MOE_KEYS):
        raise ValueError(f"moe must be a dict with keys from {MOE_KEYS}, got {moe!r}")
    if isinstance(ep, bool) or not isinstance(ep, int) or ep < 1 or dp % ep:
        raise ValueError(f"ep must be an integer >= 1 dividing dp={dp} (carved out of the data-parallel ranks), "
                         f"got {ep!r}")
    m = {"layers": 1, "expert_params": 0, "act_bytes": dtype_bytes, **moe}
    _check(m["tokens"], m["hidden"], m["k"], m["capacity_factor"], m["num_experts"], ep)
    per_node = ep if gpus_per_node is None else min(ep, max(1, gpus_per_node // stride))
    nodes = -(-ep // per_node)
    ops = [dict(op="all_to_all", what="expert-tokens", group=ep, axis="ep", per_node=per_node, inter_node=nodes > 1,
                nbytes=alltoall_tensor_bytes(m["tokens"], m["hidden"], m["k"], m["capacity_factor"],
                                             m["num_experts"], m["act_bytes"]),
                count=4 * m["layers"] * grad_accum,   # dispatch + combine, forward and backward
                inter_share=(ep - per_node) / (ep - 1) if nodes > 1 else 0.0)]
    edp = dp // ep
    if m["expert_params"] and edp > 1:   # this rank's experts' gradients, summed over the ranks holding the same
        ops.append(dict(op="all_reduce", what="expert-grads", group=edp, axis="edp", per_node=1,
                        inter_node=gpus_per_node is not None and edp * ep * stride > gpus_per_node,
                        nbytes=m["expert_params"] // ep * dtype_bytes, count=1))
    return ops


def with_experts(breakdown, op_class, args: dict) -> list:
    """``comm_breakdown(**args)`` with ``args["ep"]`` > 1 or ``args["moe"]`` (``theory.comm`` passes itself and
    ``CommOp``): the dense ops, then ``experts_ops`` over the n/(tp·pp) data-parallel ranks."""
    ep, moe = args.pop("ep"), args.pop("moe")
    if args.get("cp", 1) != 1:
        raise ValueError("comm_breakdown: experts (ep=, moe=) with cp > 1 are not modelled (the ranks holding the "
                         "same experts would be an edp group times its cp group)")
    mp = args["tp"] * args["pp"]
    return breakdown(**args) + [op_class(**d) for d in experts_ops(args["n_gpus"] // mp, ep, moe, args["grad_accum"],
                                                                    args["dtype_bytes"], args["gpus_per_node"], mp)]
