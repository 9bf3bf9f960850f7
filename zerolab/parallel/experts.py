"""Expert parallelism: a mixture-of-experts layer whose experts are spread over the ranks (chapter 11).

``MoELayer(hidden, num_experts, k, capacity_factor, comm=)`` replaces a transformer block's MLP
by E expert MLPs and a router (GShard, Lepikhin et al. 2020; Switch Transformer, Fedus et al. 2021;
DeepSpeed-MoE). With ``comm`` the communicator of an expert-parallel group of ep ranks
(``zl.mesh(dp=, ep=).communicator("ep")``: ep consecutive members of a DP group), each rank keeps
E/ep experts — rank j the experts ``j*E/ep .. (j+1)*E/ep - 1`` — and every rank routes its own tokens:

1. the gate (``experts_gate.route``): router probabilities, top-k, each expert's capacity
   C = ceil(capacity_factor * k * T / E) for the rank's T tokens, the drops, the balancing loss;
2. *dispatch*: each kept assignment's token copied into its expert's slot of an (E, C, h) buffer
   (zeros in the empty slots), then an all-to-all over the ep group: chunk j (the experts of rank j)
   goes to rank j, so a rank receives (ep, E/ep, C, h): every rank's tokens for its own experts;
3. each local expert runs on its ep*C rows;
4. *combine*: the reverse all-to-all brings each row home, and a token's output is the sum of its
   kept assignments' rows, each times its gate.

Capacity is per rank's local tokens (as DeepSpeed computes it), so what is dropped depends only on
the rank's own tokens: the layer with ep = 1 on one process and ``groups=n`` (the batch cut into the
n ranks' slices, each routed alone) computes exactly what n ranks compute together. A global capacity
would need each rank to send C_global slots per expert, ep times the bytes.

Backward, each all-to-all's gradient is the same all-to-all (it is its own transpose), so one layer
runs four per step, every one of (E*C*h) elements: ``theory/experts.py`` counts their bytes, booked
under ``group="ep"``. An expert's gradient on its owner already sums every rank's tokens; the dense
data-parallel engine averages its gradients over dp, so ``reduce_expert_grads`` sums the expert
gradients over the *expert-data-parallel* group (the ranks holding the same experts: "edp", one rank
when ep == dp) and divides by dp. Expert parameters are marked ``allreduce = False`` (DeepSpeed's
mark); ``detach_experts`` takes them out of the model's parameters so that ``zl.initialize``
shards and reduces only the dense ones, and returns them for their own optimizer.
"""
from __future__ import annotations

import copy

import torch
import torch.nn.functional as F
from torch import nn

from zerolab.parallel.experts_gate import check_gate, route


class AllToAll(torch.autograd.Function):
    """All-to-all over the ep group (rank r's chunk j -> rank j's chunk r) forward; the same backward."""

    @staticmethod
    def forward(ctx, x, comm, tag):
        ctx.comm, ctx.tag = comm, tag
        x = x.contiguous()
        out = torch.empty_like(x)
        comm.all_to_all(out, x, tag=tag)
        return out

    @staticmethod
    def backward(ctx, grad):
        grad = grad.contiguous()
        out = torch.empty_like(grad)
        ctx.comm.all_to_all(out, grad, tag=ctx.tag + "-bwd")
        return out, None, None


def all_to_all(x, comm, tag="ep"):
    """``AllToAll`` when the group has more than one rank, else ``x`` itself."""
    return AllToAll.apply(x, comm, tag) if comm.world_size > 1 else x


class _OneRank:
    """The ep group of a layer given no communicator: this rank alone (ep = 1, every expert here), also when
    ``torch.distributed`` is running (a world ``Communicator`` would split the experts over every rank)."""
    rank, world_size, name = 0, 1, "ep"


ONE_RANK = _OneRank()


class Expert(nn.Module):
    """One expert: the transformer MLP, ``Linear(h, f) -> GELU -> Linear(f, h)``."""

    def __init__(self, hidden: int, ffn_hidden: int):
        super().__init__()
        self.fc, self.proj = nn.Linear(hidden, ffn_hidden), nn.Linear(ffn_hidden, hidden)

    def forward(self, x):
        return self.proj(F.gelu(self.fc(x)))


class MoELayer(nn.Module):
    """A mixture of ``num_experts`` experts, top-``k`` routed, experts spread over ``comm``'s ranks.

    ``comm``: the ep group's ``Communicator`` (None: ep = 1 on this rank, whatever the world).
    ``forward(x)`` takes (..., hidden) and returns ``(y, aux)``: y of x's shape, and the
    load-balancing loss (add ``coefficient * aux`` to the loss; Switch uses 0.01). ``expert``: a
    module copied E times (DeepSpeed's way: every expert starts equal), else E ``Expert(hidden,
    ffn_hidden)`` built one after another (each its own initialisation; every rank builds all E
    and keeps its own, so the layer starts as its ep = 1 twin under the same seed). ``groups``:
    route each of that many equal slices of the tokens alone (module docstring). ``last``: the
    routing of the latest forward (capacity, counts, kept and dropped assignments).
    """

    def __init__(self, hidden: int, num_experts: int, k: int = 1, capacity_factor: float = 1.0,
                 ffn_hidden: int | None = None, expert: nn.Module | None = None, comm=None, groups: int = 1):
        super().__init__()
        check_gate(num_experts, k, capacity_factor)
        comm = comm if comm is not None else ONE_RANK
        ep = comm.world_size
        if num_experts % ep:
            raise ValueError(f"MoE: num_experts={num_experts} is not divisible by the expert-parallel group size "
                             f"ep={ep}; each rank must hold the same number of experts (E/ep)")
        if isinstance(groups, bool) or not isinstance(groups, int) or groups < 1:
            raise ValueError(f"MoE: groups must be an integer >= 1, got {groups!r}")
        self.hidden, self.num_experts, self.k, self.capacity_factor = hidden, num_experts, k, capacity_factor
        self.comm, self.ep, self.groups = comm, ep, groups
        self.num_local_experts = num_experts // ep
        self.first_expert = comm.rank * self.num_local_experts   # this rank's experts: first .. first + E/ep - 1
        self.router = nn.Linear(hidden, num_experts, bias=False)
        every = [copy.deepcopy(expert) if expert is not None else Expert(hidden, ffn_hidden or 4 * hidden)
                 for _ in range(num_experts)]
        self.experts = nn.ModuleList(every[self.first_expert:self.first_expert + self.num_local_experts])
        for p in self.experts.parameters():
            p.allreduce = False         # DeepSpeed's mark of an expert-parallel parameter
            p.expert_parallel = True
        self.last = None

    def local_experts(self):
        """This rank's experts (also after ``detach_experts``)."""
        return self.__dict__["_detached_experts"] if "_detached_experts" in self.__dict__ else self.experts

    def forward(self, x):
        if self.ep > 1 and "_detached_experts" not in self.__dict__ and \
                any(getattr(p, "_zerolab_engine", False) for p in self.experts.parameters()):
            raise ValueError("MoELayer: its experts are inside a zl.initialize engine, which would average each "
                             "rank's different experts over the DP group; call zerolab.parallel.detach_experts(model) "
                             "before zl.initialize and train them with their own optimizer (reduce_expert_grads)")
        shape = x.shape
        if shape[-1] != self.hidden:
            raise ValueError(f"MoE: the input's last dimension is {shape[-1]}, the layer's hidden size {self.hidden}")
        tokens = x.reshape(-1, self.hidden)
        t, g = tokens.shape[0], self.groups
        if t % g:
            raise ValueError(f"MoE: {t} tokens cannot be cut into groups={g} equal slices")
        logits = self.router(tokens)
        routes = [route(logits[i * (t // g):(i + 1) * (t // g)], self.k, self.capacity_factor) for i in range(g)]
        c, e = routes[0].capacity, self.num_experts
        # slot index in the (E, g, C) buffer of each kept assignment; its token's row in ``tokens``
        rows = [((r.expert * g + i) * c + r.slot)[r.keep] for i, r in enumerate(routes)]
        toks = [(r.token + i * (t // g))[r.keep] for i, r in enumerate(routes)]
        gates = [r.gate[r.keep] for r in routes]
        rows, toks, gates = torch.cat(rows), torch.cat(toks), torch.cat(gates)
        buffer = tokens.new_zeros(e * g * c, self.hidden).index_copy(0, rows, tokens[toks])  # (E*g*C, h)
        out = self._experts(buffer.view(e, g * c, self.hidden)).reshape(e * g * c, self.hidden)
        y = tokens.new_zeros(t, self.hidden).index_add(0, toks, out[rows] * gates[:, None].to(out.dtype))
        self.last = {"capacity": c, "counts": torch.stack([r.counts for r in routes]),
                     "kept": [r.keep.clone() for r in routes], "dropped": int(sum((~r.keep).sum() for r in routes))}
        return y.reshape(shape), torch.stack([r.aux for r in routes]).mean()

    def _experts(self, buffer):
        """(E, S, h) slots -> the experts' outputs, each row back where it came from."""
        ep, n, s, h = self.ep, self.num_local_experts, buffer.shape[1], self.hidden
        dtype = next(self.local_experts().parameters()).dtype
        if dtype != buffer.dtype:   # e.g. detached fp32 experts behind a bf16 engine
            raise ValueError(f"MoELayer: the tokens are {buffer.dtype} but the experts' parameters {dtype}; keep the "
                             f"experts in the model's dtype (detached experts: experts.to({buffer.dtype}))")
        mine = all_to_all(buffer, self.comm, "ep-dispatch").view(ep, n, s, h)   # every rank's rows for my experts
        outs = [ex(mine[:, i].reshape(ep * s, h)).view(ep, s, h) for i, ex in enumerate(self.local_experts())]
        return all_to_all(torch.stack(outs, dim=1), self.comm, "ep-combine").view(self.num_experts, s, h)


def expert_parameters(model: nn.Module) -> list:
    """The expert-parallel parameters of every ``MoELayer`` in ``model`` (detached or not), in order."""
    return [p for m in model.modules() if isinstance(m, MoELayer) for p in m.local_experts().parameters()]


def detach_experts(model: nn.Module) -> nn.ModuleList:
    """Take every ``MoELayer``'s experts out of ``model``'s modules (the layers still run them) and return
    them in one ``ModuleList``: ``zl.initialize(model, ...)`` then shards and reduces the dense parameters
    over DP, and the experts train with their own optimizer after ``reduce_expert_grads``."""
    held = []
    for m in model.modules():
        if isinstance(m, MoELayer) and "experts" in m._modules:
            m.__dict__["_detached_experts"] = m._modules.pop("experts")
            held.extend(m.__dict__["_detached_experts"])
    return nn.ModuleList(held)


def reduce_expert_grads(params, edp_comm, dp: int) -> None:
    """Make each expert gradient the data-parallel average: sum over the expert-data-parallel group
    ``edp_comm`` (one all-reduce of all of them; nothing when it has one rank or is None), then divide by ``dp``,
    the engine's 1/dp for the dense parameters (an owner's gradient already sums every ep rank's tokens).
    Call it once per optimizer step, after the last micro-batch's backward, before the experts' step."""
    params = [p for p in params if p.grad is not None]
    if not params:
        return
    flat = torch.cat([p.grad.reshape(-1) for p in params])
    if edp_comm is not None and edp_comm.world_size > 1:
        edp_comm.all_reduce(flat, tag="edp-grads")
    flat /= dp
    for p, piece in zip(params, flat.split([p.numel() for p in params])):
        p.grad.copy_(piece.view_as(p.grad))
