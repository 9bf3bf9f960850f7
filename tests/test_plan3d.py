"""Choosing a mesh (issue 24, item 9): ``zl.choose_stage(..., tp=, pp=)`` proposes (dp, tp, pp, stage, offload)
by the rule — memory first, then the full step of ``theory.time3d`` — and ``zl.step_time_3d`` gives the time
model's TFLOP/s per GPU for chapter 10's 175B case. Pure arithmetic."""
from __future__ import annotations

import pytest

import zerolab as zl
from zerolab.theory import plan as plan_mod
from zerolab.theory.time3d import H800, mesh_links

GB = 10**9
CHOICES = dict(tp=(1, 2, 4, 8), pp=(1, 2, 4, 8))


def seventy_b(**kw):
    """Llama-2-70B's shape (80 layers, hidden 8192, 64 heads) at 4096 tokens, 1 sequence per micro-batch,
    1024 sequences per step, on 8 DGX H100 nodes."""
    act = zl.activation_memory(80, 8192, 64, 4096, 1, checkpointing=True, flash_attention=True)
    kw = {"activations": act, **CHOICES, **kw}
    return zl.choose_stage(70e9, 64, 80 * GB, hardware="dgx-h100", grad_accum=16, layers=80, hidden=8192,
                           seq=4096, micro_batch=1, **kw)


def test_seventy_b_on_64_gpus_proposes_the_best_mesh_by_the_rule():
    p = seventy_b()
    assert (p.dp, p.tp, p.pp, p.stage, p.choice.offload_optimizer) == (8, 2, 4, 1, "none"), p.why
    assert p.name == "TP=2 x PP=4 x DP=8, ZeRO-1" and "shortest step" in p.why
    rows = p.candidates
    assert all(c.dp * c.tp * c.pp == 64 and c.tp <= 8 for c in rows)
    assert all(c.stage <= 1 for c in rows if c.pp > 1)                # DeepSpeed: no ZeRO-2/3 with PP
    assert {(c.tp, c.pp) for c in rows} == {(t, q) for t in CHOICES["tp"] for q in CHOICES["pp"]}
    # memory: the model states of the rank's slice, plus the activations split by tp (module docstring)
    act = zl.activation_memory(80, 8192, 64, 4096, 1, checkpointing=True, flash_attention=True)
    for c in rows:
        est = zl.estimate(70e9, 64, c.stage, offload_optimizer=c.offload_optimizer, offload_param=c.offload_param,
                          tp=c.tp, pp=c.pp)
        assert c.device_bytes == est.total + act / c.tp and c.fits == (c.device_bytes <= 0.9 * 80 * GB)
    own = seventy_b(activations=lambda tp, pp: 1000 * tp + pp)
    assert {c.device_bytes - zl.estimate(70e9, 64, c.stage, tp=c.tp, pp=c.pp).total
            for c in own.candidates if c.offload_optimizer == "none"} == {1000 * t + q for t in (1, 2, 4, 8)
                                                                         for q in (1, 2, 4, 8)}
    # the rule by hand: no offload fits, so only that level; the least step, ties (1 %) to less tp*pp
    level = [c for c in rows if c.fits and c.offload_optimizer == "none"]
    best = min(c.step_seconds for c in level)
    assert p.choice.step_seconds <= best * 1.01
    assert not [c for c in level if c.step_seconds <= best * 1.01 and c.tp * c.pp < 8]
    # ZeRO-3 without model parallelism fits too, but gathers 70B three times per micro-batch over the NICs
    z3 = next(c for c in level if (c.tp, c.pp, c.stage) == (1, 1, 3))
    assert z3.axes["dp"] > 10 and z3.step_seconds > p.choice.step_seconds
    # one candidate by hand: TP=1, PP=8, DP=8: m = 1024/8 = 128 micro-batches; compute 6·Ψ/8 FLOPs per token
    # at 450 TFLOP/s; the bubble 7 of (m + 7) micro-batch slots; DP ZeRO-1 of the 2·Ψ/8-byte slice over 8
    # ranks, one ring per GPU of the node: 400 GB/s of NICs / 8
    c = next(c for c in level if (c.tp, c.pp, c.stage) == (1, 8, 1))
    compute = 6 * 70e9 / 8 * 128 * 4096 / 450e12
    t = {**c.times, **c.axes}
    assert t["compute"] == pytest.approx(compute) and t["tp"] == 0 and t["comm"] == t["tp"] + t["pp"] + t["dp"]
    assert t["bubble"] == pytest.approx(7 * (compute + t["pp"]) / 128)
    assert t["dp"] == pytest.approx(2 * (2 * 70e9 / 8) * 7 / 8 / 50e9, rel=1e-3)
    assert t["pp"] == pytest.approx(128 * 2 * (4096 * 8192 * 2 / 450e9 + 3e-6))   # PP inside a node: NVLink


def test_planted_time_bugs_change_the_answer(monkeypatch):
    """The two terms that decide it: without the bubble PP=8 (no TP traffic) wins; with TP's all-reduces on
    a GPU's share of the NICs instead of NVLink, TP loses too."""
    from zerolab.theory import time3d
    real = time3d.mesh_step_times
    monkeypatch.setattr(plan_mod, "mesh_step_times", lambda *a, **k: {**real(*a, **k), "bubble": 0.0})
    assert (seventy_b().tp, seventy_b().pp) == (1, 8)
    monkeypatch.setattr(plan_mod, "mesh_step_times", real)
    links = time3d.mesh_links
    monkeypatch.setattr(time3d, "mesh_links", lambda node, n, tp, pp: {**links(node, n, tp, pp),
                                                                        "tp": links(node, 64, 8, 8)["pp"]})
    assert seventy_b().tp == 1


def test_small_model_keeps_plain_data_parallelism():
    act = zl.activation_memory(24, 2048, 16, 2048, 4, checkpointing=True, flash_attention=True)
    p = zl.choose_stage(1.3e9, 8, 80 * GB, act, hardware="dgx-h100", grad_accum=8, layers=24, hidden=2048, seq=2048,
                        micro_batch=4, tp=(1, 2, 4, 8), pp=(1, 2, 4))
    assert (p.dp, p.tp, p.pp, p.name) == (8, 1, 1, "DDP")
    # without choices: today's plan, with its mesh
    q = zl.choose_stage(1.3e9, 8, 80 * GB, act, hardware="dgx-h100", grad_accum=8)
    assert (q.dp, q.tp, q.pp, q.name) == (8, 1, 1, "DDP") and q.why.startswith("DDP")


def test_mesh_errors_name_the_problem():
    with pytest.raises(ValueError, match="needs layers=, hidden=, seq=, micro_batch="):
        zl.choose_stage(7e9, 8, 80 * GB, hardware="dgx-h100", tp=(1, 2))
    with pytest.raises(ValueError, match="needs node= or hardware="):
        zl.choose_stage(7e9, 8, 80 * GB, link="nvlink4", tp=2, layers=32, hidden=4096, seq=2048, micro_batch=1)
    with pytest.raises(ValueError, match="tp must be an integer >= 1 or a tuple"):
        zl.choose_stage(7e9, 8, 80 * GB, hardware="dgx-h100", tp=0)
    with pytest.raises(ValueError, match=r"no mesh of tp in \(16,\)"):
        zl.choose_stage(7e9, 32, 80 * GB, hardware="dgx-h100", tp=16, layers=32, hidden=4096, seq=2048,
                        micro_batch=1)
    with pytest.raises(ValueError, match="tp=16 is larger than the GPUs per node"):
        mesh_links(H800.node, 32, 16, 1)


def test_175b_case_by_hand():
    """GPT-3 175B, TP=8 x PP=4 x DP=8 on 32 H800 nodes, ZeRO-1, optimizer on NVMe; m = 64 micro-batches of 1."""
    r = zl.step_time_3d(micro_batches=64)
    compute = 6 * 175e9 / 32 * 64 * 2048 / 450e12                       # 9.56 s
    a = 2048 * 12288 * 2                                                # one activation, bytes
    ar = 2 * a * 7 / 8 / 200e9 + 14 * 3e-6                              # one all-reduce over 8 on NVLink (H800)
    loss = 3 * (2 * 2048 * 4 * 7 / 8 / 200e9 + 14 * 3e-6)
    tp = 64 * ((2 * 24 + 2 * 24 + 1) * ar + loss)                       # the last stage: 24 blocks + head + loss
    pp = 64 * (a / 50e9 + 5e-6)                                        # its gradient back, over its NIC
    assert r["compute"] == pytest.approx(compute) and r["tp"] == pytest.approx(tp) and r["pp"] == pytest.approx(pp)
    assert r["bubble"] == pytest.approx(3 * (compute + tp + pp) / 64) and r["bubble_fraction"] == 3 / 67
    assert r["dp"] == pytest.approx(2 * (2 * 175e9 / 32) * 7 / 8 / 50e9, rel=1e-3)   # one NIC per DP ring
    shard = 175e9 / 32 / 8
    assert r["optimizer"] == pytest.approx(shard / (300e9 / 30 / 8))                 # CPU Adam, host memory
    assert r["offload"] == pytest.approx(4 * shard / 50e9 + 24 * shard / (8 * 6e9 / 8))
    assert r["step"] == pytest.approx(sum(v for k, v in r.items() if k not in ("step", "tflops_per_gpu", "mfu",
                                                                                  "bubble_fraction")))
    assert r["tflops_per_gpu"] == pytest.approx(6 * 175e9 * 8 * 64 * 2048 / 256 / r["step"] / 1e12)
    assert r["mfu"] == pytest.approx(r["tflops_per_gpu"] / 989)
    # more micro-batches: a smaller bubble share, more TFLOP/s; the optimizer's NVMe time is paid once per step
    assert zl.step_time_3d(micro_batches=256)["tflops_per_gpu"] > r["tflops_per_gpu"]
