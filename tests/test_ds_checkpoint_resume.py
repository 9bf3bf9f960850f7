"""Checkpoints that travel both ways between zerolab and DeepSpeed 0.19 (issue 26; checkpoint/ds_save.py, ds_load.py).

* zerolab -> DeepSpeed: ``engine.save_checkpoint(dir, tag, format="deepspeed")`` writes DeepSpeed's files.
  Always: their keys, shapes and dtypes are those of the files DeepSpeed itself wrote for the same model
  (the committed fixtures), zerolab's own DeepSpeed reader merges them into the engine's weights, and
  ``load_checkpoint`` of them resumes exactly. With DeepSpeed: DeepSpeed's ``load_checkpoint`` resumes
  from them and its next M steps reach zerolab's next M steps.
* DeepSpeed -> zerolab: ``engine.load_checkpoint(ds_dir)``. Always: the fixtures' fp32 weights, Adam
  moments and step counts land in the engine, at the saved and at another world size and stage. With
  DeepSpeed: zerolab's M steps after loading DeepSpeed's checkpoint reach DeepSpeed's own M steps.
"""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from zerolab.bench.peers import deepspeed_available
import zerolab as zl
import script_util
from zerolab.engine.checkpoint import ds_merge
from zerolab.engine.checkpoint.ds_files import load_restricted
from zerolab.engine.checkpoint.ds_load import DeepSpeedSaved

TESTS = Path(__file__).resolve().parent
sys.path.insert(0, str(TESTS))
import ds_resume_run as run  # noqa: E402

FIXTURES = TESTS / "fixtures" / "deepspeed"
HAVE_DEEPSPEED = deepspeed_available()  # the real package, not a folder named deepspeed
K, M = 3, 3
# DeepSpeed writes these; zerolab's files leave them out (each defaults on load, or serves only DeepSpeed's
# own tools): the fp16 loss scaler's flags (stages 1-2), clipping, universal-checkpoint slice maps, samples
NOT_WRITTEN = {"loss_scaler", "dynamic_loss_scale", "overflow", "clip_grad", "param_slice_mappings",
               "global_samples"}


def zl_config(stage: int, dtype: str, sub_group_size=None) -> dict:
    cfg = {k: v for k, v in run.config(stage, dtype, sub_group_size).items() if k not in ("steps_per_print",)}
    return {**cfg, "optimizer": {"type": "AdamW", "params": {"lr": run.LR, "weight_decay": run.WD}}}


def _train(engine, first, steps):
    out = []
    for s in range(first, first + steps):
        value = run.loss(engine(run.batch(s, engine.rank)))
        engine.backward(value)
        engine.step()
        out.append(value.item())
    return out


def zl_rank(work, stage, dtype, mode, load_from=None, sub_group_size=None):
    """mode "save": seed 0, K steps, save DeepSpeed's files into work/zl, M more steps; "load": seed 1,
    load ``load_from``, M steps. Returns (losses, fp32 state dict, global steps, lr)."""
    torch.manual_seed(0 if mode == "save" else 1)
    engine = zl.initialize(run.Tiny(), zl_config(stage, dtype, sub_group_size))
    if mode == "save":
        losses = _train(engine, 0, K)
        engine.save_checkpoint(os.path.join(work, "zl"), tag="k", format="deepspeed")
    else:
        engine.load_checkpoint(load_from)
        losses = []
    steps = engine.global_steps
    losses += _train(engine, K, M)
    return losses, engine.full_state_dict(), steps, engine.get_lr()


def max_diff(a: dict, b: dict) -> float:
    keys = [k for k in b if k in a and b[k].is_floating_point()]
    assert keys, "nothing to compare"
    return max((a[k].float() - b[k].float()).abs().max().item() for k in keys)


def structure(obj, path="") -> dict:
    """{path: (dtype, shape) or type name} of a checkpoint file's contents, recursively."""
    if path.endswith("/step"):   # Adam's step: torch's optimizer keeps a tensor, DeepSpeed's FusedAdam an int
        return {path: "step"}
    if isinstance(obj, torch.Tensor):   # a buffer's dtype differs in DeepSpeed's own files by stage
        return {path: (None if path == "/module/scale" else obj.dtype, tuple(obj.shape))}
    if isinstance(obj, dict):
        out = {}
        for k, v in obj.items():
            if k in NOT_WRITTEN or k in ("ds_config", "lr_scheduler", "param_groups"):   # groups: below
                continue
            out.update(structure(v, f"{path}/{k}"))
        return out or {path: "dict"}
    if isinstance(obj, (list, tuple)) and obj and isinstance(obj[0], (torch.Tensor, dict, list)):
        out = {}
        for i, v in enumerate(obj):
            out.update(structure(v, f"{path}[{i}]"))
        return out
    return {path: type(obj).__name__ if obj is not None else "None"}


# ---------------------------------------------------------------- always: zerolab -> DeepSpeed's files
@pytest.mark.parametrize("stage", [1, 2, 3])
def test_written_files_have_deepspeeds_keys_and_shapes_and_resume(tmp_path, stage):
    """bf16 on 2 ranks, like the fixtures: the same files, the same keys and tensor shapes and dtypes;
    zerolab's DeepSpeed reader gives back the engine's weights; loading them resumes bit for bit."""
    res = zl.launch(zl_rank, world_size=2, args=(str(tmp_path), stage, "bf16", "save"))
    tag = tmp_path / "zl" / "k"
    assert (tmp_path / "zl" / "latest").read_text().strip() == "k"
    assert sorted(p.name for p in (tmp_path / "zl").iterdir()) == ["k", "latest"], "hidden folders left behind"
    ours = sorted(p.name for p in tag.iterdir())
    theirs = sorted(p.name for p in (FIXTURES / f"stage{stage}" / "global_step2").iterdir())
    assert ours == theirs
    for name in ours:
        got = structure(load_restricted(tag / name))
        want = structure(load_restricted(FIXTURES / f"stage{stage}" / "global_step2" / name))
        assert got == want, f"{name}: {sorted(set(got.items()) ^ set(want.items()), key=str)}"
        if "optim" in name:   # every key DeepSpeed's group holds (torch's AdamW here) and FusedAdam's step reads
            got_pg, want_pg = param_group(load_restricted(tag / name)), param_group(
                load_restricted(FIXTURES / f"stage{stage}" / "global_step2" / name))
            assert set(got_pg) >= set(want_pg) | {"bias_correction", "lr", "betas", "eps", "weight_decay"}, got_pg
            assert got_pg["bias_correction"] is True and got_pg["decoupled_weight_decay"] is True
    model_states = load_restricted(next(tag.glob("*model_states.pt")))
    assert model_states["lr_scheduler"] == {"last_batch_iteration": K - 1}   # DeepSpeed's WarmupLR after K steps
    # the weights after K steps, read back by the zero_to_fp32-compatible reader
    again = zl.launch(zl_rank, world_size=2, args=(str(tmp_path), stage, "bf16", "load", str(tmp_path / "zl")))
    assert again[0][2] == K
    assert max_diff(again[0][1], res[0][1]) == 0.0, "resuming from zerolab's DeepSpeed files is not exact"
    assert again[0][0] == res[0][0][K:]
    merged = ds_merge.deepspeed_fp32_state_dict(tmp_path / "zl")
    assert set(merged) >= {"emb.weight", "head.weight", "mix.weight", "scale"}


def param_group(optim_file: dict) -> dict:
    osd = optim_file["optimizer_state_dict"]
    return (osd.get("base_optimizer_state") or osd["optimizer_state_dict"])["param_groups"][0]


# ---------------------------------------------------------------- always: DeepSpeed's fixtures -> zerolab
def fixture_rank(name, stage, out):
    torch.manual_seed(5)
    engine = zl.initialize(run.Tiny(), {**zl_config(stage, "bf16"), "scheduler": None})
    engine.load_checkpoint(str(FIXTURES / name))
    engine.save_checkpoint(out, tag="loaded")   # zerolab's own files: every parameter's moments, by name
    return engine.full_state_dict(), engine.global_steps, engine.optimizer.step_count


def ds_moments(name: str, key: str) -> dict:
    return ds_state(FIXTURES / name / "global_step2", key)


def ds_state(tag: Path, key: str) -> dict:
    """{parameter: DeepSpeed's fp32 value or Adam moment ``key``} merged from a tag folder's rank files by
    ds_merge's partition arithmetic (the one that reproduces DeepSpeed's zero_to_fp32), independently of ds_load."""
    from zerolab.engine.checkpoint.ds_files import checkpoint_files, read_model_states
    models, optims = checkpoint_files(tag)
    osds = [load_restricted(f)["optimizer_state_dict"] for f in optims]
    stage, world = int(osds[0]["zero_stage"]), len(optims)
    inner = "base_optimizer_state" if stage <= 2 else "optimizer_state_dict"
    fp32 = "single_partition_of_fp32_groups" if stage <= 2 else "fp32_flat_groups"
    # one Adam state entry per fp32 partition (stage 3: per sub-group), in param_groups' order
    parts = [o[fp32] if key == "fp32" else [o[inner]["state"][i][key] for g in o[inner]["param_groups"]
                                            for i in g["params"]] for o in osds]
    shapes = read_model_states(models[:1])[0]["param_shapes"]
    out = {}
    if stage <= 2:
        ds_merge.merge_stage12(out, parts, shapes, osds[0]["param_alignment_paddings"], world)
    else:
        ds_merge.merge_stage3(out, parts, shapes, world)
    return out


@pytest.mark.parametrize("name, stage, world", [("stage1", 1, 2), ("stage2", 3, 3), ("stage3", 3, 2),
                                                ("stage3_world3", 2, 2), ("stage2_world3", 0, 2),
                                                ("stage3_subgroups", 3, 2), ("stage3_subgroups", 1, 3)])
def test_load_deepspeeds_fixture(tmp_path, name, stage, world):
    """DeepSpeed's bf16 checkpoint after 2 steps: its fp32 master weights (DeepSpeed's own zero_to_fp32
    answer), both Adam moments of every parameter and the step counts, exactly, at the saved world
    size and stage and at others (the resharding path)."""
    from zerolab.engine.checkpoint.files import read_manifest
    from zerolab.engine.checkpoint.reshard import SavedCheckpoint
    res = zl.launch(fixture_rank, world_size=world, args=(name, stage, str(tmp_path)))
    sd, steps, opt_steps = res[0]
    expected = torch.load(FIXTURES / name / "expected.pt", weights_only=True)
    assert max_diff(sd, {k: v for k, v in expected.items() if k != "scale"}) == 0.0
    assert (steps, opt_steps) == (2, 2)
    saved = SavedCheckpoint(str(tmp_path / "loaded"), read_manifest(str(tmp_path / "loaded")))
    for key in ("exp_avg", "exp_avg_sq"):
        want = ds_moments(name, key)
        assert set(want) == set(saved.index)
        for n, v in want.items():
            assert torch.equal(saved.param(n, key).view(v.shape), v), f"{n}: {key} differs"


def resumed_k(work: Path) -> dict:
    """zerolab's fp32 weights after K steps, read back from its DeepSpeed files by zerolab's own reader."""
    return {k: v for k, v in ds_merge.deepspeed_fp32_state_dict(work / "zl").items() if k != "scale"}


# ---------------------------------------------------------------- with DeepSpeed: both ways, continued training
# (stage, dtype, sub_group_size): DeepSpeed's optimizer is its own FusedAdam (the config's "AdamW"), as a
# DeepSpeed user gets it; sub_group_size 12 cuts stage 3's state into two sub-groups on both sides
LIVE = [(1, "fp32", None), (2, "bf16", None), (3, "fp32", None), (3, "fp32", 12),
        pytest.param(1, "bf16", None, marks=pytest.mark.slow), pytest.param(2, "fp32", None, marks=pytest.mark.slow),
        pytest.param(3, "bf16", None, marks=pytest.mark.slow)]
# fp32 master weights after M steps: the two sides' gradients differ in float rounding only, except at
# stage 3 in bf16, where DeepSpeed's forward itself differs from torch's (its ZeRO-3 linear: measured, a
# bf16 model holding DeepSpeed's own merged weights computes zerolab's loss, not DeepSpeed's); the exact
# check there is what DeepSpeed holds right after loading (test below: equal, bit for bit)
# Elsewhere a few float32 ulps: DeepSpeed's FusedAdam (its kernel orders the update's arithmetic its own way)
# against torch's AdamW in zerolab (measured 9.5e-7 to 1.0e-6 after M steps; a client torch AdamW in
# DeepSpeed gave 3e-8 to 1.2e-7)
TOLERANCE = {"fp32": 3e-6, "bf16": 3e-6, (3, "bf16"): 2e-2}
LOSS_TOLERANCE = {"fp32": 1e-5, "bf16": 1e-5, (3, "bf16"): 2e-2}


def run_deepspeed(work: Path, stage: int, dtype: str, world: int = 2, sub_group_size=None) -> None:
    env = {**os.environ, "DS_ACCELERATOR": "cpu", "OMP_NUM_THREADS": "1"}
    r = script_util.run_script([sys.executable, str(TESTS / "ds_resume_run.py"), str(work), str(stage), str(world),
                                dtype, str(K), str(M)] + ([str(sub_group_size)] if sub_group_size else []), env,
                               timeout=600)
    assert r.returncode == 0, r.stderr[-4000:]


@pytest.mark.skipif(not HAVE_DEEPSPEED, reason="DeepSpeed is not installed")
@pytest.mark.parametrize("stage, dtype, sub", LIVE)
def test_resume_both_ways_with_deepspeed(tmp_path, stage, dtype, sub):
    """zerolab trains K steps and saves DeepSpeed's files; DeepSpeed trains K steps and saves its own.
    DeepSpeed loads zerolab's and trains M steps: it must reach zerolab's own M steps; zerolab loads
    DeepSpeed's and trains M steps: it must reach DeepSpeed's own M steps (weights, losses, counters)."""
    ours = zl.launch(zl_rank, world_size=2, args=(str(tmp_path), stage, dtype, "save", None, sub))
    run_deepspeed(tmp_path, stage, dtype, sub_group_size=sub)
    if sub:   # both sides wrote the same sub-groups (more than one)
        for side in ("ds", "zl"):
            osd = load_restricted(next((tmp_path / side / "k").glob("*rank_0_*optim_states.pt")))
            assert len(osd["optimizer_state_dict"]["fp32_flat_groups"]) == 2, side
    resumed = zl.launch(zl_rank, world_size=2, args=(str(tmp_path), stage, dtype, "load", str(tmp_path / "ds"),
                                                     sub))
    ds_after = ds_merge.deepspeed_fp32_state_dict(tmp_path / "ds_after")
    zl_then_ds = ds_merge.deepspeed_fp32_state_dict(tmp_path / "zl_then_ds")
    # DeepSpeed's own offline reader (zero_to_fp32) on zerolab's files: the weights after K steps, exactly
    from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint
    assert max_diff(get_fp32_state_dict_from_zero_checkpoint(str(tmp_path / "zl")), resumed_k(tmp_path)) == 0.0
    # what DeepSpeed holds right after loading zerolab's files: the fp32 weights and both moments, exactly
    for key in ("fp32", "exp_avg", "exp_avg_sq"):
        want, got = ds_state(tmp_path / "zl" / "k", key), ds_state(tmp_path / "zl_loaded" / "k", key)
        assert set(want) == set(got) and all(torch.equal(got[n], want[n]) for n in want), f"DeepSpeed's {key}"
    tol, loss_tol = TOLERANCE.get((stage, dtype), TOLERANCE[dtype]), LOSS_TOLERANCE.get((stage, dtype),
                                                                                       LOSS_TOLERANCE[dtype])
    for r in range(2):
        theirs = torch.load(tmp_path / f"ds_losses.rank{r}.pt", weights_only=True)
        assert theirs["B_steps"] == K
        assert max(abs(a - b) for a, b in zip(theirs["B"], ours[r][0][K:])) < loss_tol, "DeepSpeed after our save"
        assert max(abs(a - b) for a, b in zip(resumed[r][0], theirs["A"][K:])) < loss_tol, "zerolab after DeepSpeed's"
    assert resumed[0][2] == K
    d1, d2 = max_diff(zl_then_ds, ours[0][1]), max_diff(resumed[0][1], ds_after)
    print(f"stage {stage} {dtype} sub-groups {sub}: max |DeepSpeed resumed from zerolab - zerolab| = {d1:.3g}; "
          f"max |zerolab resumed from DeepSpeed - DeepSpeed| = {d2:.3g}")
    assert d1 < tol and d2 < tol


@pytest.mark.skipif(not HAVE_DEEPSPEED, reason="DeepSpeed is not installed")
@pytest.mark.parametrize("stage", [1, pytest.param(3, marks=pytest.mark.slow)])
def test_load_deepspeeds_universal_checkpoint(tmp_path, stage):
    """DeepSpeed's checkpoint after K steps, rewritten by its ds_to_universal.py (zero/<param>/fp32.pt,
    exp_avg.pt, exp_avg_sq.pt, latest_universal): zerolab's M steps after loading it reach DeepSpeed's own
    M steps on 2 ranks; on 3 ranks (resharded) the first loss after loading is DeepSpeed's."""
    run_deepspeed(tmp_path, stage, "fp32")
    env = {**os.environ, "DS_ACCELERATOR": "cpu", "OMP_NUM_THREADS": "1"}
    r = subprocess.run([sys.executable, "-m", "deepspeed.checkpoint.ds_to_universal", "--input_folder",
                        str(tmp_path / "ds" / "k"), "--output_folder", str(tmp_path / "uni" / "k_universal"),
                        "--num_extract_workers", "1", "--num_merge_workers", "1", "--inject_missing_state"],
                       env=env, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    assert not (tmp_path / "uni" / "latest").exists() and (tmp_path / "uni" / "latest_universal").exists()
    theirs = torch.load(tmp_path / "ds_losses.rank0.pt", weights_only=True)["A"][K:]
    two = zl.launch(zl_rank, world_size=2, args=(str(tmp_path), stage, "fp32", "load", str(tmp_path / "uni")))
    assert two[0][2] == K and max(abs(a - b) for a, b in zip(two[0][0], theirs)) < 1e-5
    d = max_diff(two[0][1], ds_merge.deepspeed_fp32_state_dict(tmp_path / "ds_after"))
    print(f"stage {stage} universal: max |zerolab resumed - DeepSpeed| = {d:.3g}")
    assert d < TOLERANCE["fp32"]   # DeepSpeed's FusedAdam against torch's AdamW: a float32 ulp or two
    three = zl.launch(zl_rank, world_size=3, args=(str(tmp_path), stage, "fp32", "load", str(tmp_path / "uni")))
    assert abs(three[0][0][0] - theirs[0]) < 1e-5


def test_unknown_format_is_refused_by_name(tmp_path):
    torch.manual_seed(0)
    engine = zl.initialize(run.Tiny(), zl_config(1, "fp32"))
    with pytest.raises(ValueError, match="format='megatron'.*'zerolab'.*'deepspeed'"):
        engine.save_checkpoint(tmp_path, format="megatron")
    assert not any(tmp_path.iterdir())


def _front_door_rank(work):
    """``import zerolab.deepspeed as deepspeed``: the DeepSpeed-shaped engine passes format= on."""
    import zerolab.deepspeed as deepspeed
    torch.manual_seed(0)
    cfg = {**zl_config(1, "fp32"), "train_micro_batch_size_per_gpu": 2}
    engine, *_ = deepspeed.initialize(model=run.Tiny(), config=cfg)
    for s in range(2):
        engine.backward(run.loss(engine(run.batch(s, engine.global_rank))))
        engine.step()
    engine.save_checkpoint(os.path.join(work, "ds"), tag="two", format="deepspeed")
    engine.save_checkpoint(os.path.join(work, "zl"), tag="two")   # the default: zerolab's own
    return engine.engine.full_state_dict()


def test_deepspeed_front_door_saves_deepspeeds_format(tmp_path):
    from zerolab.engine.checkpoint.ds_files import is_deepspeed_checkpoint
    want = zl.launch(_front_door_rank, world_size=2, args=(str(tmp_path),))[0]
    assert is_deepspeed_checkpoint(tmp_path / "ds") and not is_deepspeed_checkpoint(tmp_path / "zl")
    assert (tmp_path / "zl" / "two" / "manifest.json").exists()
    merged = ds_merge.deepspeed_fp32_state_dict(tmp_path / "ds")   # the engine's weights, exactly
    assert max_diff(merged, {k: v for k, v in want.items() if k != "scale"}) == 0.0
