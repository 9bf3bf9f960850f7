"""Sequence parallelism (zerolab/parallel/sequence.py; Korthikanti et al. 2022) on 2 and 4 gloo ranks: each
sequence op and layer against its plain form, TinyGPT with sequence_parallel=True against the plain model
(forward and every gradient, fp32), TP2 x DP2 under ZeRO-1/3 against single-process training, the TP bytes
against the all-reduce version, the LayerNorm's saved activations divided by tp, and bad input named."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import zerolab as zl
from zerolab.book.models import TinyGPT, loss_fn, synthetic_batch
from zerolab.parallel import (ColumnParallelLinear, RowParallelLinear, VocabParallelEmbedding, gather_from_sequence,
                              gather_tp, reduce_scatter_to_sequence, scatter_to_sequence, sequence_parallel_params,
                              tensor_parallel, tp_dims, vocab_parallel_cross_entropy)

TOL = 1e-6


def close(a, b):
    """Largest difference relative to the reference's scale (at least 1): fp32 sums of O(10) terms."""
    assert a.shape == b.shape, (a.shape, b.shape)
    return (a - b).abs().max().item() / max(1.0, b.abs().max().item())


def rows(t, mesh, dim=-2):
    """This TP rank's rows of the sequence."""
    return t.chunk(mesh.tp, dim=dim)[mesh.tp_rank]


def _ops_worker():
    mesh = zl.mesh(tp=2)
    comm, r = mesh.communicator("tp"), mesh.tp_rank
    g = torch.Generator().manual_seed(0)
    full = torch.randn(3, 8, 5, generator=g)
    w = [torch.randn(3, 8, 5, generator=g) for _ in range(2)]   # a different output gradient per rank
    out = {}
    # gather: forward the whole sequence; backward reduce-scatter: this rank's rows of w0 + w1
    x = rows(full, mesh).clone().requires_grad_()
    y = gather_from_sequence(x, comm)
    (y * w[r]).sum().backward()
    out["gather.y"] = close(y, full)
    out["gather.dx"] = close(x.grad, rows(w[0] + w[1], mesh))
    # reduce-scatter: forward this rank's rows of the sum of both ranks' inputs; backward all-gather
    parts = [torch.randn(3, 8, 5, generator=g) for _ in range(2)]
    x = parts[r].clone().requires_grad_()
    y = reduce_scatter_to_sequence(x, comm)
    (y * rows(w[r], mesh)).sum().backward()
    out["rs.y"] = close(y, rows(parts[0] + parts[1], mesh))
    out["rs.dx"] = close(x.grad, torch.cat([w[0].chunk(2, -2)[0], w[1].chunk(2, -2)[1]], dim=-2))
    # scatter (a (T, C) table): forward this rank's rows; backward all-gather of every rank's gradient
    x = full[0].clone().requires_grad_()
    y = scatter_to_sequence(x, comm)
    (y * rows(w[r][0], mesh)).sum().backward()
    out["scatter.y"] = close(y, rows(full[0], mesh))
    out["scatter.dx"] = close(x.grad, torch.cat([w[0][0].chunk(2, 0)[0], w[1][0].chunk(2, 0)[1]], dim=0))
    # an MLP region: column (gather) -> gelu -> row (reduce-scatter) against the plain layers
    fc, proj = nn.Linear(5, 12), nn.Linear(12, 5)
    xin = full.clone().requires_grad_()
    wout = w[0]
    (proj(F.gelu(fc(xin))) * wout).sum().backward()
    ref = {k: p.grad.clone() for k, p in (("W1", fc.weight), ("W2", proj.weight), ("b2", proj.bias))}
    proj.bias.grad = None   # the row-parallel layer keeps this very bias
    col, row = ColumnParallelLinear(fc, comm), RowParallelLinear(proj, comm)
    col.sequence_parallel, row.sequence_parallel = "gather", True
    xt = rows(full, mesh).clone().requires_grad_()
    mesh.ledger.reset()
    yt = row(F.gelu(col(xt)))
    (yt * rows(wout, mesh)).sum().backward()
    sp_bytes = mesh.ledger.total_bytes(group="tp")
    out["mlp.y"] = close(yt, rows(proj(F.gelu(fc(full))).detach(), mesh))
    out["mlp.dx"] = close(xt.grad, rows(xin.grad, mesh))
    out["mlp.dW1"] = close(col.weight.grad, ref["W1"].chunk(2, 0)[r])
    out["mlp.dW2"] = close(row.weight.grad, ref["W2"].chunk(2, 1)[r])
    out["mlp.db2_partial_sum"] = close(_summed(row.bias.grad, comm), ref["b2"])   # each rank: its rows' part
    # the same region without sequence parallelism: f and g, one all-reduce each
    col2, row2 = ColumnParallelLinear(fc, comm), RowParallelLinear(proj, comm)
    mesh.ledger.reset()
    (row2(F.gelu(col2(full.clone().requires_grad_()))) * wout).sum().backward()
    ar_bytes = mesh.ledger.total_bytes(group="tp")
    # the embedding: reduce-scatter along the sequence
    plain = nn.Embedding(16, 6)
    idx = torch.randint(0, 16, (4, 8), generator=g)
    we = torch.randn(4, 8, 6, generator=g)
    (plain(idx) * we).sum().backward()
    emb = VocabParallelEmbedding(plain, comm)
    emb.sequence_parallel = True
    ye = emb(idx)
    (ye * rows(we, mesh)).sum().backward()
    out["emb.y"] = close(ye, rows(plain(idx).detach(), mesh))
    out["emb.dW"] = close(emb.weight.grad, plain.weight.grad.chunk(2, 0)[r])
    return out, {"sp": sp_bytes, "allreduce": ar_bytes}


def _summed(t, comm):
    t = t.clone()
    comm.all_reduce(t)
    return t


def test_sequence_ops_and_layers_match_plain():
    for res, nbytes in zl.launch(_ops_worker, 2, timeout=120, threads=1):
        bad = {k: v for k, v in res.items() if not v <= TOL}
        assert not bad, bad
        # an all-reduce = a reduce-scatter + an all-gather: the region moves the same bytes
        assert nbytes["sp"] == nbytes["allreduce"] == 2 * 3 * 8 * 5 * 4, nbytes


def _tp_bytes(ledger, exclude=()):
    return sum(r.bytes for r in ledger.records if r.group == "tp" and r.tag not in exclude)


def _layernorm_saved_bytes(model, run):
    """Bytes of the activations autograd saves inside every LayerNorm's forward (measured with
    saved_tensors_hooks; the LayerNorm's own weight and bias are not activations and are left out)."""
    params = {p.data_ptr() for p in model.parameters()}
    inside, total = [False], [0]

    def pack(t):
        if inside[0] and t.data_ptr() not in params:
            total[0] += t.numel() * t.element_size()
        return t
    handles = []
    for m in model.modules():
        if isinstance(m, nn.LayerNorm):
            handles.append(m.register_forward_pre_hook(lambda *_: inside.__setitem__(0, True)))
            handles.append(m.register_forward_hook(lambda *_: inside.__setitem__(0, False)))
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = run()
    for h in handles:
        h.remove()
    return total[0], out


def _gpt_worker():
    """TinyGPT with sequence_parallel=True against the plain model: logits, loss, every gradient; then
    its TP bytes and the LayerNorms' saved activations against the same model without it."""
    mesh = zl.mesh(tp=2)
    plain = TinyGPT.preset("micro", key_bias=False, seed=1)
    x, y = synthetic_batch(plain, 4, seed=3)
    ref_logits = plain(x)
    ref_loss = loss_fn(ref_logits, y)
    ref_loss.backward()
    ref_grads = {n: p.grad for n, p in plain.named_parameters(remove_duplicate=False)}
    res = {}
    for sp in (True, False):
        model = tensor_parallel(TinyGPT.preset("micro", key_bias=False, seed=1), mesh, sequence_parallel=sp)
        dims = tp_dims(model)
        mesh.ledger.reset()
        saved, logits = _layernorm_saved_bytes(model, lambda: model(x))
        loss = vocab_parallel_cross_entropy(logits, y, mesh)
        loss.backward()
        res[sp] = {"saved": saved, "bytes": _tp_bytes(mesh.ledger, exclude=("sp-grad",)),
                   "grad_bytes": _tp_bytes(mesh.ledger) - _tp_bytes(mesh.ledger, exclude=("sp-grad",)),
                   "ops": sorted({(r.op, r.tag) for r in mesh.ledger.records})}
        if sp:
            grads = gather_tp({n: p.grad for n, p in model.named_parameters(remove_duplicate=False)}, dims, mesh)
            res["logits"] = close(logits, ref_logits.detach().chunk(2, -1)[mesh.tp_rank])
            res["loss"] = close(loss, ref_loss.detach())
            res["grads"] = {n: close(grads[n], g) for n, g in ref_grads.items()}
            res["marked"] = sequence_parallel_params(model)
            res["marked_numel"] = sum(p.numel() for p in model.parameters() if getattr(p, "sequence_parallel", 0))
    return res


def test_tinygpt_sequence_parallel_matches_plain_model():
    B, T, C, L = 4, 16, 32, 2   # micro preset, batch 4
    for res in zl.launch(_gpt_worker, 2, timeout=120, threads=1):
        assert res["logits"] <= TOL and res["loss"] <= TOL, res
        bad = {k: v for k, v in res["grads"].items() if not v <= TOL}
        assert not bad, bad
        assert sorted(res["marked"]) == sorted(
            [f"blocks.{i}.{n}" for i in range(L) for n in ("ln1.weight", "ln1.bias", "attn.proj.bias",
                                                            "ln2.weight", "ln2.bias", "out.bias")]
            + ["ln_f.weight", "ln_f.bias"])   # not wpe: its output's gradient is all-gathered whole
        sp, ar = res[True], res[False]
        # activations: every region's all-reduce became a reduce-scatter + an all-gather (same bytes each);
        # the one difference is q, k, v: without sequence parallelism each separate projection has its own
        # f (3 all-reduces in backward), with it the attention gathers once: 2 all-reduces of B*T*C fp32
        # fewer per layer (Megatron's fused qkv has one f: equal). One addition: the position embedding's
        # (T, C) output is split with no communication forward, its gradient all-gathered backward
        act = B * T * C * 4
        assert sp["bytes"] == ar["bytes"] - 2 * L * act + T * C * 4 // 2, (sp["bytes"], ar["bytes"])
        # the LayerNorm parameters and row-parallel biases: one all-reduce of their gradients per backward
        assert sp["grad_bytes"] == res["marked_numel"] * 4 and ar["grad_bytes"] == 0
        assert not any(op == "all_reduce" and tag in ("tp-g", "tp-f") for op, tag in sp["ops"]), sp["ops"]
        # the LayerNorms' saved activations (input, mean, rstd) hold T/tp tokens per rank: divided by tp
        assert sp["saved"] * 2 == ar["saved"] > 0, (sp["saved"], ar["saved"])


def _zero_worker(cases):
    from test_tp_zero import ADAM, DP, MBS, STEPS, build
    mesh = zl.mesh(dp=DP, tp=2)
    out = []
    for stage, gas, clip in cases:
        model = tensor_parallel(build(), mesh, sequence_parallel=True)
        engine = zl.initialize(model, {"optimizer": ADAM, "gradient_accumulation_steps": gas, "gradient_clipping": clip,
                                       "zero_optimization": {"stage": stage, "reduce_bucket_size": 3000}}, mesh=mesh)
        for step in range(STEPS):
            x, y = synthetic_batch(model, DP * gas * MBS, seed=7, step=step)
            for k in range(gas):
                lo = (k * DP + mesh.dp_rank) * MBS
                engine.backward(vocab_parallel_cross_entropy(engine(x[lo:lo + MBS]), y[lo:lo + MBS], mesh))
                engine.step()
        sd = engine.full_state_dict()   # whole over TP and DP under a mesh
        out.append(sd if mesh.rank == 0 else None)
    return out


ZERO_CASES = [(1, 1, 0.0), (3, 1, 0.0), (1, 2, 0.3), (3, 2, 0.3)]


def test_tp2_dp2_sequence_parallel_zero_matches_single_process():
    """ZeRO-1 and ZeRO-3 over DP=2 of TinyGPT under TP=2 with sequence parallelism, with and without
    gradient accumulation and clipping (the norm counts each replicated parameter once), against
    single-process training of the unsplit model (tests/test_tp_zero.py's reference)."""
    from test_tp_zero import reference
    got = zl.launch(_zero_worker, 4, args=(ZERO_CASES,), timeout=300, threads=1)[0]
    for (stage, gas, clip), sd in zip(ZERO_CASES, got):
        want = reference(gas, clip)
        assert sd.keys() == want.keys()
        worst = max(close(sd[k], want[k]) for k in want)
        assert worst <= 1e-4, (stage, gas, clip, worst)   # Adam on near-zero gradients: test_tp_zero.ADAM_ATOL


def _bad_worker():
    mesh = zl.mesh(tp=2)
    errors = {}
    model = tensor_parallel(TinyGPT.preset("micro", key_bias=False, seed=1), mesh, sequence_parallel=True)
    x, _ = synthetic_batch(model, 2, seed=3)
    try:
        model(x[:, :15])
    except ValueError as e:
        errors["odd"] = str(e)
    try:
        tensor_parallel(TinyGPT.preset("micro"), mesh, {"wpe": "sequence"})
    except ValueError as e:
        errors["style"] = str(e)
    return errors


def test_bad_sequence_input_is_named():
    errors = zl.launch(_bad_worker, 2, timeout=60, threads=1)[0]
    assert "sequence parallelism at 'wte': tp=2 does not divide the sequence length 15" in errors["odd"], errors
    assert "style 'sequence' (['wpe']) needs sequence_parallel=True" in errors["style"], errors


def _pp_worker(dp, tp, pp):
    """tests/test_pipeline.py's 3D run with sequence_parallel=True: the activations sent between stages
    hold T/tp of the sequence."""
    from test_pipeline import ADAM as P_ADAM, M as P_M, STEPS as P_STEPS, batches, gpt
    from zerolab.parallel import pipeline_stage, train_batch
    mesh = zl.mesh(dp=dp, tp=tp, pp=pp)
    model = gpt()
    stage = pipeline_stage(tensor_parallel(model, mesh, sequence_parallel=True), mesh)
    engine = zl.initialize(stage, {"optimizer": P_ADAM, "gradient_accumulation_steps": P_M,
                                   "zero_optimization": {"stage": 1}}, mesh=mesh)
    losses, rows = [], 4 // dp
    for step in range(P_STEPS):
        mine = [(x[rows * mesh.dp_rank: rows * (mesh.dp_rank + 1)], y[rows * mesh.dp_rank: rows * (mesh.dp_rank + 1)])
                for x, y in batches(model, step, rows=4)]
        losses.append(train_batch(engine, mesh, mine, lambda out, y: vocab_parallel_cross_entropy(out, y, mesh)))
    state = engine.full_state_dict()   # whole over TP, PP and DP under a mesh
    return {"state": state if mesh.rank == 0 else {k: v.sum().item() for k, v in state.items()}, "losses": losses,
            "bytes": {g: engine.comm.total_bytes(group=g) for g in ("dp", "tp", "pp")}}


def test_sequence_parallel_under_pipeline_stages_matches_single_process():
    """TP=2 with sequence parallelism inside PP=2 stages (4 ranks) trains to single-process training's
    parameters (tests/test_pipeline.py's reference and check)."""
    from test_pipeline import check_3d
    check_3d(zl.launch(_pp_worker, 4, args=(1, 2, 2), timeout=300, threads=1), 1, 2, 2)


def _mixed_worker(cfgs):
    from test_tp_zero import DP, MBS, STEPS_BF16, build
    mesh = zl.mesh(dp=DP, tp=2)
    out = []
    for cfg in cfgs:
        engine = zl.initialize(tensor_parallel(build(), mesh, sequence_parallel=True), cfg, mesh=mesh)
        for step in range(STEPS_BF16):
            x, y = synthetic_batch(build(), DP * engine.gas * MBS, seed=7, step=step)
            for k in range(engine.gas):
                lo = (k * DP + mesh.dp_rank) * MBS
                engine.backward(vocab_parallel_cross_entropy(engine(x[lo:lo + MBS]), y[lo:lo + MBS], mesh))
                engine.step()
        out.append((engine.full_state_dict(), engine.skipped_steps, str(engine.flat.flat.dtype)))
    return out


def test_mixed_precision_sequence_parallel_matches_fp32_master_reference():
    """bf16 and fp16 (the LayerNorm gradients all-reduced over TP in the compute dtype) under TP2 x DP2 with
    sequence parallelism, against the precision tests' reference with their tolerance."""
    from test_engine_precision import check_case, config
    cfgs = [config(1, "bf16", "sgd"), config(3, "bf16", "adam"), config(1, "fp16", "sgd")]
    results = zl.launch(_mixed_worker, 4, args=(cfgs,), timeout=300, threads=1)
    for ci, cfg in enumerate(cfgs):
        check_case("gpt", cfg, 2, results[0][ci])
