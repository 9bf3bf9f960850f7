"""The source article's recipe — a Hugging Face Trainer job with a DeepSpeed config (ZeRO-2, optimizer on the
CPU, "auto" values, clipping 1.0) — run unchanged under ``zerolab-deepspeed`` on 2 CPU ranks, and where
DeepSpeed 0.19 is installed under torchrun with real DeepSpeed: the same losses, learning rates and gradient
norms step for step. Trainer drives the engine through ``set_gradient_accumulation_boundary``,
``backward(loss, scale_wrt_gas=False)``, ``step`` and ``get_global_grad_norm``.
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
ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "tests" / "hf_trainer_script.py"


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run(lib: str, tmp_path, *extra) -> tuple[int, str, list]:
    out = tmp_path / f"{lib}.json"
    env = {**os.environ, "DS_ACCELERATOR": "cpu", "OMP_NUM_THREADS": "1",
           "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    head = [sys.executable, "-m", "zerolab.deepspeed", "--num_gpus", "2", "--master_port", str(_port())] \
        if lib == "zerolab" else [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node=2",
                                  f"--master-port={_port()}"]
    r = script_util.run_script([*head, str(SCRIPT), str(out), *extra], env, timeout=900, cwd=tmp_path)
    return r.returncode, r.stdout[-2000:] + r.stderr[-4000:], json.loads(out.read_text()) if out.exists() else []


@pytest.fixture(scope="module")
def zerolab_dir(tmp_path_factory):
    return tmp_path_factory.mktemp("trainer")


@pytest.fixture(scope="module")
def zerolab_logs(zerolab_dir):
    rc, text, logs = run("zerolab", zerolab_dir)
    assert rc == 0, text
    return logs


def test_the_recipe_trains_under_zerolab_with_auto_batch_sizes(zerolab_logs):
    """"train_batch_size": "auto" included — the recipe's file as it is (DeepSpeed fails on it on a CPU)."""
    assert len(zerolab_logs) == 3
    # WarmupLR warms up logarithmically (DeepSpeed's default): lr_max · log(s + 1) / log(2) over 2 steps
    assert [log["learning_rate"] for log in zerolab_logs] == pytest.approx([0.0, 1e-3, 1e-3])
    assert all(0 < log["grad_norm"] < 100 and 3 < log["loss"] < 5 for log in zerolab_logs)


def test_the_recipe_reports_memory_per_rank(zerolab_logs, zerolab_dir):
    """What DeepSpeed never shows: each rank's model states from the engine (ZeRO-2, fp32 here, the optimizer
    on the CPU), the same on both ranks, and the process's peak RSS."""
    mems = [json.loads((zerolab_dir / f"zerolab.json.rank{r}.mem").read_text()) for r in (0, 1)]
    assert mems[0]["total"] == mems[1]["total"] > 0
    assert all(m["params"] > 0 and m["peak_rss"] > m["total"] for m in mems), mems


def test_trainer_accumulation_sets_the_boundary_and_steps_only_there(tmp_path):
    """gradient_accumulation_steps 2: Accelerate says which backward is the boundary and calls step() there only;
    the engine counts the other micro-batch itself (3 optimizer steps from 6 micro-batches)."""
    rc, text, logs = run("zerolab", tmp_path, "--gas2")
    assert rc == 0, text
    assert len(logs) == 3 and [log["learning_rate"] for log in logs] == pytest.approx([0.0, 1e-3, 1e-3])


@pytest.mark.skipif(not deepspeed_available(), reason="DeepSpeed is not installed")
def test_the_recipe_matches_deepspeed_step_for_step(zerolab_logs, zerolab_dir, tmp_path):
    zerolab_logs_dir = zerolab_dir
    rc, text, theirs = run("deepspeed", tmp_path)
    if rc != 0 and "train_batch_size" in text:   # some transformers/accelerate releases fill it for one process
        rc, text, theirs = run("deepspeed", tmp_path, "--no-auto-batch")
    assert rc == 0, text
    for rank in (0, 1):   # memory per rank: zerolab's census, and the peak RSS of both (measured)
        ours_mem = json.loads((zerolab_logs_dir / f"zerolab.json.rank{rank}.mem").read_text())
        ref_mem = json.loads((tmp_path / f"deepspeed.json.rank{rank}.mem").read_text())
        print(f"rank {rank}: zerolab {ours_mem}; DeepSpeed peak RSS {ref_mem['peak_rss'] / 2**20:.0f} MiB")
    print("\nTrainer ZeRO-2 + CPU optimizer: zerolab / DeepSpeed loss, lr, grad norm")
    for ours, ref in zip(zerolab_logs, theirs, strict=True):
        print(f"  {ours['loss']:.6f} / {ref['loss']:.6f}  {ours['learning_rate']:.2e} / {ref['learning_rate']:.2e}  "
              f"{ours['grad_norm']:.5f} / {ref['grad_norm']:.5f}")
        assert ours["learning_rate"] == pytest.approx(ref["learning_rate"], abs=1e-12)
        assert ours["loss"] == pytest.approx(ref["loss"], rel=1e-4)
        assert ours["grad_norm"] == pytest.approx(ref["grad_norm"], rel=1e-3)
