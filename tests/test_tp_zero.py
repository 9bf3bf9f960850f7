"""ZeRO over the DP group of a mesh (issue 24, item 4): TinyGPT tensor-parallel over TP=2 and sharded
by ZeRO over DP=2, on 4 gloo ranks, trains to the parameters of single-process training of the unsplit
model (TP shards gathered to compare); the ledger books each collective under its group, and on two
simulated nodes the TP bytes stay inside a node while the DP bytes cross."""
from __future__ import annotations

import os

import pytest
import torch

import zerolab as zl
from zerolab.book.models import TinyGPT, loss_fn, synthetic_batch
from zerolab.parallel import gather_tp, tensor_parallel, tp_dims, vocab_parallel_cross_entropy
from zerolab.theory.checks import mesh_share

STEPS, MBS, DP = 3, 2, 2   # MBS rows per DP rank and micro-batch
# no weight decay: with it one wte element of this seed has g + wd*w within 1e-8 of zero, where Adam
# turns rounding into a 1e-5 difference (measured: 2.7e-5 after one step, everything else < 1e-6)
ADAM = {"type": "Adam", "params": {"lr": 3e-3}}
# Adam divides by sqrt(v): an element whose gradient is near zero turns the last bits of the split
# matmuls' sums into ~1e-5 (measured on this machine's BLAS: one element of 1024, 1.2e-5 to 5.6e-5); a wrong
# split, a missing reduction or clipping moves every element by 1e-3 or more
ADAM_ATOL = 1e-4


def build():
    return TinyGPT.preset("micro", key_bias=False, seed=1)   # no key bias: its true gradient is exactly zero


def reference(gas, clip=0.0):
    """Single process, torch.optim.Adam, the unsplit model, the whole global batch at once."""
    model = build()
    opt = torch.optim.Adam(model.parameters(), **ADAM["params"])
    clipped = 0
    for step in range(STEPS):
        x, y = synthetic_batch(model, DP * gas * MBS, seed=7, step=step)
        opt.zero_grad()
        loss_fn(model(x), y).backward()
        if clip:
            clipped += bool(torch.nn.utils.clip_grad_norm_(model.parameters(), clip) > clip)
        opt.step()
    assert clipped or not clip, "the clipping threshold never binds: the case tests nothing"
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def _worker(cases):
    mesh = zl.mesh(dp=DP, tp=2)
    out = []
    for stage, gas, clip in cases:
        model = tensor_parallel(build(), mesh)
        dims = tp_dims(model)
        replicated = sum(p.numel() for n, p in model.named_parameters() if n not in dims)   # before stage 3 frees them
        zero = {"stage": stage, "reduce_bucket_size": 3000}
        if stage == 3:   # every parameter partitioned, nothing kept gathered: memory() is the formula's
            zero.update(stage3_param_persistence_threshold=0, stage3_max_reuse_distance=0,
                        stage3_prefetch_bucket_size=0)
        engine = zl.initialize(model, {"optimizer": ADAM, "gradient_accumulation_steps": gas,
                                       "gradient_clipping": clip, "zero_optimization": zero}, mesh=mesh)
        mesh.ledger.reset()
        for step in range(STEPS):
            x, y = synthetic_batch(model, DP * gas * MBS, seed=7, step=step)
            for k in range(gas):   # this DP rank's rows of micro-batch k; both TP ranks read the same rows
                lo = (k * DP + mesh.dp_rank) * MBS
                engine.backward(vocab_parallel_cross_entropy(engine(x[lo:lo + MBS]), y[lo:lo + MBS], mesh))
                if step == 0 and k == gas - 1:   # between backward and step: everything exists
                    mem = engine.memory().as_dict()
                engine.step()
        bytes_ = {g: engine.comm.total_bytes(group=g) for g in ("dp", "tp", "pp")}
        bytes_.update({f"{g}-inter": engine.comm.total_bytes(group=g, scope="inter") for g in ("dp", "tp")})
        sd = gather_tp(engine.full_state_dict(), dims, mesh)
        out.append({"state": sd if mesh.rank == 0 else {k: v.sum().item() for k, v in sd.items()},
                    "bytes": bytes_, "dp_world": engine.world_size, "coords": (mesh.dp_rank, mesh.tp_rank),
                    "mem": mem, "numel": engine.flat.numel, "padded": engine.flat.padded,
                    "replicated": replicated})
    return out


# (stage, gradient accumulation, clipping): the clipping norm takes each TP slice once and each
# replicated parameter once (engine/mesh_norm.py); 0.3 binds on every step (the reference checks it)
CASES = [(1, 1, 0.0), (3, 1, 0.0), (0, 2, 0.0), (2, 1, 0.0), (1, 1, 0.3), (3, 2, 0.3), (0, 1, 0.3), (2, 2, 0.3)]


@pytest.fixture(scope="module")
def results():
    # two simulated nodes of 2 ranks: each TP pair inside a node, each DP pair across the two
    return zl.launch(_worker, 4, args=(CASES,), timeout=300, threads=1, ranks_per_node=2)


@pytest.mark.parametrize("ci", range(len(CASES)), ids=[f"stage{s}-gas{g}-clip{c}" for s, g, c in CASES])
def test_tp2_dp2_matches_single_process(results, ci):
    stage, gas, clip = CASES[ci]
    want = reference(gas, clip)
    got = results[0][ci]["state"]
    assert got.keys() == want.keys()
    for name in want:
        assert got[name].shape == want[name].shape, name
        torch.testing.assert_close(got[name], want[name], rtol=1e-4, atol=ADAM_ATOL,
                                   msg=lambda m: f"stage {stage} gas {gas} {name}: {m}")
    for r in range(1, 4):   # every rank gathered the same full model
        for name in want:
            assert abs(results[r][ci]["state"][name] - float(got[name].sum())) <= 1e-4, (r, name)


def test_engine_shards_over_dp_only_and_books_per_group(results):
    for r, per_rank in enumerate(results):
        assert per_rank[0]["coords"] == (r // 2, r % 2)
        for (stage, gas, clip), res in zip(CASES, per_rank):
            assert res["dp_world"] == 2
            b = res["bytes"]
            assert b["dp"] > 0 and b["pp"] == 0, (stage, b)
            assert b["tp-inter"] == 0 and b["dp-inter"] == b["dp"], b   # TP stays in the node; DP crosses
            # TP, per micro-batch, all-reduces of MBS*T*C fp32 activations (a 2-rank ring sends M bytes):
            # forward g after the embedding and after proj and out in each of the 2 blocks (5); backward
            # f before the head and before q, k, v and fc in each block (1 + 2*4 = 9: q, k and v are
            # separate layers here, one f each; Megatron's fused qkv has one); the loss: 3 all-reduces
            # of MBS*T fp32 (max, target logit, sum of exponentials). The ZeRO stage changes none of it.
            # With clipping: the squared norm (one fp32) all-reduced over TP once per step.
            act, tokens = MBS * 16 * 32 * 4, MBS * 16 * 4
            assert b["tp"] == gas * STEPS * ((5 + 9) * act + 3 * tokens) + (STEPS * 4 if clip else 0), (stage, b)


def test_memory_equals_estimate_with_tp(results):
    """engine.memory() between backward and step against zl.estimate(psi, 4, stage, tp=2, replicated=R):
    the rank's slice is exactly (psi - R)/2 + R parameters; the bytes equal the formula on the padded
    slice, and the formula on Ψ itself up to the padding."""
    psi = sum(p.numel() for p in build().parameters())
    for per_rank in results:
        for (stage, gas, _), res in zip(CASES, per_rank):
            r = res["replicated"]
            assert 0 < r < psi and res["numel"] == (psi - r) // 2 + r == mesh_share(psi, 4, 2, 1, r)[0]
            exact = zl.estimate(res["padded"], 2, stage, precision="fp32")
            mem = res["mem"]
            assert (mem["params"], mem["grads"], mem["optimizer"]) == (exact.params, exact.grads, exact.optimizer)
            loose = zl.estimate(psi, 4, stage, precision="fp32", tp=2, replicated=r)
            assert 0 <= mem["total"] - loose.total <= 16 * (res["padded"] - res["numel"]), (stage, mem, loose)


def test_estimate_3d_by_hand():
    # 1000 parameters, 100 of them replicated, on 8 GPUs as TP=2 x DP=4, mixed-precision Adam, ZeRO-1:
    # a rank's slice is 900/2 + 100 = 550; 2 + 2 bytes each for params and grads, 12 x ceil(550/4)
    est = zl.estimate(1000, 8, 1, tp=2, replicated=100)
    assert (est.params, est.grads, est.optimizer, est.psi, est.n_gpus) == (1100, 1100, 12 * 138, 1000, 8)
    # PP splits the replicated parameters too (each stage its LayerNorms): 900/4 + 100/2 = 275, DP 2
    assert zl.estimate(1000, 8, 3, tp=2, pp=2, replicated=100).params == 2 * 138
    assert zl.estimate(7.5e9, 64, 1, tp=8).total == zl.estimate(7.5e9 / 8, 8, 1).total
    with pytest.raises(ValueError, match=r"n_gpus=6 is not a multiple of tp\*pp = 4"):
        zl.estimate(1000, 6, 1, tp=4)
    with pytest.raises(ValueError, match="replicated must be a whole number of parameters in 0..psi"):
        zl.estimate(1000, 8, 1, tp=2, replicated=2000)


def _checkpoint_worker(path):
    mesh = zl.mesh(dp=2, tp=2)
    engine = zl.initialize(tensor_parallel(build(), mesh), {"optimizer": ADAM, "bf16": {"enabled": True}}, mesh=mesh)
    tag = engine.save_checkpoint(path)
    engine.load_checkpoint(path)
    written = engine.save_16bit_model(path, "model.pt")
    full = engine.full_state_dict(rank0_only=True)
    if mesh.rank:
        return None
    saved = torch.load(written, weights_only=True)
    return {"files": sorted(os.listdir(tag)), "names": list(saved) == list(full),
            "bf16": all(t.dtype == torch.bfloat16 for t in saved.values()),
            "equal": all(torch.equal(saved[k], full[k].to(torch.bfloat16)) for k in full),
            "shapes": {k: tuple(t.shape) for k, t in saved.items()} == {k: tuple(t.shape) for k, t in
                                                                        build().state_dict().items()}}


def test_checkpoints_under_tp(tmp_path):
    """Checkpoints under TP are written per (tp, pp) coordinate (tests/test_mesh_checkpoint.py); the 16-bit
    model file holds the whole model, original names and full shapes, written by global rank 0."""
    out = zl.launch(_checkpoint_worker, 4, args=(str(tmp_path),), timeout=120, threads=1)[0]
    assert out == {"files": ["mesh.json", "tp0_pp0", "tp1_pp0"], "names": True, "bf16": True, "equal": True,
                   "shapes": True}, out


def _bf16_worker(cfgs):
    mesh = zl.mesh(dp=DP, tp=2)
    out = []
    for cfg in cfgs:
        model = tensor_parallel(build(), mesh)
        dims = tp_dims(model)
        engine = zl.initialize(model, cfg, mesh=mesh)
        for step in range(STEPS_BF16):
            x, y = synthetic_batch(model, DP * engine.gas * MBS, seed=7, step=step)
            for k in range(engine.gas):
                lo = (k * DP + mesh.dp_rank) * MBS
                engine.backward(vocab_parallel_cross_entropy(engine(x[lo:lo + MBS]), y[lo:lo + MBS], mesh))
                engine.step()
        out.append((gather_tp(engine.full_state_dict(), dims, mesh), engine.skipped_steps,
                    str(engine.flat.flat.dtype)))
    return out


STEPS_BF16 = 4   # test_engine_precision's STEPS: its reference runs that many


def test_mixed_precision_tp2_dp2_matches_fp32_master_reference():
    """bf16 and fp16 under TP x DP against the precision tests' single-process fp32-master reference of the
    unsplit model, with their tolerance (a fraction of how far each tensor moved)."""
    from test_engine_precision import STEPS as P_STEPS, check_case, config
    assert P_STEPS == STEPS_BF16
    # SGD (scale-sensitive, no clipping) and Adam (clipping at 0.5 over the whole model); fp16: the
    # loss scale and its overflow check agree over TP too
    cfgs = [config(stage, prec, opt) for stage, prec, opt in
            ((1, "bf16", "sgd"), (3, "bf16", "sgd"), (2, "bf16", "adam"), (1, "fp16", "sgd"), (3, "fp16", "adam"))]
    results = zl.launch(_bf16_worker, 4, args=(cfgs,), timeout=300, threads=1)
    for ci, cfg in enumerate(cfgs):
        for r in range(1, 4):
            for name, t in results[0][ci][0].items():
                assert torch.equal(results[r][ci][0][name], t), (r, cfg, name)
        check_case("gpt", cfg, DP, results[0][ci])
