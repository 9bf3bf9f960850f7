"""The gate of a mixture-of-experts layer: top-k routing, capacity, drops and the balancing loss (chapter 11).

Pure tensor arithmetic on one group of T tokens (no communication); ``experts.py`` builds the
layer on it. For T tokens, E experts, top-k and capacity factor c:

* the router's probabilities ``p = softmax(x W_r)`` (T x E);
* each token's k largest: with k = 1 its gate is that probability (Switch Transformer: the router
  learns through it); with k >= 2 the k chosen probabilities renormalised to sum to 1 (GShard's
  top-2, Mixtral);
* the capacity of an expert in this group: ``C = ceil(c * k * T / E)`` slots. Slots are taken
  first choices first (every token's first choice in token order, then every second choice), as
  DeepSpeed's top-2 gate does; an assignment that finds its expert full is *dropped*: it adds
  nothing to the token's output (a token dropped by every choice gets zero from the layer and
  keeps only the residual connection around it, as in GShard and DeepSpeed). DeepSpeed also raises
  C to ``min_capacity`` (4 by default) and picks slots at random (``use_rts``); zerolab does neither;
* the load-balancing loss (Switch Transformer, eq. 4; GShard): ``aux = E * sum_e f_e * P_e``, with
  f_e the fraction of tokens whose first choice is e (before drops) and P_e the mean router
  probability of e. It is 1 when both are uniform and grows as tokens pile onto a few experts.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from zerolab.theory.experts import expert_capacity as capacity  # ceil(c * k * T / E): the one formula


def check_gate(num_experts: int, k: int, capacity_factor: float) -> None:
    """``ValueError`` naming the bad argument: E and k integers with 1 <= k <= E, capacity_factor > 0."""
    for name, v in (("num_experts", num_experts), ("k", k)):
        if isinstance(v, bool) or not isinstance(v, int) or v < 1:
            raise ValueError(f"MoE: {name} must be an integer >= 1, got {v!r}")
    if k > num_experts:
        raise ValueError(f"MoE: top-k routing with k={k} needs at least k experts, got num_experts={num_experts}")
    if isinstance(capacity_factor, bool) or not isinstance(capacity_factor, (int, float)) or not capacity_factor > 0:
        raise ValueError(f"MoE: capacity_factor must be a number > 0 (slots per expert = ceil(capacity_factor * k * "
                         f"tokens / num_experts)), got {capacity_factor!r}")


@dataclass
class Routing:
    """Where a group's k*T assignments go (choice-major: all first choices, then all second ones)."""
    token: torch.Tensor      # (kT,) int64: the token of each assignment
    expert: torch.Tensor     # (kT,) int64: its expert
    slot: torch.Tensor       # (kT,) int64: its position in the expert's C slots (>= C: dropped)
    gate: torch.Tensor       # (kT,) float: its weight in the token's output (differentiable)
    keep: torch.Tensor       # (kT,) bool: slot < C
    aux: torch.Tensor        # scalar: the load-balancing loss of the group
    capacity: int            # C
    counts: torch.Tensor     # (E,) int64: assignments each expert was offered (kept or not)


def route(logits: torch.Tensor, k: int, capacity_factor: float) -> Routing:
    """Top-k routing of one group's router ``logits`` (T x E) under the capacity (module docstring)."""
    t, e = logits.shape
    probs = F.softmax(logits, dim=-1, dtype=torch.float32)
    top_p, top_i = probs.topk(k, dim=-1)                                 # (T, k)
    gates = top_p if k == 1 else top_p / top_p.sum(dim=-1, keepdim=True)
    first = F.one_hot(top_i[:, 0], e).to(probs.dtype)                   # f_e counts first choices, before drops
    aux = e * (first.mean(dim=0) * probs.mean(dim=0)).sum()
    expert = top_i.t().reshape(-1)                                       # choice-major order
    onehot = F.one_hot(expert, e)
    slot = (onehot.cumsum(dim=0) - 1).gather(1, expert[:, None]).squeeze(1)   # arrival order at the expert
    c = capacity(t, e, k, capacity_factor)
    token = torch.arange(t, device=logits.device).repeat(k)
    return Routing(token, expert, slot, gates.t().reshape(-1), slot < c, aux, c, onehot.sum(dim=0))
