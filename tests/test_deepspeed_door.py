"""An unchanged DeepSpeed script under ``zerolab-deepspeed`` (``zerolab/deepspeed/launch.py``, ``hook.py``).

The same file, ``tests/ds_door_script.py`` (``import deepspeed``), runs on 2 gloo ranks under zerolab's
launcher and, where DeepSpeed 0.19.8 is installed, under torchrun with real DeepSpeed on CPU: losses, each
step's learning rates and gradient norms, and final parameters agree within fp32 tolerance. The zerolab half
always runs: the alias stays in the children, every parameter group follows the config's schedule,
client schedulers drive the learning rate, and ``loss.backward()`` then ``engine.step()`` equals
``engine.backward(loss)`` at stages 0-3.
"""
from __future__ import annotations

import importlib.util
import os
import socket
import subprocess
import sys
import warnings
from pathlib import Path

import pytest
import torch

import script_util
import zerolab as zl
import zerolab.deepspeed as zds
from zerolab.bench.peers import deepspeed_available
from zerolab.deepspeed import launch
from zerolab.deepspeed.hook import installed

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "tests" / "ds_door_script.py"
HAVE_DEEPSPEED = deepspeed_available()
SCHED = "groups_sched,client_lambda,callable_linear"
BACKWARD = ",".join(f"{k}_s{s}" for s in range(4) for k in ("backward", "engine_backward"))
CIFAR = ",".join(f"cifar_s{s}_{p}" for s in range(4) for p in ("fp32", "bf16"))


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run(lib: str, cases: str, tmp_path, world: int = 2) -> list[dict]:
    """``zerolab-deepspeed --num_gpus 2 ds_door_script.py`` (lib "zerolab") or torchrun + DeepSpeed."""
    out = tmp_path / lib
    env = {**os.environ, "DS_ACCELERATOR": "cpu", "OMP_NUM_THREADS": "1",
           "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    head = [sys.executable, "-m", "zerolab.deepspeed", "--num_gpus", str(world), "--master_port", str(_port())] \
        if lib == "zerolab" else [sys.executable, "-m", "torch.distributed.run", f"--nproc-per-node={world}",
                                  f"--master-port={_port()}"]
    r = script_util.run_script([*head, str(SCRIPT), "--out", str(out), "--cases", cases], env, timeout=900,
                               cwd=tmp_path)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-4000:]
    return [torch.load(f"{out}.rank{k}", weights_only=False) for k in range(world)]


def close(a, b, atol):
    """Equal lengths, each pair within ``atol`` (relative above 1); None only against None (fp32 ZeRO-0 reports
    no gradient norm, in both libraries)."""
    return len(a) == len(b) and all((x is None and y is None) or (x is not None and y is not None and
                                                                 abs(x - y) <= atol * max(1.0, abs(y)))
                                    for x, y in zip(a, b))


def assert_same(ours: dict, theirs: dict, atol: float, name: str):
    """Losses within ``atol`` and gradient norms within 5 x ``atol`` (relative), learning rates equal (1e-9);
    parameters within 1.5e-3:
    after 3 Adam steps of lr 0.01-0.02 an element whose gradient is near zero moves by lr * g / (|g| + eps),
    either sign, so the last-bit differences of the two sums reach the parameters (measured: <= 1.0e-3)."""
    assert close(ours["losses"], theirs["losses"], atol), (name, ours["losses"], theirs["losses"])
    assert close(sum(ours["lrs"], []), sum(theirs["lrs"], []), 1e-9), (name, ours["lrs"], theirs["lrs"])
    assert close(ours["norms"], theirs["norms"], 5 * atol), (name, ours["norms"], theirs["norms"])
    worst = max((ours["final"][k] - theirs["final"][k]).abs().max().item() for k in theirs["final"])
    assert worst <= 1.5e-3, (name, worst)


# ---------------------------------------------------------------- zerolab alone (always runs)
@pytest.fixture(scope="module")
def zerolab_run(tmp_path_factory):
    return run("zerolab", ",".join([SCHED, BACKWARD, "cifar_s2_fp32,cifar_s3_bf16"]),
               tmp_path_factory.mktemp("door"))


def test_the_launcher_resolves_deepspeed_to_zerolab_in_the_ranks_only(zerolab_run):
    r = zerolab_run[0]
    assert r["version"] == r["metadata_version"] == "0.19.8+zerolab" == zds.__version__
    assert r["spec_origin"] == str(ROOT / "zerolab" / "deepspeed" / "__init__.py")
    assert r["accelerator"] == {"device_name": "cpu", "current_device_name": "cpu", "backend": "gloo",
                                "bf16": True, "current_device": "0"}
    assert not installed()   # this process: no alias, also after building the ranks' command
    launch.command(launch.parser().parse_args(["--num_gpus", "2", "x.py"]))
    assert launch.child_env({})["ZEROLAB_DEEPSPEED_ALIAS"] == "1" and "ZEROLAB_DEEPSPEED_ALIAS" not in os.environ
    assert not installed() and "deepspeed" not in sys.modules or "zerolab" not in str(sys.modules.get("deepspeed"))
    spec = importlib.util.find_spec("deepspeed")
    assert spec is None or "zerolab" not in (spec.origin or "")
    # `python script.py`: the installed deepspeed (or none), never zerolab's
    probe = "import importlib.util as u; s = u.find_spec('deepspeed'); print(s and s.origin)"
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, check=True).stdout
    assert "zerolab" not in out


def test_every_group_runs_at_the_configs_schedule_as_deepspeed(zerolab_run):
    """WarmupLR (linear, 0 -> 0.01 over 4 steps) with groups at lr 0.01 and 0.005: DeepSpeed writes the
    schedule's lr into every group (before: zerolab scaled the second to half of it)."""
    for r in zerolab_run:
        assert r["groups_sched"]["lrs"] == [[0.0, 0.0], [0.0, 0.0], [0.0025, 0.0025]]


def test_client_schedulers_drive_the_learning_rate(zerolab_run):
    r = zerolab_run[0]
    flat = lambda lrs: [x for step in lrs for x in step]  # noqa: E731
    assert flat(r["client_lambda"]["lrs"]) == pytest.approx([0.0025, 0.00125, 0.005, 0.0025, 0.0075, 0.00375])
    assert flat(r["callable_linear"]["lrs"]) == pytest.approx([0.0, 0.01, 0.02])   # linear warmup over 2 steps
    # lr 0 at the first step: the parameters move only from the second step on (not stepped at the config's lr)
    assert r["groups_sched"]["losses"][:2] == r["callable_linear"]["losses"][:2]


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_loss_backward_then_step_equals_engine_backward(zerolab_run, stage):
    for r in zerolab_run:
        a, b = r[f"backward_s{stage}"], r[f"engine_backward_s{stage}"]
        assert close(a["losses"], b["losses"], 1e-6) and close(a["norms"], b["norms"], 1e-6), (a, b)
        assert max((a["final"][k] - b["final"][k]).abs().max().item() for k in a["final"]) <= 1e-6


def test_launcher_arguments():
    p = launch.parser()
    assert launch.num_ranks(p.parse_args(["--num_gpus", "3", "s.py"]), 0) == 3
    assert launch.num_ranks(p.parse_args(["--include", "localhost:0,1", "s.py"]), 0) == 2
    assert launch.num_ranks(p.parse_args(["--num_gpus", "4", "--exclude", "localhost:1", "s.py"]), 0) == 3
    assert launch.num_ranks(p.parse_args(["s.py"]), 0) == 1
    for bad, match in ((["--num_nodes", "2"], "one machine"), (["--include", "worker-1:0"], "localhost"),
                       (["--launcher", "slurm"], "torchrun"), (["--no_python"], "no_python")):
        with pytest.raises(SystemExit, match=match):
            launch.num_ranks(p.parse_args([*bad, "s.py"]), 0)
    cmd = launch.command(p.parse_args(["--num_gpus", "2", "--master_port", "29999", "s.py", "--x", "1"]))
    assert cmd[-3:] == ["s.py", "--x", "1"] and "--nproc-per-node=2" in cmd and "--master-port=29999" in cmd


def test_accelerator_moe_logger_and_refusals():
    acc = zds.get_accelerator()
    assert acc is zds.accelerator.get_accelerator() and acc.device_name() == "cpu"
    assert acc.communication_backend_name() == "gloo" and acc.is_bf16_supported()
    assert acc.total_memory() > acc.available_memory() > 0 and acc.memory_allocated() > 0
    from zerolab.deepspeed.moe.utils import split_params_into_different_moe_groups_for_optimizer as split
    model = torch.nn.Linear(2, 2)
    groups = [{"params": [model.weight], "name": "a", "weight_decay": 0.1}, {"params": [model.bias], "name": "b"}]
    assert split(tuple(groups)) == groups and split(groups[0]) == [groups[0]]
    with pytest.raises(NotImplementedError, match="expert parallelism"):
        zds.moe.layer.MoE(hidden_size=4, expert=model, num_experts=2)
    from zerolab.deepspeed.utils import logger
    assert logger.name == "DeepSpeed"


def _fp16_torch_backward():
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 2)
    engine, *_ = zds.initialize(model=model, model_parameters=model.parameters(), config={
        "train_micro_batch_size_per_gpu": 2, "fp16": {"enabled": True},
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}}})
    try:
        engine(torch.randn(2, 4).half()).float().sum().backward()
    except RuntimeError as e:
        return str(e)
    return "no error"


def test_fp16_loss_backward_is_refused_by_name():
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        msg = zl.launch(_fp16_torch_backward, world_size=1, timeout=120)[0]
    assert "fp16" in msg and "engine.backward(loss)" in msg


def _save_deepspeed_format(path):
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 2)
    engine, *_ = zds.initialize(model=model, model_parameters=model.parameters(), config={
        "train_micro_batch_size_per_gpu": 2, "zero_optimization": {"stage": 2},
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}}})
    engine.backward(engine(torch.randn(2, 4)).sum())
    engine.step()
    return engine.save_checkpoint(path, tag="t", format="deepspeed")


def test_save_checkpoint_format_reaches_the_engine(tmp_path):
    """Before: TypeError (the adapter took no format=)."""
    assert zl.launch(_save_deepspeed_format, world_size=1, args=(str(tmp_path),), timeout=120)[0] is True
    assert (tmp_path / "t" / "zero_pp_rank_0_mp_rank_00_optim_states.pt").exists()   # DeepSpeed's name


# ---------------------------------------------------------------- against DeepSpeed 0.19.8 (skips without it)
@pytest.mark.slow
@pytest.mark.skipif(not HAVE_DEEPSPEED, reason="DeepSpeed is not installed")
def test_the_same_script_trains_the_same_under_deepspeed(zerolab_run, tmp_path):
    cases = [SCHED, ",".join(f"backward_s{s}" for s in (1, 2, 3)), "cifar_s2_fp32,cifar_s3_bf16"]
    theirs = run("deepspeed", ",".join(cases), tmp_path)
    assert theirs[0]["accelerator"] == zerolab_run[0]["accelerator"]
    assert "zerolab" not in theirs[0]["version"]
    for ours, ref in zip(zerolab_run, theirs):
        for name in ",".join(cases).split(","):
            assert_same(ours[name], ref[name], 2e-3 if name.endswith("bf16") else 1e-3, name)


@pytest.mark.skipif(not HAVE_DEEPSPEED, reason="DeepSpeed is not installed")
def test_the_cifar_style_script_matches_deepspeed_at_every_stage_and_precision(tmp_path):
    """The CIFAR-style loop (accelerator, a config dict, "Adam" + weight decay) at ZeRO 0-3 in fp32 and bf16,
    both ways: the whole grid (the zerolab half alone above runs two of its points). One point differs, and the
    difference is DeepSpeed's own: bf16 at ZeRO-0 takes its FP16_Optimizer path (DDP_BFLOAT16: bf16 gradients
    all-reduced, a dynamic loss scale), whose trajectory leaves its own stages 1-3 after the first step (measured:
    loss 2.2840 against 2.3198, parameters 7.3e-3 apart). zerolab's stage 0 in bf16 follows DeepSpeed's stages 1-3;
    the compatibility table says so."""
    ours, theirs = run("zerolab", CIFAR, tmp_path), run("deepspeed", CIFAR, tmp_path)
    for mine, ref in zip(ours, theirs):
        for name in CIFAR.split(","):
            worst = max((mine[name]["final"][k] - ref[name]["final"][k]).abs().max().item() for k in ref[name]["final"])
            print(f"{name}: losses {mine[name]['losses']} / {ref[name]['losses']}; parameters differ by {worst:.1e}")
            if name == "cifar_s0_bf16":
                assert not close(ref[name]["losses"], ref["cifar_s1_bf16"]["losses"], 2e-3), \
                    "DeepSpeed's bf16 ZeRO-0 now follows its stage 1: make the table's row and this test say so"
                assert_same(mine[name], ref["cifar_s1_bf16"], 2e-3, name)
                continue
            assert_same(mine[name], ref[name], 2e-3 if name.endswith("bf16") else 1e-3, name)
