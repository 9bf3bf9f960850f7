"""Expert parallelism (zerolab/parallel/experts.py): the MoE layer against a token-by-token reference on one
process; its experts spread over 2 gloo ranks against the same layer with ep = 1 on one process on the
concatenated batch (outputs, balancing loss, gradients of the input, the router and every expert; drops
included: capacity is per rank, so the reference routes each rank's slice alone, ``groups=n``); the ep
group's ledger bytes against ``theory/experts.py``; and the layer trained under a ZeRO engine over DP
(experts detached, their own Adam, gradients summed over the expert-data-parallel group and divided by dp)
against single-process training."""
from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import zerolab as zl
from zerolab.parallel.experts import MoELayer, detach_experts, expert_parameters, reduce_expert_grads
from zerolab.runtime.comm import Communicator
from zerolab.theory.experts import alltoall_bytes, expert_capacity, moe_memory

H, FFN, E = 8, 12, 4
# (k, capacity_factor, tokens per rank): drops at c=1 and c=0.5; none at c=4 (C >= T)
CASES = [(1, 1.0, 12), (2, 1.0, 12), (2, 0.5, 10), (1, 4.0, 6), (2, 1.25, 8)]
ATOL = 1e-5


def naive(layer, x, k, cf):
    """Token by token: top-k of the softmax, first choices take slots before second ones, in token order;
    an assignment past ceil(cf*k*T/E) slots adds nothing; Switch's E * sum f_e P_e."""
    t = x.shape[0]
    cap = math.ceil(cf * k * t / E)
    probs = F.softmax(x @ layer.router.weight.t(), dim=-1)
    top_p, top_i = probs.topk(k, dim=-1)
    gates = top_p if k == 1 else top_p / top_p.sum(-1, keepdim=True)
    used, out, dropped = [0] * E, [torch.zeros(H) for _ in range(t)], 0
    for choice in range(k):
        for tok in range(t):
            e = int(top_i[tok, choice])
            if used[e] < cap:
                out[tok] = out[tok] + gates[tok, choice] * layer.experts[e](x[tok])
            else:
                dropped += 1
            used[e] += 1
    f = torch.tensor([float((top_i[:, 0] == e).sum()) / t for e in range(E)])
    return torch.stack(out), E * (f * probs.mean(0)).sum(), dropped


def test_capacity_by_hand():
    # 10 tokens, 4 experts, top-1, factor 1: 2.5 slots -> 3 (ceil; a floor would drop a token per full expert)
    assert expert_capacity(10, 4, 1, 1.0) == 3 and expert_capacity(10, 4, 2, 0.5) == 3
    assert expert_capacity(16, 4, 2, 1.25) == 10 and expert_capacity(8, 4, 1, 1.0) == 2


@pytest.mark.parametrize("k,cf,t", CASES)
def test_layer_matches_token_by_token(k, cf, t):
    torch.manual_seed(0)
    layer = MoELayer(H, E, k, cf, ffn_hidden=FFN)
    x = torch.randn(t, H, generator=torch.Generator().manual_seed(1))
    y, aux = layer(x)
    want, want_aux, dropped = naive(layer, x, k, cf)
    torch.testing.assert_close(y, want, rtol=0, atol=ATOL)
    torch.testing.assert_close(aux, want_aux, rtol=0, atol=ATOL)
    assert layer.last["dropped"] == dropped and layer.last["capacity"] == expert_capacity(t, E, k, cf)
    assert (dropped > 0) == (cf < 4), (k, cf, dropped)   # the cases drop tokens where they say they do


def test_balancing_loss_by_hand():
    """A router of zeros: P_e = 1/E, every token's first choice is expert 0 (topk's tie), so f = (1, 0, 0, 0)
    and aux = E * 1 * 1/E = 1; a router sending every token to expert 2 with probability ~1: aux ~ E."""
    layer = MoELayer(H, E, 1, 1.0, ffn_hidden=FFN)
    x = torch.randn(8, H)
    with torch.no_grad():
        layer.router.weight.zero_()
    assert abs(float(layer(x)[1].detach()) - 1.0) < 1e-6
    with torch.no_grad():
        layer.router.weight[2] = 1e3 * x.sign().sum(0)   # a direction every x has a large positive product with
    x = x.abs() * layer.router.weight[2].sign()
    assert abs(float(layer(x)[1].detach()) - E) < 1e-3


def test_refusals():
    with pytest.raises(ValueError, match="capacity_factor must be a number > 0"):
        MoELayer(H, E, 1, 0.0)
    with pytest.raises(ValueError, match="k=5 needs at least k experts, got num_experts=4"):
        MoELayer(H, E, 5, 1.0)
    with pytest.raises(ValueError, match="k must be an integer >= 1"):
        MoELayer(H, E, 0, 1.0)
    layer = MoELayer(H, E, 1, 1.0)
    layer.experts.double()
    with pytest.raises(ValueError, match=r"the tokens are torch.float32 but the experts' parameters torch.float64"):
        layer(torch.randn(4, H))
    with pytest.raises(ValueError, match="groups=3 equal slices"):
        MoELayer(H, E, 1, 1.0, groups=3)(torch.randn(4, H))


def _ep_worker(cases):
    """Each case: the layer over the world as the ep group on this rank's slice of the batch."""
    comm = Communicator(name="ep")
    n, r = comm.world_size, comm.rank
    out = {}
    out["default_local"] = MoELayer(H, E, 1, 1.0).num_local_experts   # no comm: ep = 1 even with 2 ranks running
    try:
        MoELayer(H, 3, 1, 1.0, comm=comm)
    except ValueError as e:
        out["refusal"] = str(e)
    res = []
    for k, cf, t in cases:
        torch.manual_seed(0)
        layer = MoELayer(H, E, k, cf, ffn_hidden=FFN, comm=comm)
        g = torch.Generator().manual_seed(1)
        x_all, w_all = torch.randn(n * t, H, generator=g), torch.randn(n * t, H, generator=g)
        x = x_all[r * t:(r + 1) * t].clone().requires_grad_(True)
        comm.ledger.reset()
        y, aux = layer(x)
        ((y * w_all[r * t:(r + 1) * t]).sum() + aux).backward()
        res.append({"y": y.detach(), "aux": aux.detach(), "dx": x.grad, "router": layer.router.weight.grad,
                    "experts": {layer.first_expert + i: [p.grad for p in ex.parameters()]
                                for i, ex in enumerate(layer.experts)},
                    "kept": layer.last["kept"][0], "bytes": comm.ledger.total_bytes(group="ep"),
                    "calls": comm.ledger.count("all_to_all")})
    out["cases"] = res
    return out


@pytest.fixture(scope="module")
def ep2():
    return zl.launch(_ep_worker, 2, args=(CASES,), timeout=240, threads=1)


def reference(k, cf, t, n):
    torch.manual_seed(0)
    layer = MoELayer(H, E, k, cf, ffn_hidden=FFN, groups=n)
    g = torch.Generator().manual_seed(1)
    x, w = torch.randn(n * t, H, generator=g), torch.randn(n * t, H, generator=g)
    x.requires_grad_(True)
    y, aux = layer(x)
    ((y * w).sum() + n * aux).backward()   # the ranks' losses added: each its own slice's aux
    return layer, y.detach(), aux.detach(), x.grad


@pytest.mark.parametrize("ci", range(len(CASES)), ids=[f"k{k}-c{c}-t{t}" for k, c, t in CASES])
def test_ep2_matches_one_process(ep2, ci):
    k, cf, t = CASES[ci]
    n = len(ep2)
    layer, y, aux, dx = reference(k, cf, t, n)
    got = [ep2[r]["cases"][ci] for r in range(n)]
    torch.testing.assert_close(torch.cat([g["y"] for g in got]), y, rtol=0, atol=ATOL)
    torch.testing.assert_close(torch.stack([g["aux"] for g in got]).mean(), aux, rtol=0, atol=ATOL)
    torch.testing.assert_close(torch.cat([g["dx"] for g in got]), dx, rtol=0, atol=ATOL)
    torch.testing.assert_close(sum(g["router"] for g in got), layer.router.weight.grad, rtol=0, atol=ATOL)
    owned = {e: grads for g in got for e, grads in g["experts"].items()}
    assert sorted(owned) == list(range(E))   # each expert on exactly one rank: E/ep each, in order
    for e, ex in enumerate(layer.experts):
        for a, p in zip(owned[e], ex.parameters()):
            torch.testing.assert_close(a, p.grad, rtol=0, atol=ATOL, msg=lambda m: f"expert {e}: {m}")
    # the dropped set is the reference's, rank by rank (capacity per rank's tokens)
    for r, g in enumerate(got):
        assert torch.equal(g["kept"], layer.last["kept"][r]), (r, g["kept"], layer.last["kept"][r])
    assert (layer.last["dropped"] > 0) == (cf < 4)


def test_ep2_ledger_bytes_equal_formula(ep2):
    for ci, (k, cf, t) in enumerate(CASES):
        for r in ep2:
            g = r["cases"][ci]
            assert g["calls"] == 4   # dispatch + combine, forward and backward
            assert g["bytes"] == alltoall_bytes(t, H, k, cf, E, 2, dtype_bytes=4), (CASES[ci], g["bytes"])
    # by hand, the first case: C = ceil(12/4) = 3, the buffer 4*3*8 fp32 = 384 bytes, half of it sent, 4 times
    assert ep2[0]["cases"][0]["bytes"] == 4 * 384 // 2
    assert [r["default_local"] for r in ep2] == [E, E]
    assert ep2[0]["refusal"].startswith("MoE: num_experts=3 is not divisible by the expert-parallel group size ep=2")


def test_moe_memory_shards_experts_over_edp():
    # 1000 dense + 8000 expert parameters on dp=8, ep=4: 2000 expert parameters a rank, sharded over 2 (edp)
    m = moe_memory(1000, 8000, 8, 4, 3)
    assert (m["dense"].params, m["experts"].params) == (2 * 125, 2 * 1000)
    assert m["total"] == 16 * 125 + 16 * 1000
    with pytest.raises(ValueError, match="ep=3 must divide dp=8"):
        moe_memory(1000, 9000, 8, 3, 3)


# -- composed with ZeRO: dense parameters in a zl.initialize engine over DP, experts per ep rank ----------------
STEPS, T, LR, COEF = 3, 8, 1e-2, 0.01
MOE_K, MOE_CF = 2, 1.0   # drops tokens (checked below), so the dropped sets must agree step after step


class Net(nn.Module):
    """Linear -> tanh -> MoE with a residual -> Linear; returns (output, balancing loss)."""

    def __init__(self, comm=None, groups=1):
        super().__init__()
        self.inp = nn.Linear(H, H)
        self.moe = MoELayer(H, E, MOE_K, MOE_CF, ffn_hidden=FFN, comm=comm, groups=groups)
        self.out = nn.Linear(H, H)

    def forward(self, x):
        h = torch.tanh(self.inp(x))
        m, aux = self.moe(h)
        return self.out(h + m), aux


def batch(step, dp):
    g = torch.Generator().manual_seed(100 + step)
    return torch.randn(dp * T, H, generator=g), torch.randn(dp * T, H, generator=g)


def train_reference(dp):
    """One process, every parameter in torch.optim.Adam, the whole batch; each DP rank's slice routed alone."""
    torch.manual_seed(0)
    model = Net(groups=dp)
    opt = torch.optim.Adam(model.parameters(), lr=LR)
    dropped = 0
    for step in range(STEPS):
        x, y = batch(step, dp)
        out, aux = model(x)
        opt.zero_grad()
        (F.mse_loss(out, y) + COEF * aux).backward()
        opt.step()
        dropped += model.moe.last["dropped"]
    assert dropped > 0, "no token was dropped: the case does not test the capacity"
    return model


def _train_worker(dp, ep, stages, cases):
    mesh = zl.mesh(dp=dp, ep=ep)
    ep_comm, edp_comm = mesh.communicator("ep"), mesh.communicator("edp")
    out = {"layout": (mesh.ranks("ep"), mesh.ranks("edp")), "runs": [], "cases": []}
    for k, cf, t in cases:   # the layer alone, as _ep_worker, over this mesh's ep group
        torch.manual_seed(0)
        layer = MoELayer(H, E, k, cf, ffn_hidden=FFN, comm=ep_comm)
        g = torch.Generator().manual_seed(1)
        x_all, w_all = torch.randn(dp * t, H, generator=g), torch.randn(dp * t, H, generator=g)
        x = x_all[mesh.dp_rank * t:(mesh.dp_rank + 1) * t].clone().requires_grad_(True)
        y, aux = layer(x)
        ((y * w_all[mesh.dp_rank * t:(mesh.dp_rank + 1) * t]).sum() + aux).backward()
        reduce_expert_grads(expert_parameters(layer), edp_comm, 1)   # summed over the replicas, not averaged
        out["cases"].append({"y": y.detach(), "dx": x.grad, "router": layer.router.weight.grad,
                             "experts": {layer.first_expert + i: [p.grad for p in ex.parameters()]
                                         for i, ex in enumerate(layer.experts)}, "kept": layer.last["kept"][0]})
    torch.manual_seed(0)
    wrong = zl.initialize(Net(comm=ep_comm), {"optimizer": {"type": "Adam", "params": {"lr": LR}}}, mesh=mesh)
    try:   # experts left inside the engine: it would average rank 0's experts with rank 1's
        wrong(torch.randn(T, H))
    except ValueError as e:
        out["refusal"] = str(e)
    for stage in stages:
        torch.manual_seed(0)
        model = Net(comm=ep_comm)
        experts = detach_experts(model)
        engine = zl.initialize(model, {"optimizer": {"type": "Adam", "params": {"lr": LR}},
                                       "zero_optimization": {"stage": stage}}, mesh=mesh)
        expert_opt = torch.optim.Adam(experts.parameters(), lr=LR)
        mesh.ledger.reset()
        for step in range(STEPS):
            x, y = batch(step, dp)
            lo = mesh.dp_rank * T
            out_, aux = engine(x[lo:lo + T])
            engine.backward(F.mse_loss(out_, y[lo:lo + T]) + COEF * aux)
            reduce_expert_grads(experts.parameters(), edp_comm, dp)
            expert_opt.step()
            expert_opt.zero_grad()
            engine.step()
        first = model.moe.first_expert
        out["runs"].append({"dense": engine.full_state_dict(), "engine_names": len(list(model.parameters())),
                            "experts": {first + i: ex.state_dict() for i, ex in enumerate(experts)},
                            "bytes": {g: mesh.ledger.total_bytes(group=g) for g in ("dp", "ep", "edp")},
                            "dp_world": engine.world_size})
    return out


STAGES = (1, 3)


@pytest.fixture(scope="module")
def zero2():
    return zl.launch(_train_worker, 2, args=(2, 2, STAGES, []), timeout=300, threads=1)


@pytest.fixture(scope="module")
def zero4():
    return zl.launch(_train_worker, 4, args=(4, 2, STAGES, CASES[1:3]), timeout=400, threads=1)


def _check_training(results, dp, ep):
    want = train_reference(dp)
    ref = want.state_dict()
    for si, stage in enumerate(STAGES):
        for r, res in enumerate(results):
            run = res["runs"][si]
            assert run["dp_world"] == dp and run["engine_names"] == 5   # inp, router, out: the experts are apart
            assert sorted(run["dense"]) == ["inp.bias", "inp.weight", "moe.router.weight", "out.bias", "out.weight"]
            for name, v in run["dense"].items():
                torch.testing.assert_close(v, ref[name], rtol=1e-4, atol=1e-5, msg=lambda m: f"{stage} {name}: {m}")
            assert sorted(run["experts"]) == [r % ep * (E // ep) + i for i in range(E // ep)]
            for e, sd in run["experts"].items():
                for name, v in sd.items():
                    torch.testing.assert_close(v, ref[f"moe.experts.{e}.{name}"], rtol=1e-4, atol=1e-5,
                                               msg=lambda m: f"stage {stage} expert {e} {name}: {m}")


def _check_bytes(results, dp, ep):
    psi_e = E * (2 * H * FFN + FFN + H)   # every expert's fc and proj, weights and biases
    moe = {"tokens": T, "hidden": H, "k": MOE_K, "capacity_factor": MOE_CF, "num_experts": E, "expert_params": psi_e}
    by = zl.theory.comm.by_axis(zl.theory.comm_breakdown(100, dp, 1, dtype_bytes=4, ep=ep, moe=moe))
    for res in results:
        for run in res["runs"]:
            assert run["bytes"]["ep"] == STEPS * by["ep"] == STEPS * alltoall_bytes(T, H, MOE_K, MOE_CF, E, ep)
            assert run["bytes"]["edp"] == STEPS * by.get("edp", 0)
            assert (run["bytes"]["edp"] > 0) == (dp > ep)


def test_zero_dp2_ep2_trains_as_one_process(zero2):
    assert all("call zerolab.parallel.detach_experts(model) before zl.initialize" in r["refusal"] for r in zero2)
    assert [r["layout"] for r in zero2] == [([0, 1], [0]), ([0, 1], [1])]
    _check_training(zero2, 2, 2)
    _check_bytes(zero2, 2, 2)


def test_zero_dp4_ep2_trains_as_one_process(zero4):
    """Two ep groups {0, 1}, {2, 3}; experts 0-1 on ranks 0 and 2 (one edp group), 2-3 on 1 and 3."""
    assert [r["layout"] for r in zero4] == [([0, 1], [0, 2]), ([0, 1], [1, 3]), ([2, 3], [0, 2]), ([2, 3], [1, 3])]
    _check_training(zero4, 4, 2)
    _check_bytes(zero4, 4, 2)


@pytest.mark.parametrize("ci", [0, 1])
def test_layer_dp4_ep2_matches_one_process(zero4, ci):
    k, cf, t = CASES[1:3][ci]
    layer, y, aux, dx = reference(k, cf, t, 4)
    got = [r["cases"][ci] for r in zero4]
    torch.testing.assert_close(torch.cat([g["y"] for g in got]), y, rtol=0, atol=ATOL)
    torch.testing.assert_close(torch.cat([g["dx"] for g in got]), dx, rtol=0, atol=ATOL)
    torch.testing.assert_close(sum(g["router"] for g in got), layer.router.weight.grad, rtol=0, atol=ATOL)
    for r, g in enumerate(got):
        assert torch.equal(g["kept"], layer.last["kept"][r])
        for e, grads in g["experts"].items():   # summed over edp: every rank's tokens, on every replica
            for a, p in zip(grads, layer.experts[e].parameters()):
                torch.testing.assert_close(a, p.grad, rtol=0, atol=ATOL, msg=lambda m: f"rank {r} expert {e}: {m}")


def test_comm_breakdown_ep_by_hand():
    moe = {"tokens": 12, "hidden": H, "k": 1, "capacity_factor": 1.0, "num_experts": E}
    ops = zl.theory.comm_breakdown(1000, 4, 1, dtype_bytes=4, ep=2, moe=moe)
    by = zl.theory.comm.by_axis(ops)
    assert by["ep"] == 4 * 384 // 2 and "edp" not in by and by["dp"] > 0   # as the ledger's first case
    # 16 GPUs, 8 a node, one ep group of 16: 8 of each rank's 15 peers sit on the other node
    op = next(o for o in zl.theory.comm_breakdown(1000, 16, 1, gpus_per_node=8, ep=16, moe={**moe, "num_experts": 32})
              if o.axis == "ep")
    assert op.inter_node and op.per_node == 8 and op.inter_share == 8 / 15
    with pytest.raises(ValueError, match="ep must be an integer >= 1 dividing dp=4"):
        zl.theory.comm_breakdown(1000, 4, 1, ep=3, moe=moe)
    with pytest.raises(ValueError, match="moe must be a dict with keys from"):
        zl.theory.comm_breakdown(1000, 4, 1, ep=2)
    with pytest.raises(ValueError, match="experts .ep=, moe=. with cp > 1 are not modelled"):
        zl.theory.comm_breakdown(1000, 8, 1, cp=2, ep=2, moe=moe, layers=1, hidden=H, micro_batch=1, seq=8)
