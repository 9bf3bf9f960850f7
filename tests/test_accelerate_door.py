"""A plain Accelerate loop with a DeepSpeed plugin — the user's torch optimizer and LambdaLR, or the config's
optimizer and scheduler through Accelerate's DummyOptim/DummyScheduler — run unchanged under
``zerolab-deepspeed`` on 2 CPU ranks; where DeepSpeed 0.19 is installed, under torchrun with real DeepSpeed too:
the same losses, learning rates and gradient norms step for step (tests/accelerate_script.py).
"""
from __future__ import annotations

import json
import os
import socket
import sys
from pathlib import Path

import pytest

import script_util
from zerolab.bench.peers import deepspeed_available

pytestmark = pytest.mark.slow
pytest.importorskip("accelerate")
ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "tests" / "accelerate_script.py"
CASES = {"client-stage2": ("--stage", "2"), "dummy-stage3-gas2": ("--stage", "3", "--gas", "2", "--dummy")}


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run(lib: str, out: Path, *extra) -> tuple[int, str, list]:
    env = {**os.environ, "DS_ACCELERATOR": "cpu", "OMP_NUM_THREADS": "1",
           "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    head = [sys.executable, "-m", "zerolab.deepspeed", "--num_gpus", "2", "--master_port", str(_port())] \
        if lib == "zerolab" else [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node=2",
                                  f"--master-port={_port()}"]
    r = script_util.run_script([*head, str(SCRIPT), str(out), *extra], env, timeout=900, cwd=out.parent)
    logs = json.loads(out.read_text()) if out.exists() else []
    return r.returncode, r.stdout[-2000:] + r.stderr[-4000:], logs


@pytest.fixture(scope="module")
def ours(tmp_path_factory):
    root = tmp_path_factory.mktemp("accelerate")
    got = {}
    for name, extra in CASES.items():
        rc, text, logs = run("zerolab", root / f"{name}.json", *extra)
        assert rc == 0, text
        got[name] = logs
    return got


def test_client_optimizer_and_scheduler_step_once_per_optimizer_step(ours):
    logs = ours["client-stage2"]
    assert len(logs) == 8                       # 32 samples, 2 ranks x micro-batch 2: the loader is sharded
    # LambdaLR(min(1, (s + 1) / 4)) read after the k-th optimizer step is at s = 2k: DeepSpeed's engine steps the
    # client scheduler it was given, and Accelerate's prepared scheduler steps it again — DeepSpeed 0.19.8 with
    # accelerate does the same (the DeepSpeed half below compares step for step)
    assert [log["lr"] for log in logs] == pytest.approx([min(1.0, (2 * k + 1) / 4) * 1e-3 for k in range(1, 9)])
    assert all(3 < log["loss"] < 5 and 0 < log["grad_norm"] < 100 for log in logs)


def test_dummy_optimizer_at_stage3_with_accumulation(ours):
    logs = ours["dummy-stage3-gas2"]
    assert len(logs) == 4                       # 8 micro-batches a rank, 2 a step
    # WarmupLR linear over 2 steps from 0 to 1e-3, read after each step (as DeepSpeed reports it)
    assert [log["lr"] for log in logs] == pytest.approx([0.0, 5e-4, 1e-3, 1e-3])
    assert all(3 < log["loss"] < 5 and 0 < log["grad_norm"] < 100 for log in logs)


@pytest.mark.skipif(not deepspeed_available(), reason="DeepSpeed is not installed")
@pytest.mark.parametrize("name", list(CASES))
def test_accelerate_loop_matches_deepspeed_step_for_step(ours, tmp_path, name):
    rc, text, theirs = run("deepspeed", tmp_path / f"{name}.json", *CASES[name])
    assert rc == 0, text
    print(f"\n{name}: step, zerolab loss / DeepSpeed loss, lr, grad norm")
    for k, (a, b) in enumerate(zip(ours[name], theirs, strict=True)):
        print(f"  {k + 1} {a['loss']:.6f} / {b['loss']:.6f}  {a['lr']:.2e} / {b['lr']:.2e}  "
              f"{a['grad_norm']:.5f} / {b['grad_norm']:.5f}")
        assert a["lr"] == pytest.approx(b["lr"], abs=1e-12)
        assert a["loss"] == pytest.approx(b["loss"], rel=1e-4)
        assert a["grad_norm"] == pytest.approx(b["grad_norm"], rel=1e-3)
