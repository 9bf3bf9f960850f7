"""The scripts in examples/deepspeed/ run unchanged under DeepSpeed and under ``zerolab.deepspeed`` (issue 26).

Each script selects its ``deepspeed`` with one line (``DS_LIB``). Here each runs
as a script on 2 gloo ranks (``torchrun``) under zerolab and, where DeepSpeed
is installed, under DeepSpeed 0.19 on CPU; the two must agree on every loss,
every final parameter and every reported gradient norm within float tolerance.
Without DeepSpeed, zerolab's runs are checked against single-process
training instead (the pipeline example), and the partition rules against
tables worked out by hand from DeepSpeed's definitions.
"""
from __future__ import annotations

import os
import socket
import sys
from pathlib import Path

import pytest
import torch

from zerolab.bench.peers import deepspeed_available
import zerolab as zl
import script_util
from zerolab.deepspeed.pipe import balanced_parts, partition, uniform_parts

ROOT = Path(__file__).resolve().parents[1]
EXAMPLES = ROOT / "examples" / "deepspeed"
HAVE_DEEPSPEED = deepspeed_available()  # the real package, not a folder named deepspeed
SCRIPTS = ["train_mlp", "train_pipeline", "train_zero3"]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run(script: str, lib: str, tmp_path, world: int = 2) -> list[dict]:
    """``DS_LIB=lib torchrun --nproc-per-node world examples/deepspeed/script.py --out ...``: each rank's result."""
    out = tmp_path / f"{script}-{lib}"
    env = {**os.environ, "DS_LIB": lib, "DS_ACCELERATOR": "cpu", "OMP_NUM_THREADS": "1",
           "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(world), "--master-port",
           str(_free_port()), str(ROOT / "tests" / "ds_example_runner.py"), str(EXAMPLES / f"{script}.py"),
           "--out", str(out)]
    r = script_util.run_script(cmd, env, timeout=400, cwd=tmp_path)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-4000:]
    return [torch.load(f"{out}.rank{rank}", weights_only=False) for rank in range(world)]


def assert_same_run(ours: list[dict], theirs: list[dict], atol: float = 1e-5):
    for a, b in zip(ours, theirs):
        worst = max(abs(x - y) for x, y in zip(a["losses"], b["losses"]))
        assert len(a["losses"]) == len(b["losses"]) and worst <= atol, f"rank {a['rank']}: losses differ by {worst:.3g}"
        assert a["params"].keys() == b["params"].keys(), (sorted(a["params"]), sorted(b["params"]))
        worst = max((a["params"][n] - b["params"][n]).abs().max().item() for n in a["params"])
        assert worst <= atol, f"rank {a['rank']}: parameters differ by {worst:.3g}"
        for key in ("grad_norms", "grad_norm"):
            if key in a:
                assert a[key] == (b[key] if b[key] is None else pytest.approx(b[key], rel=1e-5)), key
        for key in ("global_steps", "global_samples", "lr", "parts", "optimizer_name"):
            if key in a:
                assert a[key] == b[key], key
        if "eval_loss" in a:
            assert a["eval_loss"] == pytest.approx(b["eval_loss"], abs=atol)


@pytest.mark.slow
@pytest.mark.skipif(not HAVE_DEEPSPEED, reason="DeepSpeed is not installed")
@pytest.mark.parametrize("script", SCRIPTS)
def test_example_runs_the_same_under_deepspeed_and_zerolab(script, tmp_path):
    assert_same_run(run(script, "zerolab", tmp_path), run(script, "deepspeed", tmp_path))


@pytest.mark.slow
@pytest.mark.skipif(not HAVE_DEEPSPEED, reason="DeepSpeed is not installed")
def test_pipeline_on_4_ranks_agrees_by_coordinates(tmp_path):
    """dp=2 x pp=2: the same (stage, DP rank) trains the same way; the global ranks differ (zerolab's
    mesh: rank = dp_rank x pp + stage; DeepSpeed's topology: rank = stage x dp + dp_rank)."""
    ours, theirs = run("train_pipeline", "zerolab", tmp_path, world=4), run("train_pipeline", "deepspeed", tmp_path, world=4)
    for dp in range(2):
        for stage in range(2):
            assert_same_run([ours[dp * 2 + stage]], [theirs[stage * 2 + dp]])


# ---------------------------------------------------------------- zerolab alone (always runs)
def _pipeline_rank():
    sys.path.insert(0, str(EXAMPLES))
    import train_pipeline
    return train_pipeline.main([])


def pipeline_reference(steps: int = 6, dp: int = 1):
    """The pipeline example as plain single-process training: the same layers and seed, the
    loader's order (no shuffling; DP rank r reads samples r, r + dp, ...), every DP rank's 4
    micro-batches averaged per AdamW step."""
    sys.path.insert(0, str(EXAMPLES))
    import train_pipeline as ex
    torch.manual_seed(0)
    model = torch.nn.Sequential(*ex.make_layers())
    cfg = ex.CONFIG
    opt = torch.optim.AdamW(model.parameters(), lr=cfg["optimizer"]["params"]["lr"], weight_decay=0.0)
    x, y = ex.dataset().tensors
    mbs, gas = cfg["train_micro_batch_size_per_gpu"], cfg["gradient_accumulation_steps"]
    losses = []
    for step in range(steps):
        opt.zero_grad()
        loss = 0
        for r in range(dp):
            xr, yr = x[r::dp], y[r::dp]
            per_epoch = len(xr) // mbs   # the loader restarts when it runs out (RepeatingLoader)
            for k in range(step * gas, (step + 1) * gas):
                rows = slice((k % per_epoch) * mbs, (k % per_epoch + 1) * mbs)
                loss = loss + torch.nn.functional.mse_loss(model(xr[rows]), yr[rows]) / (gas * dp)
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses, {n: p.detach() for n, p in model.named_parameters()}


@pytest.mark.slow
def test_pipeline_example_trains_like_one_process():
    results = zl.launch(_pipeline_rank, world_size=2, timeout=180, threads=1)
    want_losses, want = pipeline_reference()
    assert results[0]["parts"] == results[1]["parts"] == [0, 2, 6]   # "parameters": the 16x64 layer alone
    for r in results:
        assert r["losses"] == pytest.approx(want_losses, abs=1e-5)
        assert r["global_samples"] == 6 * 16 and r["grad_norm"] is None   # ZeRO-0 fp32: None, as DeepSpeed
    got = {**results[0]["params"], **results[1]["params"]}
    assert sorted(got) == sorted(want)   # each stage holds its layers under their index in the list
    for n in want:
        torch.testing.assert_close(got[n], want[n], rtol=1e-5, atol=1e-6)


@pytest.mark.slow
def test_pipeline_example_on_dp2_pp2_trains_like_one_process():
    """4 ranks: 2 stages x 2 data-parallel ranks; the loss train_batch returns is the mean over both."""
    results = zl.launch(_pipeline_rank, world_size=4, timeout=300, threads=1)
    want_losses, want = pipeline_reference(dp=2)
    for r in results:
        assert r["losses"] == pytest.approx(want_losses, abs=1e-5)
        assert r["global_samples"] == 6 * 32
    assert results[0]["eval_loss"] == pytest.approx(results[3]["eval_loss"], abs=1e-7)
    got = {**results[0]["params"], **results[1]["params"]}   # zerolab's mesh: ranks 0, 1 = stages 0, 1 of DP rank 0
    assert sorted(got) == sorted(want)
    for n in want:
        torch.testing.assert_close(got[n], want[n], rtol=1e-5, atol=1e-6)
    for a, b in ((0, 2), (1, 3)):   # the other DP rank holds the same stage
        assert all(torch.equal(results[a]["params"][n], results[b]["params"][n]) for n in results[a]["params"])


@pytest.mark.slow
def test_the_zerolab_half_runs_as_a_script(tmp_path):
    """No DeepSpeed needed: the ZeRO-3 example under torchrun, every rank the same model."""
    results = run("train_zero3", "zerolab", tmp_path)
    assert results[0]["global_steps"] == 8
    for n in results[0]["params"]:
        assert torch.equal(results[0]["params"][n], results[1]["params"][n])
    assert all(v > 0 for v in results[0]["grad_norms"])


# ---------------------------------------------------------------- DeepSpeed's partition rules
def test_partition_methods_by_hand():
    assert uniform_parts(6, 4) == [0, 2, 4, 5, 6]   # the first 6 % 4 stages one layer more
    assert uniform_parts(2, 3) == [0, 1, 2, 2]      # fewer layers than stages: empty last stages
    # min (heaviest - lightest): [10 | 1 1 1 1 5] costs 10 - 9 = 1; any other cut is worse
    assert balanced_parts([10, 1, 1, 1, 1, 5], 2) == [0, 1, 6]
    assert balanced_parts([1, 1, 1, 1], 2) == [0, 2, 4]
    layers = [torch.nn.Linear(16, 64), torch.nn.Tanh(), torch.nn.Linear(64, 8), torch.nn.Tanh(),
              torch.nn.Linear(8, 8), torch.nn.Linear(8, 1)]
    assert partition(layers, 2, "parameters") == [0, 2, 6]   # 1088 | 520 + 72 + 9: closest to even
    assert partition(layers, 2, "uniform") == [0, 3, 6]
    # one Tanh per stage: cutting after layer 1 or after layer 2 ties; DeepSpeed keeps the last cut found
    assert partition(layers, 2, "type:tanh") == [0, 3, 6]
    with pytest.raises(RuntimeError, match="'conv' found no valid layers"):
        partition(layers, 2, "type:conv")
    with pytest.raises(NotImplementedError, match="profile"):
        partition(layers, 2, "profile")


@pytest.mark.skipif(not HAVE_DEEPSPEED, reason="DeepSpeed is not installed")
def test_partition_functions_equal_deepspeeds():
    import random
    from deepspeed.runtime.utils import partition_balanced, partition_uniform
    rng = random.Random(0)
    for _ in range(300):
        n, p = rng.randint(1, 9), rng.randint(1, 5)
        w = [rng.choice([0, 1, 2, 5, 100, rng.randint(0, 1000)]) for _ in range(n)]
        assert balanced_parts(w, p) == partition_balanced(w, p), (w, p)
        assert uniform_parts(n, p) == partition_uniform(n, p), (n, p)


# ---------------------------------------------------------------- PipelineModule's layer kinds and refusals (2 ranks)
def _layer_kinds():
    import zerolab.deepspeed as deepspeed
    from zerolab.deepspeed.pipe import LayerSpec, PipelineModule, TiedLayerSpec
    out = {}
    torch.manual_seed(0)
    built = []

    class Counted(torch.nn.Linear):
        def __init__(self, *a, **k):
            super().__init__(*a, **k)
            built.append(a)

    layers = [TiedLayerSpec("emb", torch.nn.Linear, 4, 4), LayerSpec(Counted, 4, 6), lambda x: x.relu(),
              LayerSpec(Counted, 6, 6), LayerSpec(Counted, 6, 1)]
    model = PipelineModule(layers, num_stages=2, loss_fn=torch.nn.MSELoss(), partition_method="uniform")
    out["names"] = sorted(n for n, _ in model.named_parameters())
    out["built"] = list(built)   # "uniform" builds nothing to count: only this stage's LayerSpecs
    out["parts"] = model.parts
    engine, *_ = deepspeed.initialize(model=model, config={"train_micro_batch_size_per_gpu": 2,
                                                            "gradient_accumulation_steps": 1,   # fewer than stages
                                                            "optimizer": {"type": "SGD", "params": {"lr": 0.1}}})
    g = torch.Generator().manual_seed(1)
    data = [(torch.randn(2, 4, generator=g), torch.randn(2, 1, generator=g)) for _ in range(3)]
    out["loss"] = engine.train_batch(iter(data)).item()
    out["eval"], out["logits"] = engine.eval_batch(iter(data), return_logits=True)
    out["eval"] = out["eval"].item()
    out["logits"] = None if out["logits"] is None else tuple(out["logits"].shape)
    errors = []
    for call in (lambda: engine(data[0][0]), lambda: PipelineModule(layers, num_stages=3),
                 lambda: PipelineModule(layers, num_stages=2, topology=object()),
                 lambda: PipelineModule(layers, num_stages=2, seed_layers=True),
                 lambda: deepspeed.initialize(model=PipelineModule(layers, num_stages=2), config={
                     "train_micro_batch_size_per_gpu": 2, "optimizer": {"type": "SGD", "params": {"lr": 0.1}},
                     "zero_optimization": {"stage": 2}})):
        try:
            call()
            errors.append(None)
        except Exception as e:   # noqa: BLE001 - the message is what is checked
            errors.append(f"{type(e).__name__}: {e}")
    out["errors"] = errors
    return out


@pytest.mark.slow
def test_layer_kinds_and_refusals():
    r0, r1 = zl.launch(_layer_kinds, world_size=2, timeout=180, threads=1)
    assert r0["parts"] == [0, 3, 5]                       # uniform: 5 layers -> 3 + 2
    assert r0["names"] == ["1.bias", "1.weight", "tied_modules.emb.bias", "tied_modules.emb.weight"]
    assert r1["names"] == ["3.bias", "3.weight", "4.bias", "4.weight"]
    assert r0["built"] == [(4, 6)] and r1["built"] == [(6, 6), (6, 1)]
    assert r0["loss"] == r1["loss"] > 0 and r0["eval"] == r1["eval"] > 0
    assert r0["logits"] is None and r1["logits"] == (2, 1)   # the last stage's outputs
    e = r0["errors"]
    assert "Only train_batch() is accessible in pipeline mode" in e[0]
    assert "num_stages=3" in e[1] and "dividing the world size (2)" in e[1]
    assert "topology=" in e[2]
    assert "seed_layers=True" in e[3]
    assert "ZeRO-2 with pipeline parallelism" in e[4]


def _tied_worker():
    """A TiedLayerSpec on the first and the last stage: one Linear used twice, as DeepSpeed ties it."""
    import zerolab.deepspeed as deepspeed
    from zerolab.deepspeed.pipe import PipelineModule, TiedLayerSpec
    torch.manual_seed(0)   # both stages build their copy from the same state; the first's is broadcast anyway
    tie = dict(tied_weight_attr=["weight", "bias"])   # the whole Linear (DeepSpeed's default ties the weight only)
    model = PipelineModule([TiedLayerSpec("t", torch.nn.Linear, 4, 4, **tie), torch.nn.Tanh(),
                            TiedLayerSpec("t", torch.nn.Linear, 4, 4, **tie)], num_stages=2, loss_fn=torch.nn.MSELoss(),
                           partition_method="uniform")
    engine, *_ = deepspeed.initialize(model=model, config={"train_micro_batch_size_per_gpu": 2,
                                                           "gradient_accumulation_steps": 2,
                                                           "optimizer": {"type": "SGD", "params": {"lr": 0.2}}})
    losses = [engine.train_batch(iter(_tied_data(step))).item() for step in range(3)]
    return {"tied": model.tied, "losses": losses, "params": {n: p.detach().clone() for n, p in model.named_parameters()}}


def _tied_data(step):
    g = torch.Generator().manual_seed(10 + step)
    return [(torch.randn(2, 4, generator=g), torch.randn(2, 4, generator=g)) for _ in range(2)]


@pytest.mark.slow
def test_tied_layer_on_first_and_last_stage_trains_like_one_process():
    r0, r1 = zl.launch(_tied_worker, world_size=2, timeout=180, threads=1)
    torch.manual_seed(0)
    lin = torch.nn.Linear(4, 4)
    opt = torch.optim.SGD(lin.parameters(), lr=0.2)
    want = []
    for step in range(3):
        opt.zero_grad()
        loss = sum(torch.nn.functional.mse_loss(lin(torch.tanh(lin(x))), y) for x, y in _tied_data(step)) / 2
        loss.backward()
        opt.step()
        want.append(loss.item())
    assert r0["tied"] == r1["tied"] == ["tied_modules.t.weight", "tied_modules.t.bias"]
    assert r0["losses"] == pytest.approx(want, abs=1e-6) and r1["losses"] == r0["losses"]
    torch.testing.assert_close(r0["params"]["tied_modules.t.weight"], lin.weight.detach())
    torch.testing.assert_close(r1["params"]["tied_modules.t.weight"], lin.weight.detach())
    torch.testing.assert_close(r1["params"]["tied_modules.t.bias"], lin.bias.detach())
