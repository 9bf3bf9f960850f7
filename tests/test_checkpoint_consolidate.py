"""Offline consolidation, rank-0-only state dicts, 16-bit model saves, frozen parameters left out (issue 11, items 5-6).

A checkpoint saved by 3 ranks (stage 3, bf16, a tied head; stage 1 with a frozen
parameter and a buffer) is consolidated in this process, with no process group,
and through ``python -m zerolab consolidate``: the result equals the engine's own
``full_state_dict()`` bit for bit, tied names sharing one tensor. A planted bug
(every saved rank read from rank 0's file) must be caught.
"""
from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch
import torch.distributed as dist

import zerolab as zl
import zerolab.engine.checkpoint.reshard as reshard
from zerolab.book.models import MLP, TinyGPT, loss_fn, synthetic_batch
from zerolab.engine.checkpoint.files import CheckpointError
from zerolab.engine.checkpoint.consolidate import consolidate_fp32

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CASES = {"gpt-stage3-bf16": (lambda: TinyGPT.preset("micro", seed=1), 3, True),
         "mlp-stage1-frozen": (lambda: MLP(frozen=True, buffer=True, seed=2), 1, False)}


def config(stage, bf16):
    cfg = {"optimizer": {"type": "AdamW", "params": {"lr": 1e-2}},
           "zero_optimization": {"stage": stage, "stage3_param_persistence_threshold": 50}}
    if bf16:
        cfg["bf16"] = {"enabled": True}
    return cfg


def save_worker(root):
    out = {}
    for name, (make, stage, bf16) in CASES.items():
        model = make()
        engine = zl.initialize(model, config(stage, bf16))
        for i in range(2):
            x, y = synthetic_batch(model, 6, step=i, rank=engine.rank, world_size=engine.world_size)
            engine.backward(loss_fn(engine(x), y))
            engine.step()
        engine.save_checkpoint(f"{root}/{name}")
        engine.save_checkpoint(f"{root}/{name}-nofrozen", exclude_frozen_parameters=True)
        path = engine.save_16bit_model(f"{root}/{name}-16", "model.pt")
        full = engine.full_state_dict()
        rank0 = engine.full_state_dict(rank0_only=True)
        assert (rank0 is None) == (engine.rank != 0)
        if rank0 is not None:
            assert all(torch.equal(rank0[k], full[k]) for k in full)
        out[name] = (full, path)
    return out


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    root = str(tmp_path_factory.mktemp("ckpt"))
    return root, zl.launch(save_worker, world_size=3, args=(root,), timeout=300, threads=1)[0]


@pytest.mark.parametrize("name", list(CASES))
def test_consolidate_equals_full_state_dict(saved, name):
    root, results = saved
    want, _ = results[name]
    assert not dist.is_initialized()
    got = consolidate_fp32(f"{root}/{name}")
    assert list(got) == list(want)
    for k in want:
        assert got[k].dtype == want[k].dtype and torch.equal(got[k], want[k]), k
    if name.startswith("gpt"):   # the tied head is the embedding, one tensor
        assert got["head.weight"] is got["wte.weight"]


def test_cli_writes_the_same_tensors(saved, tmp_path):
    root, results = saved
    want, _ = results["gpt-stage3-bf16"]
    out = tmp_path / "model.pt"
    r = subprocess.run([sys.executable, "-m", "zerolab", "consolidate", f"{root}/gpt-stage3-bf16", str(out),
                        "--tag", "global_step2"], capture_output=True, text=True, cwd=REPO,
                       env={**os.environ, "PYTHONPATH": REPO})
    assert r.returncode == 0, r.stderr
    assert "wrote" in r.stdout
    got = torch.load(out, weights_only=True)
    assert all(torch.equal(got[k], want[k]) for k in want) and got.keys() == want.keys()
    bad = subprocess.run([sys.executable, "-m", "zerolab", "consolidate", str(tmp_path), str(out)],
                         capture_output=True, text=True, cwd=REPO, env={**os.environ, "PYTHONPATH": REPO})
    assert bad.returncode == 2 and "error:" in bad.stderr and "no checkpoint found" in bad.stderr, bad.stderr
    assert "Traceback" not in bad.stderr


def test_safetensors_output_needs_the_package(saved, tmp_path):
    root, _ = saved
    from zerolab.engine.checkpoint.consolidate import write_state_dict
    sd = consolidate_fp32(f"{root}/gpt-stage3-bf16")
    try:
        import safetensors.torch as st
    except ImportError:
        with pytest.raises(CheckpointError, match="needs the 'safetensors' package"):
            write_state_dict(sd, tmp_path / "m.safetensors")
        return
    write_state_dict(sd, tmp_path / "m.safetensors")
    back = st.load_file(str(tmp_path / "m.safetensors"))
    assert all(torch.equal(back[k], sd[k]) for k in sd)


def test_exclude_frozen_and_16bit_model(saved):
    root, results = saved
    want, path = results["mlp-stage1-frozen"]
    frozen = ["blocks.0.scale"]   # MLP(frozen=True)'s frozen parameter
    assert set(frozen) <= set(want)
    lean = consolidate_fp32(f"{root}/mlp-stage1-frozen-nofrozen")
    assert not set(frozen) & set(lean) and set(lean) | set(frozen) == set(want)
    w16 = torch.load(f"{root}/gpt-stage3-bf16-16/model.pt", weights_only=True)
    full, _ = results["gpt-stage3-bf16"]
    for k, t in full.items():   # the 16-bit weights are the fp32 master, rounded
        assert w16[k].dtype == torch.bfloat16 and torch.equal(w16[k], t.to(torch.bfloat16)), k


def test_consolidate_planted_bug_is_caught(saved, monkeypatch):
    root, results = saved
    want, _ = results["gpt-stage3-bf16"]
    monkeypatch.setattr(reshard, "optim_file", lambda r: "zerolab_rank_0_optim.pt")
    got = consolidate_fp32(f"{root}/gpt-stage3-bf16")
    assert not all(torch.equal(got[k], want[k]) for k in want)
