"""``python -m zerolab bench --meshes`` (issue 24, item 7): ours under TP x DP and PP beside PyTorch's
DTensor TP + FSDP2 and torch.distributed.pipelining. Correctness only, never speed or memory (the
machine is shared): in one launch, ours and the peer take the same first-step loss as single-process
training of the unsplit model, and land on its parameters after one Adam step and one SGD step; a one-round bench
smoke run writes the JSON and the table with both contenders per mesh."""
from __future__ import annotations

import json

import pytest
import torch

import zerolab as zl
from zerolab.bench import mesh3d
from zerolab.bench import peers3d as p3
from zerolab.book.models import loss_fn, synthetic_batch
from zerolab.cli import main

PRESET, BATCH, STEPS = "tiny", 8, 2
SGD_LR = 0.5   # plain SGD: the parameters after a step show a wrong gradient scale, which Adam's would not


def _worker(dims, kinds, micro):
    out = {}
    stage = 3 if dims[2] == 1 else 1   # ours: ZeRO-3 under TP, ZeRO-1 under PP (the peers ignore it)
    runners = {(k, sgd): p3.KINDS[k](PRESET, dims, stage, micro, BATCH, sgd) for sgd in (0.0, SGD_LR) for k in kinds}
    for kind, r in runners.items():
        losses, after_one = [], None
        for step in range(STEPS):
            losses.append(r.step(*synthetic_batch(PRESET, BATCH, seed=0, step=step)))
            if step == 0:
                after_one = r.full_params()   # a collective: every rank
        out[kind] = {"losses": losses, "params": after_one}
        r.close()
    return out


def reference(sgd=0.0):
    """Single process, the unsplit untied model, torch.optim.Adam (or SGD): losses, the first step's
    gradients and the parameters after one step."""
    model = p3.build_model(PRESET)
    opt = p3.optimizer(model.parameters(), sgd)
    losses, grads, after_one = [], None, None
    for step in range(STEPS):
        opt.zero_grad()
        x, y = synthetic_batch(PRESET, BATCH, seed=0, step=step)
        loss = loss_fn(model(x), y)
        loss.backward()
        if step == 0:
            grads = {n: p.grad.clone() for n, p in model.named_parameters()}
        opt.step()
        if step == 0:
            after_one = {n: p.detach().clone() for n, p in model.named_parameters()}
        losses.append(loss.item())
    return losses, grads, after_one


def check_against_reference(results, kinds, dp):
    for kind in kinds:
        check_sgd(results, kind, dp)
    want_losses, grads, want = reference()
    for kind in [(k, 0.0) for k in kinds]:
        # each rank's loss is its DP rank's mean over its rows: the global loss is the mean over DP ranks
        per_dp = [results[r][kind]["losses"] for r in range(0, len(results), len(results) // dp)]
        for step in range(STEPS):
            assert sum(loss[step] for loss in per_dp) / dp == pytest.approx(want_losses[step], rel=1e-5), (kind, step)
        got = results[0][kind]["params"]
        assert sorted(got) == sorted(want), kind
        for n in want:
            # Adam's first step is lr * g / (|g| + eps): where |g| > 1e-5 it is exact to rounding; where the
            # gradient is rounding noise (a few elements) the sign may differ, bounded by one step (lr)
            firm = grads[n].abs() > 1e-5
            torch.testing.assert_close(got[n][firm], want[n][firm], rtol=0, atol=1e-6, msg=lambda m: f"{kind} {n}: {m}")
            assert float((got[n] - want[n]).abs().max()) <= 1.01 * p3.LR, (kind, n)


def check_sgd(results, kind, dp):
    want_losses, _, want = reference(SGD_LR)
    per_dp = [results[r][kind, SGD_LR]["losses"] for r in range(0, len(results), len(results) // dp)]
    assert sum(loss[1] for loss in per_dp) / dp == pytest.approx(want_losses[1], rel=1e-5), kind
    got = results[0][kind, SGD_LR]["params"]
    for n in want:
        torch.testing.assert_close(got[n], want[n], rtol=1e-4, atol=1e-6, msg=lambda m: f"{kind} SGD {n}: {m}")


@pytest.mark.timeout(120)
def test_tp2_dp2_ours_and_dtensor_fsdp2_match_single_process():
    kinds = ["ours", "torch_tp"]
    results = zl.launch(_worker, 4, args=((2, 2, 1), kinds, 1), timeout=120, threads=1)
    check_against_reference(results, kinds, dp=2)
    assert results[0]["ours", 0.0]["losses"] == pytest.approx(results[0]["torch_tp", 0.0]["losses"], rel=1e-6)


@pytest.mark.timeout(120)
@pytest.mark.parametrize("dp", [1, pytest.param(2, marks=pytest.mark.slow)])   # dp 2: the peer under FSDP2
def test_pp2_ours_and_torch_pipelining_match_single_process(dp):
    kinds = ["ours", "torch_pp"]
    results = zl.launch(_worker, 2 * dp, args=((dp, 1, 2), kinds, 4 // dp), timeout=120, threads=1)
    check_against_reference(results, kinds, dp=dp)
    # torch's schedule reports each DP replica's loss (every rank: its replica's last stage); ours the mean
    # over the DP group, as engine.train_batch promises (the same on every rank)
    peer = [sum(vals) / dp for vals in zip(*(results[d * 2]["torch_pp", 0.0]["losses"] for d in range(dp)))]
    for r in results:
        assert r["ours", 0.0]["losses"] == pytest.approx(peer, rel=1e-6)


@pytest.mark.timeout(180)
def test_bench_meshes_smoke(tmp_path, capsys):
    """One round of one step per mesh, no memory pass: the file and the table, both contenders, the same
    first loss, ratios from the medians; nothing about speed is asserted."""
    assert main(["bench", "--meshes", "2x2x1,1x1x2", "--model", PRESET, "--repeats", "1", "--steps", "1",
                 "--warmup", "1", "--no-memory", "--out", str(tmp_path)]) == 0
    text = capsys.readouterr().out
    with open(tmp_path / "bench3d.json") as f:
        result = json.load(f)
    assert result["schema"] == mesh3d.SCHEMA and [w["mesh"] for w in result["runs"]] == ["2x2x1", "1x1x2"]
    for w, peer in zip(result["runs"], ("torch_tp", "torch_pp")):
        rows = {r["kind"]: r for r in w["contenders"]}
        assert sorted(rows) == sorted(["ours", peer]), w.get("error")
        assert rows["ours"]["losses"][0] == pytest.approx(rows[peer]["losses"][0], rel=1e-6)
        assert rows[peer]["max_abs_diff"] <= 1.01 * p3.LR * (1 + 1)   # 2 steps (warm-up + timed): <= 2 lr
        q = w["ratios"][0]
        assert q["ratio"] == pytest.approx(rows["ours"]["median_ms"] / rows[peer]["median_ms"])
        assert rows["ours"]["bytes_per_step"]["tp" if peer == "torch_tp" else "pp"] > 0
        assert f"ours / {q['peer']}: step time {q['ratio']:.2f}x" in text
    assert (tmp_path / "bench3d.md").read_text() == mesh3d.markdown(result)


def test_mesh_arguments_and_contenders():
    assert p3.parse_mesh("2x2x1") == (2, 2, 1)
    with pytest.raises(ValueError, match="DPxTPxPP"):
        p3.parse_mesh("2x2")
    assert main(["bench", "--meshes", "2x0x1", "--out", ""]) == 2
    assert main(["bench", "--meshes", "2x2x1", "--world-sizes", "4", "--out", ""]) == 2
    assert [k for k, _, _ in mesh3d.contenders((2, 2, 1))[0]] == ["ours", "torch_tp"]
    assert [k for k, _, _ in mesh3d.contenders((1, 1, 2))[0]] == ["ours", "torch_pp"]
    assert [(k, s) for k, s, _ in mesh3d.contenders((2, 1, 2))[0]] == [("ours", 1), ("torch_pp", 3)]
    cont, note = mesh3d.contenders((1, 2, 2))
    assert [k for k, _, _ in cont] == ["ours"] and "tp = 1 only" in note
