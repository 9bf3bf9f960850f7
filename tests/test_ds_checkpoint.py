"""Reading DeepSpeed's own ZeRO checkpoints without DeepSpeed (zerolab/engine/checkpoint/ds_files.py and ds_merge.py, chapter 8).

The fixtures under tests/fixtures/deepspeed/stage{1,2,3}/ (and stage{1,2,3}_world3/) were
saved by DeepSpeed 0.19 on 2 (3) CPU ranks (tests/fixtures/make_ds_checkpoints.py);
``expected.pt`` next to each is DeepSpeed's own ``zero_to_fp32`` answer.
Where DeepSpeed imports, one more test compares with it live.
"""
from __future__ import annotations

import io
import json
import os
import pickle
import shutil
import zipfile
from pathlib import Path

import pytest
import torch

import zerolab as zl

from zerolab.engine.checkpoint import ds_files as dsc, ds_merge

FIXTURES = Path(__file__).resolve().parent / "fixtures" / "deepspeed"
STAGES = (1, 2, 3)
# stage3_subgroups: ZeRO-3 with sub_group_size 6, three sub-groups (DeepSpeed's default 1e9 cuts every
# model above 1e9 parameters so): one fp32 partition and one Adam state entry per sub-group
CHECKPOINTS = [f"stage{s}" for s in STAGES] + [f"stage{s}_world3" for s in STAGES] + ["stage3_subgroups"]


def expected(name) -> dict:
    """DeepSpeed's own zero_to_fp32 answer for fixture ``name`` (a stage number: the 2-rank one)."""
    name = f"stage{name}" if isinstance(name, int) else name
    return torch.load(FIXTURES / name / "expected.pt", weights_only=True)


def mismatches(got: dict, want: dict) -> list[str]:
    """Every difference between two state dicts: names, order, dtype, shape, values."""
    out = []
    if list(got) != list(want):
        out.append(f"names/order: {list(got)} != {list(want)}")
    for k in want:
        if k not in got:
            continue
        a, b = got[k], want[k]
        if a.dtype != b.dtype or a.shape != b.shape:
            out.append(f"{k}: {a.dtype}{tuple(a.shape)} != {b.dtype}{tuple(b.shape)}")
        elif not torch.equal(a, b):
            out.append(f"{k}: values differ")
    return out


@pytest.fixture
def ckpt(tmp_path):
    """A writable copy of a fixture checkpoint: ckpt(stage) -> its directory."""
    def make(stage):
        dest = tmp_path / f"stage{stage}"
        shutil.copytree(FIXTURES / f"stage{stage}", dest)
        return dest
    return make


def test_fixtures_are_tiny_and_from_deepspeed_019():
    total = sum(f.stat().st_size for f in FIXTURES.rglob("*") if f.is_file())
    assert total < 200_000, f"fixtures grew to {total} bytes"
    for name in CHECKPOINTS:
        meta = json.loads((FIXTURES / name / "meta.json").read_text())
        assert meta["deepspeed"].startswith("0.19.") and name.startswith(f"stage{meta['stage']}")
        assert meta["world_size"] == (3 if name.endswith("world3") else 2)
        groups = load_restricted_optim(name)["fp32_flat_groups" if meta["stage"] == 3 else
                                             "single_partition_of_fp32_groups"]
        assert len(groups) == (3 if name.endswith("subgroups") else 1), (name, len(groups))
        assert len(list((FIXTURES / name / "global_step2").glob("*_optim_states.pt"))) == meta["world_size"]


def load_restricted_optim(name) -> dict:
    return dsc.load_restricted(next((FIXTURES / name / "global_step2").glob("*rank_0_*optim_states.pt")))[
        "optimizer_state_dict"]


@pytest.mark.parametrize("name", CHECKPOINTS)
def test_reader_equals_deepspeeds_zero_to_fp32(name):
    stage = int(name[5])
    got = ds_merge.deepspeed_fp32_state_dict(FIXTURES / name)
    assert not mismatches(got, expected(name))
    assert got["head.weight"] is got["emb.weight"], "a tied weight must stay one tensor, as DeepSpeed returns it"
    assert got["emb.weight"].dtype == torch.float32
    assert ("frozen.weight" in got) == (stage >= 2)   # DeepSpeed stores frozen weights from stage 2 on


def test_the_tag_folder_itself():
    got = ds_merge.deepspeed_fp32_state_dict(FIXTURES / "stage3" / "global_step2")
    assert not mismatches(got, expected(3))


@pytest.mark.parametrize("stage", STAGES)
def test_explicit_tag_and_excluding_frozen(stage):
    got = ds_merge.deepspeed_fp32_state_dict(FIXTURES / f"stage{stage}", tag="global_step2",
                                        exclude_frozen_parameters=True)
    want = {k: v for k, v in expected(stage).items() if k != "frozen.weight"}
    assert not mismatches(got, want)


def test_is_deepspeed_checkpoint(tmp_path):
    for s in STAGES:
        assert dsc.is_deepspeed_checkpoint(FIXTURES / f"stage{s}")
        assert dsc.is_deepspeed_checkpoint(FIXTURES / f"stage{s}" / "global_step2")
    assert not dsc.is_deepspeed_checkpoint(tmp_path)
    assert not dsc.is_deepspeed_checkpoint(tmp_path / "missing")
    (tmp_path / "t").mkdir()   # rank-file names, but not DeepSpeed's content
    torch.save({"a": torch.ones(2)}, tmp_path / "t" / "zero_pp_rank_0_mp_rank_00_optim_states.pt")
    torch.save({"b": torch.ones(2)}, tmp_path / "t" / "mp_rank_00_model_states.pt")
    (tmp_path / "latest").write_text("t")
    assert not dsc.is_deepspeed_checkpoint(tmp_path)


def test_the_deepspeed_objects_become_plain_values():
    f = FIXTURES / "stage1" / "global_step2" / "bf16_zero_pp_rank_0_mp_rank_00_optim_states.pt"
    osd = dsc.load_restricted(f)["optimizer_state_dict"]
    assert osd["zero_stage"] == 1 and type(osd["zero_stage"]) is int
    assert type(osd["loss_scaler"]) is dict and osd["loss_scaler"]["cur_scale"] == 1.0
    assert osd["param_slice_mappings"][0]["emb.weight"] == {"numel": 21, "start": 0}


# ---------------------------------------------------------------- untrusted files
def rewrite_pickle(path: Path, payload: bytes) -> None:
    """Replace the data.pkl inside a torch zip checkpoint by ``payload`` (the tensors stay)."""
    with zipfile.ZipFile(path) as z:
        entries = [(info, z.read(info.filename)) for info in z.infolist()]
    with zipfile.ZipFile(path, "w") as z:
        for info, data in entries:
            z.writestr(info, payload if info.filename.endswith("data.pkl") else data)


class Evil:
    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


@pytest.mark.parametrize("protocol", [2, 4])   # GLOBAL, and STACK_GLOBAL with memoized names
def test_malicious_pickle_is_refused_naming_the_class(ckpt, tmp_path, protocol):
    d = ckpt(2)
    marker = tmp_path / "pwned"
    victim = d / "global_step2" / "bf16_zero_pp_rank_1_mp_rank_00_optim_states.pt"
    rewrite_pickle(victim, pickle.dumps({"optimizer_state_dict": Evil(marker)}, protocol=protocol))
    with pytest.raises(dsc.UnsafeCheckpointError) as e:
        ds_merge.deepspeed_fp32_state_dict(d)
    msg = str(e.value)
    assert "posix.system" in msg or "nt.system" in msg, msg
    assert victim.name in msg and "refusing" in msg
    assert not marker.exists(), "the payload ran"


def test_torchs_restricted_unpickler_still_refuses_when_the_scan_is_bypassed(ckpt, tmp_path, monkeypatch):
    """Planted bug: the pre-scan lets everything through; torch's weights_only unpickler is the second wall."""
    d = ckpt(1)
    marker = tmp_path / "pwned"
    rewrite_pickle(d / "global_step2" / "mp_rank_00_model_states.pt", pickle.dumps(Evil(marker), protocol=2))
    monkeypatch.setattr(dsc, "pickle_globals", lambda path: [])
    with pytest.raises(dsc.UnsafeCheckpointError, match="mp_rank_00_model_states.pt"):
        ds_merge.deepspeed_fp32_state_dict(d)
    assert not marker.exists()


# ---------------------------------------------------------------- broken checkpoints name the problem
def test_missing_rank_file(ckpt):
    d = ckpt(2)
    (d / "global_step2" / "bf16_zero_pp_rank_1_mp_rank_00_optim_states.pt").unlink()
    with pytest.raises(ValueError, match="saved by 2 ranks but 1 '\\*_optim_states.pt' files"):
        ds_merge.deepspeed_fp32_state_dict(d)


def test_truncated_file(ckpt):
    d = ckpt(3)
    f = d / "global_step2" / "bf16_zero_pp_rank_0_mp_rank_00_optim_states.pt"
    f.write_bytes(f.read_bytes()[:1000])
    with pytest.raises(ValueError, match=f"{f.name}.*(corrupt|cannot read)"):
        ds_merge.deepspeed_fp32_state_dict(d)


def test_files_from_two_checkpoints(ckpt):
    d1, d3 = ckpt(1), ckpt(3)
    for f in (d1 / "global_step2").glob("*_optim_states.pt"):
        f.unlink()
    for f in (d3 / "global_step2").glob("*_optim_states.pt"):
        shutil.copy(f, d1 / "global_step2")
    with pytest.raises(ValueError, match="stage 3 keeps one model-state file per rank: 2 expected, 1 found"):
        ds_merge.deepspeed_fp32_state_dict(d1)


def test_shapes_that_do_not_fit_the_partitions(ckpt):
    """The model-state file of another model (one more parameter) with this model's optimizer files."""
    d = ckpt(2)
    f = d / "global_step2" / "mp_rank_00_model_states.pt"
    sd = dsc.load_restricted(f)
    sd["param_shapes"][0]["extra.weight"] = torch.Size([5, 5])
    torch.save(sd, f)
    with pytest.raises(ValueError, match="group 0: the model-state file lists 7 parameters.*do not match"):
        ds_merge.deepspeed_fp32_state_dict(d)


def test_no_latest_and_unknown_tag(tmp_path, ckpt):
    with pytest.raises(FileNotFoundError, match="no 'latest' file"):
        ds_merge.deepspeed_fp32_state_dict(tmp_path)
    with pytest.raises(FileNotFoundError, match="no directory for tag 'global_step9'"):
        ds_merge.deepspeed_fp32_state_dict(ckpt(1), tag="global_step9")


# ---------------------------------------------------------------- the comparison can fail
@pytest.mark.parametrize("name", CHECKPOINTS)
def test_planted_rank_order_swap_is_caught(name, monkeypatch):
    real = dsc.checkpoint_files
    monkeypatch.setattr(ds_merge, "checkpoint_files", lambda d: (real(d)[0], real(d)[1][::-1]))
    try:
        got = ds_merge.deepspeed_fp32_state_dict(FIXTURES / name)
    except ValueError:
        return
    assert mismatches(got, expected(name))


def test_alignment_paddings_and_uneven_partitions():
    """DeepSpeed 0.19 on CPU wrote zero alignment paddings in the fixtures, so the rule is checked here by
    hand: group = a (3) + 1 padding + b (2), cut 4 | 2 between two ranks (uneven, as the 3-rank fixtures)."""
    flat = torch.tensor([1., 2., 3., 0., 4., 5.])
    parts = [[flat[:4]], [flat[4:]]]
    shapes = [{"a": torch.Size([3]), "b": torch.Size([2])}]
    out = {}
    ds_merge.merge_stage12(out, parts, shapes, [[1, 0]], world=2)
    assert out["a"].tolist() == [1., 2., 3.] and out["b"].tolist() == [4., 5.]
    out = {}
    ds_merge.merge_stage12(out, parts, shapes, None, world=2)        # planted: the padding ignored
    assert out["b"].tolist() != [4., 5.]


@pytest.mark.parametrize("name", ["stage3", "stage3_world3", "stage3_subgroups"])
def test_planted_stage3_floor_pieces_are_caught(name, monkeypatch):
    monkeypatch.setattr(ds_merge, "stage3_piece", lambda numel, world: numel // world)
    with pytest.raises(ValueError, match="do not match"):
        ds_merge.deepspeed_fp32_state_dict(FIXTURES / name)


# ---------------------------------------------------------------- live, where DeepSpeed is installed
@pytest.mark.parametrize("name", CHECKPOINTS)
def test_live_against_deepspeed(name, tmp_path, capsys):
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    z2f = pytest.importorskip("deepspeed.utils.zero_to_fp32")
    d = tmp_path / name
    shutil.copytree(FIXTURES / name, d)
    theirs = z2f.get_fp32_state_dict_from_zero_checkpoint(str(d))
    ours = ds_merge.deepspeed_fp32_state_dict(d)
    assert not mismatches(ours, theirs)
    assert not mismatches(ours, expected(name))


def _save_a_zerolab_checkpoint(path):
    import zerolab as zl
    from zerolab.book.models import MLP
    engine = zl.initialize(MLP(), {"train_micro_batch_size_per_gpu": 2, "zero_optimization": {"stage": 2},
                                   "optimizer": {"type": "Adam", "params": {"lr": 1e-3}}})
    engine.save_checkpoint(path)


def test_a_zerolab_checkpoint_is_not_deepspeeds(tmp_path):
    """zerolab's own files (zerolab_rank_*_optim.pt, none of DeepSpeed's names): not taken for DeepSpeed's."""
    from zerolab.runtime.launch import launch
    launch(_save_a_zerolab_checkpoint, 2, args=(str(tmp_path),), timeout=60)
    assert list(tmp_path.glob("*/zerolab_rank_1_optim.pt")) and not list(tmp_path.glob("*/*_states.pt"))
    assert not dsc.is_deepspeed_checkpoint(tmp_path)
    with pytest.raises(FileNotFoundError, match="not a DeepSpeed ZeRO checkpoint"):
        ds_merge.deepspeed_fp32_state_dict(tmp_path)


@pytest.mark.parametrize("name", CHECKPOINTS)
def test_consolidate_dispatches_to_the_reader(name):
    from zerolab.engine.checkpoint.consolidate import consolidate_fp32
    assert not mismatches(consolidate_fp32(FIXTURES / name), expected(name))


def test_cli_consolidate_reads_deepspeed(tmp_path):
    import subprocess
    import sys
    out = tmp_path / "model.pt"
    run = subprocess.run([sys.executable, "-m", "zerolab", "consolidate", str(FIXTURES / "stage3_world3"), str(out)],
                         capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr
    assert not mismatches(torch.load(out, weights_only=True), expected("stage3_world3"))
    evil = tmp_path / "evil"
    shutil.copytree(FIXTURES / "stage2", evil)
    rewrite_pickle(evil / "global_step2" / "bf16_zero_pp_rank_1_mp_rank_00_optim_states.pt",
                   pickle.dumps({"optimizer_state_dict": Evil(tmp_path / "pwned")}, protocol=2))
    run = subprocess.run([sys.executable, "-m", "zerolab", "consolidate", str(evil), str(tmp_path / "o.pt")],
                         capture_output=True, text=True, timeout=120)
    assert run.returncode != 0 and "Traceback" not in run.stderr, run.stderr
    assert "refusing to load" in run.stderr and "system" in run.stderr, run.stderr
    assert not (tmp_path / "pwned").exists() and not (tmp_path / "o.pt").exists()


def test_load_checkpoint_of_another_models_deepspeed_folder_names_the_parameter(tmp_path):
    """engine.load_checkpoint resumes from DeepSpeed's files (tests/test_ds_checkpoint_resume.py); a
    model that does not match them gets the parameter named, not a missing manifest."""
    from zerolab.book.models import MLP
    from zerolab.engine.checkpoint.files import CheckpointError
    engine = zl.initialize(MLP(seed=0), {"optimizer": {"type": "Adam", "params": {"lr": 1e-3}},
                                         "zero_optimization": {"stage": 1}})
    with pytest.raises(CheckpointError, match="is not in the checkpoint.*saved from another model"):
        engine.load_checkpoint(str(FIXTURES / CHECKPOINTS[0]))
