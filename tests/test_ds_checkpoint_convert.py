"""``python -m zerolab convert SRC DST --to deepspeed|zerolab`` (checkpoint/ds_convert.py; issue 26).

Without DeepSpeed: DeepSpeed's own files (the fixtures) converted to zerolab's and back give every tensor
DeepSpeed wrote, at the same place; a folder that is neither format, or already the target, is refused
by name; stage 3's pickled LossScaler names DeepSpeed's class even when written without DeepSpeed.
DeepSpeed's loader resuming from converted files is tests/test_ds_checkpoint_resume.py's live test
(the converter and ``save_checkpoint(format="deepspeed")`` share ds_save.py).
"""
from __future__ import annotations

import json
import math
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from zerolab.engine.checkpoint.ds_files import load_restricted

FIXTURES = Path(__file__).resolve().parent / "fixtures" / "deepspeed"


def _tensors(obj, path="", steps=False):
    """(path, tensor) of a file's tensors; Adam's step only with ``steps`` (then also as an int)."""
    if path.endswith("/step"):
        if steps:
            yield path, obj
    elif isinstance(obj, torch.Tensor):
        yield path, obj
    elif isinstance(obj, dict):
        for k, v in obj.items():
            yield from _tensors(v, f"{path}/{k}", steps)
    elif isinstance(obj, (list, tuple)):
        for i, v in enumerate(obj):
            yield from _tensors(v, f"{path}[{i}]", steps)


def stage3_real_elements(ckpt: Path, rank: int, group: int) -> torch.Tensor:
    """1 where rank's stage-3 partition of (sub-)group ``group`` holds a parameter element, 0 on the padding
    of each last piece."""
    meta = json.loads((ckpt / "meta.json").read_text())
    world, masks = meta["world_size"], []
    shapes = load_restricted(next((ckpt / "global_step2").glob("zero_pp_rank_0_*model_states.pt")))["param_shapes"]
    for shape in shapes[group].values():
        n = math.prod(shape)
        piece = -(-n // world)
        real = max(0, min(n, (rank + 1) * piece) - rank * piece)
        masks.append(torch.cat([torch.ones(real), torch.zeros(piece - real)]))
    return torch.cat(masks)


@pytest.mark.parametrize("name", ["stage1", "stage2", "stage3", "stage2_world3", "stage3_world3", "stage3_subgroups"])
def test_convert_deepspeed_to_zerolab_and_back_gives_deepspeeds_tensors(tmp_path, name):
    """DeepSpeed's files -> zerolab's -> DeepSpeed's again (CLI): every tensor DeepSpeed wrote (fp32
    partitions, both Adam moments and the step of every rank, the 16-bit module, frozen fragments) comes
    back equal, at the same path in the same file (stage 3 with sub-groups: the same sub-groups); every
    key of param_groups with its value (lr, betas, eps, weight decay...), and FusedAdam's bias_correction."""
    from zerolab.cli import main
    assert main(["convert", str(FIXTURES / name), str(tmp_path / "zl"), "--to", "zerolab"]) == 0
    assert main(["convert", str(tmp_path / "zl"), str(tmp_path / "ds"), "--to", "deepspeed"]) == 0
    assert (tmp_path / "zl" / "global_step2" / "manifest.json").exists()
    orig = FIXTURES / name / "global_step2"
    for f in sorted(orig.iterdir()):
        want, got = load_restricted(f), load_restricted(tmp_path / "ds" / "global_step2" / f.name)
        steps = lambda d: {p: int(t) for p, t in _tensors(d, steps=True) if p.endswith("/step") and "/state/" in p}   # noqa: E731
        assert steps(got) == steps(want)   # Adam's step: written as an int, as FusedAdam keeps it
        theirs, ours = dict(_tensors(want)), dict(_tensors(got))
        assert set(ours) <= set(theirs) and len(ours) >= len(theirs) - 1, f"{f.name}: {set(theirs) ^ set(ours)}"
        for path, t in ours.items():
            ref = theirs[path].float()
            if "fp32_flat_groups" in path:   # DeepSpeed leaves its stage-3 padding uninitialised (we write 0)
                real = stage3_real_elements(FIXTURES / name, int(re.search(r"rank_(\d+)", f.name)[1]),
                                            int(re.search(r"fp32_flat_groups\[(\d+)\]", path)[1]))
                ref = torch.where(real.bool(), ref, torch.zeros(()))
            assert torch.equal(t.float(), ref), f"{f.name}{path} differs"
        if "optim" in f.name:
            inner = "base_optimizer_state" if "single_partition_of_fp32_groups" in want["optimizer_state_dict"] \
                else "optimizer_state_dict"
            pg = lambda d: d["optimizer_state_dict"][inner]["param_groups"][0]   # noqa: E731
            assert {k: v for k, v in pg(got).items() if k in pg(want)} == pg(want)
            assert pg(got)["bias_correction"] is True   # DeepSpeed's FusedAdam reads it


def test_convert_refuses_what_it_cannot_read(tmp_path):
    from zerolab.engine.checkpoint.ds_convert import convert
    from zerolab.engine.checkpoint.files import CheckpointError
    (tmp_path / "empty").mkdir()
    with pytest.raises(CheckpointError, match="neither a zerolab nor a DeepSpeed checkpoint"):
        convert(tmp_path / "empty", tmp_path / "out", "deepspeed")
    (tmp_path / "t" / "a").mkdir(parents=True)
    (tmp_path / "t" / "latest").write_text("a\n")
    (tmp_path / "t" / "a" / "x_optim_states.pt").write_bytes(b"not a checkpoint")
    with pytest.raises(CheckpointError, match="neither a zerolab checkpoint.*nor DeepSpeed's"):
        convert(tmp_path / "t", tmp_path / "out", "zerolab")
    with pytest.raises(CheckpointError, match="already a deepspeed checkpoint"):
        convert(FIXTURES / "stage1", tmp_path / "out", "deepspeed")
    with pytest.raises(CheckpointError, match="choose 'deepspeed' or 'zerolab'"):
        convert(FIXTURES / "stage1", tmp_path / "out", "megatron")
    r = subprocess.run([sys.executable, "-m", "zerolab", "convert", str(tmp_path / "empty"), str(tmp_path / "o"),
                        "--to", "zerolab"], capture_output=True, text=True, timeout=120)
    assert r.returncode == 2 and "Traceback" not in r.stderr and "neither" in r.stderr, r.stderr
    assert not (tmp_path / "out").exists() and not (tmp_path / "o").exists()


def test_loss_scaler_is_deepspeeds_class_even_when_written_without_deepspeed(tmp_path):
    """Stage 3's optimizer file pickles DeepSpeed's LossScaler (its loader indexes it). Written in a process
    where DeepSpeed cannot be imported, the file names the same class with the same fields."""
    code = ("import sys; sys.modules['deepspeed'] = None\n"
            "from zerolab.engine.checkpoint.ds_convert import convert\n"
            f"convert({str(FIXTURES / 'stage3')!r}, {str(tmp_path / 'zl')!r}, 'zerolab')\n"
            f"convert({str(tmp_path / 'zl')!r}, {str(tmp_path / 'ds')!r}, 'deepspeed')\n"
            "assert sys.modules['deepspeed'] is None and 'deepspeed.runtime' not in sys.modules\n")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    f = tmp_path / "ds" / "global_step2" / "bf16_zero_pp_rank_0_mp_rank_00_optim_states.pt"
    from zerolab.engine.checkpoint.ds_files import pickle_globals
    assert "deepspeed.runtime.fp16.loss_scaler.LossScaler" in pickle_globals(f)
    assert load_restricted(f)["optimizer_state_dict"]["loss_scaler"] == {"cur_scale": 1.0, "dynamic": False}


# ---------------------------------------------------------------- docs/CHECKPOINTS.md's table of written keys
DOC = Path(__file__).resolve().parent.parent / "docs" / "CHECKPOINTS.md"
BEGIN, END = "<!-- ds-keys: generated by `python tests/test_ds_checkpoint_convert.py` -->", "<!-- /ds-keys -->"


def _paths(obj, path=""):
    """Key paths of a written file; list items as [i] (the first only), tensors as (dtype)."""
    if isinstance(obj, torch.Tensor):
        return [f"{path} ({str(obj.dtype).replace('torch.', '')})"]
    if isinstance(obj, dict) and obj and not (path.endswith("/module") or path.endswith("fragments")
                                              or path.endswith("shapes") or path.endswith("shared_params")
                                              or path.endswith("ds_config")):
        return [p for k, v in obj.items() for p in _paths(v, f"{path}/{k}")]
    if path.rsplit("/", 1)[-1] in ("param_groups", "param_shapes"):   # torch's Adam group; name -> shape
        return [f"{path}[0] ({type(obj[0]).__name__}: {', '.join(k for k in obj[0] if '.' not in k) or 'name: Size'})"]
    if isinstance(obj, (list, tuple)) and obj and isinstance(obj[0], (torch.Tensor, dict, list)):
        return _paths(obj[0], f"{path}[0]")
    return [f"{path} ({type(obj).__name__})"]


def key_table() -> str:
    """What ds_save.deepspeed_parts writes, per stage and file (bf16, from the 2-rank fixtures read as zerolab's)."""
    from zerolab.engine.checkpoint.ds_load import DeepSpeedSaved
    from zerolab.engine.checkpoint.ds_save import _loss_scaler_class, deepspeed_parts
    rows = ["| stages | file | keys written (tensor dtypes in brackets) |", "|---|---|---|"]
    for stages, stage in (("1, 2", 2), ("3", 3)):
        saved = DeepSpeedSaved(FIXTURES / f"stage{stage}" / "global_step2")
        with _loss_scaler_class(stage == 3) as scaler:
            for name, obj in deepspeed_parts(saved, 0, loss_scaler_cls=scaler):
                kind = "optimizer states" if "optim" in name else "model states"
                paths = sorted(p.lstrip("/") for p in _paths(obj))
                rows.append(f"| {stages} | {kind} | " + ", ".join(f"`{p}`" for p in paths) + " |")
    return "\n".join(rows)


def test_docs_table_is_what_the_writer_writes():
    text = DOC.read_text()
    assert BEGIN in text and END in text, f"{DOC}: the generated table's markers are missing"
    block = text.split(BEGIN, 1)[1].split(END, 1)[0].strip()
    assert block == key_table(), "docs/CHECKPOINTS.md's key table is stale: run python tests/test_ds_checkpoint_convert.py"


if __name__ == "__main__":   # rewrite the table in docs/CHECKPOINTS.md
    text = DOC.read_text()
    head, rest = text.split(BEGIN, 1)
    DOC.write_text(f"{head}{BEGIN}\n{key_table()}\n{END}{rest.split(END, 1)[1]}")
    print(f"updated {DOC}")


@pytest.mark.parametrize("name, stage, world", [("stage3_world3", 1, 2), ("stage1", 3, 3)])
def test_convert_to_another_stage_and_world_size(tmp_path, name, stage, world):
    """--stage/--world: DeepSpeed's files for another layout hold the same fp32 weights and moments."""
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from test_ds_checkpoint_resume import ds_state
    from zerolab.cli import main
    assert main(["convert", str(FIXTURES / name), str(tmp_path / "zl"), "--to", "zerolab"]) == 0
    assert main(["convert", str(tmp_path / "zl"), str(tmp_path / "ds"), "--to", "deepspeed",
                 "--stage", str(stage), "--world", str(world)]) == 0
    out = tmp_path / "ds" / "global_step2"
    assert len(list(out.glob("*_optim_states.pt"))) == world
    assert int(load_restricted(next(out.glob("*rank_0*optim_states.pt")))["optimizer_state_dict"]["zero_stage"]) == stage
    for key in ("fp32", "exp_avg", "exp_avg_sq"):
        want, got = ds_state(FIXTURES / name / "global_step2", key), ds_state(out, key)
        assert set(got) == set(want) and all(torch.equal(got[n], want[n]) for n in want), key


def test_stage3_sub_groups_follow_deepspeeds_rule():
    """A parameter joins the open sub-group until its pieces (per rank) reach sub_group_size; one group when
    everything fits. The fixture's three sub-groups as DeepSpeed wrote them; with DeepSpeed installed, its own
    _create_fp16_sub_groups on many sizes."""
    import random
    from zerolab.engine.checkpoint.ds_save import sub_groups
    assert sub_groups([3, 3, 3], 6) == [(0, 2), (2, 3)]   # reaching the size closes the sub-group
    assert sub_groups([3, 3, 3], 9) == [(0, 3)] and sub_groups([3, 3, 3], 10**9) == [(0, 3)]
    assert sub_groups([7, 1], 6) == [(0, 1), (1, 2)]
    shapes = load_restricted(next((FIXTURES / "stage3_subgroups" / "global_step2").glob(
        "zero_pp_rank_0_*model_states.pt")))["param_shapes"]
    pieces = [-(-math.prod(s) // 2) for g in shapes for s in g.values()]
    bounds, start = [], 0
    for g in shapes:
        bounds.append((start, start + len(g)))
        start += len(g)
    assert sub_groups(pieces, 6) == bounds and len(bounds) == 3
    from zerolab.bench.peers import deepspeed_available
    if not deepspeed_available():
        return
    rng = random.Random(0)
    cases = [([rng.randint(1, 9) for _ in range(rng.randint(1, 8))], rng.randint(1, 30)) for _ in range(200)]
    # in a child process: DeepSpeed imported here would stay in this process and in the ranks it forks later
    code = ("import json, sys, types\n"
            "from deepspeed.runtime.zero.stage3 import DeepSpeedZeroOptimizer_Stage3 as S\n"
            "cases = json.loads(sys.stdin.read())\n"
            "print(json.dumps([[len(g) for g in S._create_fp16_sub_groups(types.SimpleNamespace(sub_group_size=k),"
            " [types.SimpleNamespace(partition_numel=lambda n=n: n) for n in sizes])] for sizes, k in cases]))\n")
    r = subprocess.run([sys.executable, "-c", code], input=json.dumps(cases), capture_output=True, text=True,
                       timeout=300, env={**os.environ, "DS_ACCELERATOR": "cpu"})
    assert r.returncode == 0, r.stderr[-3000:]
    theirs = json.loads(r.stdout.strip().splitlines()[-1])
    for (sizes, size), lengths in zip(cases, theirs):
        assert lengths == [b - a for a, b in sub_groups(sizes, size)], (sizes, size)
