"""Context parallelism (zerolab/parallel/context*.py) on 2 and 4 gloo ranks: Ulysses and ring attention against
plain single-process causal attention (outputs, gradients of q, k, v and of the projection weights, fp32, grouped-
query heads too); the bytes the ledger books under "cp" equal theory/context.py's formula exactly, forward and
backward; zl.mesh(dp=2, cp=2) under ZeRO-2 trains to the parameters of single-process training on the whole
sequences and batch; bad head counts and sequence lengths refused by name."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import zerolab as zl
from zerolab.parallel.context import (ContextParallelAttention, ContextParallelLM, attention, context_attention,
                                      split_sequence)
from zerolab.theory.comm import by_axis, comm_breakdown
from zerolab.theory.context import context_bytes

TOL = 1e-5
B, S, H, HKV, D = 2, 16, 8, 4, 4   # batch, sequence, query heads, key/value heads (grouped-query), head dim
C = H * D


def diff(a, b):
    assert a.shape == b.shape, (a.shape, b.shape)
    return (a - b).abs().max().item()


def _exact_worker(methods):
    """Per method: the function on q, k, v leaves (grouped-query heads) and the attention block (its
    projection weights) against plain attention on the whole sequence; the ledger's "cp" bytes."""
    m = zl.mesh(cp=torch.distributed.get_world_size())
    comm, out = m.communicator("cp"), {}
    g = torch.Generator().manual_seed(0)
    q, k, v = torch.randn(B, S, H, D, generator=g), torch.randn(B, S, HKV, D, generator=g), \
        torch.randn(B, S, HKV, D, generator=g)
    w = torch.randn(B, S, H, D, generator=g)      # the output's gradient
    x, wx = torch.randn(B, S, C, generator=g), torch.randn(B, S, C, generator=g)
    ref = [t.clone().requires_grad_() for t in (q, k, v)]
    (attention(*ref) * w).sum().backward()
    plain = ContextParallelAttention(C, H, HKV)
    xr = x.clone().requires_grad_()
    (plain(xr) * wx).sum().backward()
    for method in methods:
        r = {}
        mine = [split_sequence(t, comm).requires_grad_() for t in (q, k, v)]
        m.ledger.reset()
        y = context_attention(*mine, comm=comm, method=method)
        r["fwd_bytes"] = m.ledger.total_bytes(group="cp")
        (y * split_sequence(w, comm)).sum().backward()
        r["bytes"] = m.ledger.total_bytes(group="cp")
        r["out"] = diff(y, split_sequence(attention(q, k, v), comm))
        r["grads"] = max(diff(a.grad, split_sequence(b.grad, comm)) for a, b in zip(mine, ref))
        both = [split_sequence(t, comm) for t in (q, k, v)]   # without the causal mask: every chunk seen
        r["bidirectional"] = diff(context_attention(*both, comm=comm, method=method, causal=False),
                                  split_sequence(attention(q, k, v, causal=False), comm))
        block = ContextParallelAttention(C, H, HKV, comm=comm, method=method)
        block.load_state_dict(plain.state_dict())
        xm = split_sequence(x, comm).requires_grad_()
        m.ledger.reset()
        ym = block(xm)
        (ym * split_sequence(wx, comm)).sum().backward()
        r["block_bytes"] = m.ledger.total_bytes(group="cp")
        r["block_out"] = diff(ym, split_sequence(plain(x), comm))
        r["block_dx"] = diff(xm.grad, split_sequence(xr.grad, comm))
        worst = 0.0
        for (name, p), pr in zip(block.named_parameters(), plain.parameters()):
            gsum = p.grad.clone()   # each rank's part of the weight's gradient: summed over cp (not booked)
            torch.distributed.all_reduce(gsum, group=m.group("cp"))
            worst = max(worst, diff(gsum, pr.grad))
        r["block_dw"] = worst
        out[method] = r
    return out


def _check_exact(results, cp):
    for rank, per in enumerate(results):
        for method, r in per.items():
            for key in ("out", "grads", "bidirectional", "block_out", "block_dx", "block_dw"):
                assert r[key] < TOL, (rank, method, key, r[key])
            # function: one layer, query hidden H*D, key/value hidden HKV*D; fp32
            want = context_bytes(cp, method, layers=1, hidden=C, micro_batch=B, seq=S, act_bytes=4, kv_hidden=HKV * D)
            assert r["bytes"] == r["block_bytes"] == want, (rank, method, r["bytes"], want)
            assert r["fwd_bytes"] == context_bytes(cp, method, 1, C, B, S, 4, HKV * D, backward=False) > 0


def test_exact_on_2_ranks():
    _check_exact(zl.launch(_exact_worker, 2, args=(("ulysses", "ring"),), timeout=180, threads=1), 2)


def test_exact_on_4_ranks():
    _check_exact(zl.launch(_exact_worker, 4, args=(("ulysses", "ring"),), timeout=240, threads=1), 4)


def test_formula_by_hand():
    # Ulysses, cp=4, one layer, b=2, s=16, h=32, fp32: q is 2*4*32*4 = 1024 bytes, an all-to-all sends 3/4:
    # 4 all-to-alls of q-size and 4 of k-size (h_kv = 16: 512 bytes) -> 4*768 + 4*384
    assert context_bytes(4, "ulysses", 1, 32, 2, 16, 4, kv_hidden=16) == 4 * 768 + 4 * 384
    # ring, cp=4: K = 512 bytes; forward 3 sends of 2K, backward 3 of 4K and one of 2K
    assert context_bytes(4, "ring", 1, 32, 2, 16, 4, kv_hidden=16) == 3 * 1024 + 3 * 2048 + 1024
    assert context_bytes(4, "ring", 1, 32, 2, 16, 4, kv_hidden=16, backward=False) == 3 * 1024
    assert context_bytes(1, "ring", 1, 32, 2, 16, 4) == 0
    ops = comm_breakdown(10_000, 4, 2, cp=2, layers=2, hidden=32, micro_batch=2, seq=16, act_bytes=4)
    axes = by_axis(ops)
    assert axes["cp"] == context_bytes(2, "ulysses", 2, 32, 2, 16, 4) and axes["dp"] == 0
    assert axes["dp_cp"] == by_axis(comm_breakdown(10_000, 4, 2))["dp"] > 0   # ZeRO over dp*cp = 4 ranks


def test_bad_input_named():
    with pytest.raises(ValueError, match="cp=4 does not divide seq=10"):
        context_bytes(4, "ring", 1, 32, 2, 10)
    with pytest.raises(ValueError, match="cp_method must be one of"):
        context_bytes(2, "zigzag", 1, 32, 2, 16)
    with pytest.raises(ValueError, match="cp=2 needs layers=, hidden="):
        comm_breakdown(10_000, 4, 2, cp=2)
    with pytest.raises(ValueError, match="method must be one of"):
        ContextParallelAttention(32, 4, method="flash")


def _bad_worker():
    m = zl.mesh(cp=2)
    comm, errors = m.communicator("cp"), []
    for make in (lambda: ContextParallelAttention(24, 3, comm=comm),                     # 3 heads, cp=2
                 lambda: ContextParallelAttention(32, 4, n_kv_head=1, comm=comm),        # 1 kv head
                 lambda: split_sequence(torch.zeros(1, 7, 4), comm)):                  # 7 tokens
        try:
            make()
        except ValueError as e:
            errors.append(str(e))
    ContextParallelAttention(24, 3, comm=comm, method="ring")   # ring splits only the sequence: fine
    return errors


def test_bad_input_inside_ranks():
    errors = zl.launch(_bad_worker, 2, timeout=120, threads=1)[0]
    assert len(errors) == 3
    assert "cp=2 does not divide the 3 query heads" in errors[0] and "method='ring'" in errors[0]
    assert "cp=2 does not divide the 1 key/value heads" in errors[1]
    assert "cp=2 does not divide the sequence length 7" in errors[2]


LM = dict(vocab=64, n_embd=32, n_head=4, layers=2, max_seq=S, seed=3)
STEPS, ROWS, LR = 3, 4, 0.1   # optimizer steps, sequences per step (whole batch), SGD learning rate


def _batch(step):
    g = torch.Generator().manual_seed(100 + step)
    idx = torch.randint(0, LM["vocab"], (ROWS, S + 1), generator=g)
    return idx[:, :-1], idx[:, 1:]


def _zero_worker(method):
    m = zl.mesh(dp=2, cp=2)
    model = ContextParallelLM(**LM, comm=m.communicator("cp"), method=method)
    engine = zl.initialize(model, {"train_micro_batch_size_per_gpu": ROWS // 2,
                                   "optimizer": {"type": "SGD", "params": {"lr": LR}},
                                   "zero_optimization": {"stage": 2}}, mesh=m)
    m.ledger.reset()
    rows = ROWS // m.dp
    for step in range(STEPS):
        x, y = _batch(step)
        x, y = (split_sequence(t[m.dp_rank * rows:(m.dp_rank + 1) * rows], m.communicator("cp")) for t in (x, y))
        logits = engine(x)
        engine.backward(F.cross_entropy(logits.reshape(-1, logits.shape[-1]), y.reshape(-1)))
        engine.step()
    return {"state": engine.full_state_dict(), "cp": m.ledger.total_bytes(group="cp"),
            "world": engine.communicator.world_size, "group": engine.communicator.name,
            "dp": m.ledger.total_bytes(group="dp")}


@pytest.mark.parametrize("method", ["ulysses", "ring"])
def test_zero2_over_dp_and_cp(method):
    results = zl.launch(_zero_worker, 4, args=(method,), timeout=300, threads=1)
    ref = ContextParallelLM(**LM)
    opt = torch.optim.SGD(ref.parameters(), lr=LR)
    for step in range(STEPS):
        x, y = _batch(step)
        opt.zero_grad()
        logits = ref(x)
        F.cross_entropy(logits.reshape(-1, logits.shape[-1]), y.reshape(-1)).backward()
        opt.step()
    want = ref.state_dict()
    for r in results:
        assert (r["world"], r["group"], r["dp"]) == (4, "dp_cp", 0)   # gradients averaged over dp*cp = 4 ranks
        assert r["cp"] == context_bytes(2, method, layers=2, hidden=32, micro_batch=ROWS // 2, seq=S, act_bytes=4,
                                        m=STEPS)
        worst = max(diff(r["state"][n].float(), want[n]) for n in want)
        assert worst < TOL, (method, worst)
        moved = max(diff(want[n], ContextParallelLM(**LM).state_dict()[n]) for n in want)
        assert moved > 1e-3   # training changed the parameters: the comparison means something
