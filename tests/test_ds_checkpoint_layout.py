"""zerolab's own checkpoint files are not named as DeepSpeed's (checkpoint/files.py), so DeepSpeed's own
``load_checkpoint`` on a zerolab folder stops at its first file lookup instead of misreading zerolab's files
(it used to fail deep inside: ``KeyError: 'dp_world_size'``); ``python -m zerolab convert CKPT OUT --to
deepspeed`` writes DeepSpeed's. Checkpoints zerolab wrote under DeepSpeed's names still load."""
from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import pytest
import torch

import zerolab as zl
import script_util
from zerolab.bench.peers import deepspeed_available
from zerolab.engine.checkpoint.consolidate import consolidate_fp32
from zerolab.engine.checkpoint.ds_files import is_deepspeed_checkpoint
from zerolab.engine.checkpoint.files import legacy_name, model_file, optim_file

TESTS = Path(__file__).resolve().parent
sys.path.insert(0, str(TESTS))
import ds_resume_run as run  # noqa: E402


def _rank(path, stage, mode):
    torch.manual_seed(0 if mode == "save" else 1)
    cfg = {k: v for k, v in run.config(stage, "fp32").items() if k != "steps_per_print"}
    engine = zl.initialize(run.Tiny(), cfg)
    if mode == "save":
        for s in range(2):
            engine.backward(run.loss(engine(run.batch(s, engine.rank))))
            engine.step()
        engine.save_checkpoint(path, tag="two")
    else:
        engine.load_checkpoint(path)
    return engine.full_state_dict(), engine.global_steps


@pytest.mark.parametrize("stage", [1, 3])
def test_no_deepspeed_file_names_and_old_names_still_load(tmp_path, stage):
    want = zl.launch(_rank, 2, args=(str(tmp_path), stage, "save"))[0]
    tag = tmp_path / "two"
    names = sorted(p.name for p in tag.iterdir())
    expect = sorted({"manifest.json", optim_file(0), optim_file(1), model_file(0, stage), model_file(1, stage)})
    assert names == expect, names
    assert not any(n.endswith(("_model_states.pt", "_optim_states.pt")) for n in names)
    assert not is_deepspeed_checkpoint(tmp_path)
    # a checkpoint zerolab wrote before: the same files under DeepSpeed's names, listed so in its manifest
    manifest = json.loads((tag / "manifest.json").read_text())
    for n in list(manifest["files"]):
        os.rename(tag / n, tag / legacy_name(n))
        manifest["files"][legacy_name(n)] = manifest["files"].pop(n)
    (tag / "manifest.json").write_text(json.dumps(manifest))
    assert "zero_pp_rank_1_mp_rank_00_optim_states.pt" in os.listdir(tag)
    got = zl.launch(_rank, 2, args=(str(tmp_path), stage, "load"))[0]
    assert got[1] == 2 and all(torch.equal(got[0][k], want[0][k]) for k in want[0])
    old = consolidate_fp32(tmp_path)
    assert all(torch.equal(old[k], want[0][k]) for k in want[0])


@pytest.mark.skipif(not deepspeed_available(), reason="DeepSpeed is not installed")
def test_deepspeeds_loader_stops_at_its_first_file_on_a_zerolab_folder(tmp_path):
    """Before: DeepSpeed unpickled zerolab's mp_rank_00_model_states.pt and failed KeyError: 'dp_world_size'.
    Now it finds none of its files and stops there, having read nothing of zerolab's."""
    zl.launch(_rank, 1, args=(str(tmp_path / "zl"), 1, "save"))
    env = {**os.environ, "DS_ACCELERATOR": "cpu", "OMP_NUM_THREADS": "1"}
    out = tmp_path / "ds.json"
    r = script_util.run_script([sys.executable, str(TESTS / "ds_load_run.py"), str(tmp_path / "zl"), "1", str(out)],
                               env, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    got = json.loads(out.read_text())
    assert "error" in got, got   # never a silent (None, None) or a load
    assert "dp_world_size" not in got["message"] and "Missing key" not in got["message"], got
    assert got["error"] in ("AssertionError", "FileNotFoundError"), got   # its lookup of mp_rank_*_model_states.pt
