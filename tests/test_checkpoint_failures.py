"""Checkpoints appear whole or not at all, and bad ones are named, never unpickled blindly (issue 11, item 4).

* A rank SIGKILLed as the save begins, or halfway through writing its file:
  ``latest`` still names the previous tag, that tag loads, the half-written
  folder is never taken for a checkpoint (loading its tag says so).
* A full disk: the rank's file is opened on ``/dev/full``, so its writes fail
  with the kernel's own ENOSPC; every rank raises the same clear error, the
  partial folder is removed and the previous checkpoint is intact.
* Corrupted, truncated, missing files, a manifest of another model, a file
  that would need unpickling code: a ``CheckpointError`` naming the file and
  the expected vs found value, on every rank, with no hang.
* Saving inside an accumulation window, a client_state that would not load
  back, and loading a folder without a checkpoint.
"""
from __future__ import annotations

import json
import os
import signal

import pytest
import torch

import zerolab as zl
from zerolab.book.models import MLP, TinyGPT, loss_fn, synthetic_batch
from zerolab.engine.checkpoint.files import CheckpointError, optim_file
from zerolab.runtime.collect import LaunchError

CFG = {"optimizer": {"type": "Adam", "params": {"lr": 1e-3}}, "bf16": {"enabled": True},
       "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 100}}


def build(seed=1, cfg=CFG):
    model = TinyGPT.preset("micro", seed=seed)
    return model, zl.initialize(model, cfg)


def step(engine, model, i):
    x, y = synthetic_batch(model, 2 * engine.world_size, step=i, rank=engine.rank, world_size=engine.world_size)
    engine.backward(loss_fn(engine(x), y))
    engine.step()


def save_then_die(root, when):
    """Save tag a, then die on rank 1 while saving tag b (at the start, or mid-write)."""
    import zerolab.engine.checkpoint.save as ck
    import zerolab.engine.checkpoint.files as io
    model, engine = build()
    step(engine, model, 0)
    engine.save_checkpoint(root, tag="a")
    step(engine, model, 1)
    if engine.rank == 1 and when == "begin":
        ck.write_checked = lambda obj, path: os.kill(os.getpid(), signal.SIGKILL)
    if engine.rank == 1 and when == "mid-write":
        real_open = io.open_for_write

        class Dying:   # the real file; the process dies once half of it is written
            def __init__(self, path):
                self.f = real_open(path)
                self.n = 0

            def write(self, data):
                self.n += len(memoryview(data).cast("B"))
                if self.n > 20_000:
                    self.f.flush()
                    os.kill(os.getpid(), signal.SIGKILL)
                return self.f.write(data)

            def __getattr__(self, k):
                return getattr(self.f, k)

            def __enter__(self):
                return self

            def __exit__(self, *a):
                self.f.close()
        io.open_for_write = Dying
    engine.save_checkpoint(root, tag="b")


def load_latest(root, tag=None):
    model, engine = build(seed=7)
    try:
        path, client = engine.load_checkpoint(root, tag=tag)
    except CheckpointError as e:
        return ("error", str(e))
    return (os.path.basename(path), engine.global_steps)


@pytest.mark.parametrize("when", ["begin", "mid-write"])
def test_rank_killed_during_save_leaves_previous_checkpoint(tmp_path, when):
    root = str(tmp_path)
    with pytest.raises(LaunchError):   # rank 1 died (or rank 0 saw its connection drop first)
        zl.launch(save_then_die, world_size=2, args=(root, when), timeout=120, threads=1)
    assert open(os.path.join(root, "latest")).read().strip() == "a"
    assert not os.path.exists(os.path.join(root, "b"))
    if when == "mid-write":   # the half-written file is there, in the folder nobody reads
        assert os.path.getsize(os.path.join(root, ".b.tmp", optim_file(1))) > 0
    assert zl.launch(load_latest, world_size=2, args=(root,), threads=1) == [("a", 1)] * 2
    errors = zl.launch(load_latest, world_size=2, args=(root, "b"), threads=1)
    for kind, msg in errors:
        assert kind == "error" and "did not finish" in msg and "'b'" in msg, msg


def disk_full(root):
    import zerolab.engine.checkpoint.files as io
    model, engine = build()
    step(engine, model, 0)
    engine.save_checkpoint(root, tag="a")
    step(engine, model, 1)
    if engine.rank == 1:
        io.open_for_write = lambda path: open("/dev/full", "wb")
    try:
        engine.save_checkpoint(root, tag="b")
    except CheckpointError as e:
        return str(e)
    return "no error"


@pytest.mark.skipif(not os.path.exists("/dev/full"), reason="needs /dev/full")
def test_disk_full_raises_on_every_rank_and_keeps_previous(tmp_path):
    root = str(tmp_path)
    msgs = zl.launch(disk_full, world_size=2, args=(root,), timeout=120, threads=1)
    for m in msgs:
        assert "rank 1" in m and "disk is full" in m and "'latest' still names 'a'" in m, m
    assert sorted(os.listdir(root)) == ["a", "latest"]
    assert zl.launch(load_latest, world_size=2, args=(root,), threads=1) == [("a", 1)] * 2


def save_two_ranks(root):
    model, engine = build()
    step(engine, model, 0)
    engine.save_checkpoint(root, tag="a")


def spoil(root, how):
    tag = os.path.join(root, "a")
    f = os.path.join(tag, optim_file(1))
    if how == "corrupt":
        with open(f, "r+b") as fh:
            fh.seek(os.path.getsize(f) // 2)
            b = fh.read(1)
            fh.seek(-1, 1)
            fh.write(bytes([b[0] ^ 0xFF]))
    elif how == "truncated":
        os.truncate(f, os.path.getsize(f) - 100)
    elif how == "missing":
        os.remove(f)
    elif how in ("code", "wrong-length"):   # well-formed files, consistent with the manifest
        if how == "code":   # ... whose unpickling would import a class: refused
            torch.save({"state": {"fp32": torch.zeros(3)}, "evil": MLP()}, f)
        else:               # ... whose shard has the wrong number of elements
            torch.save({"state": {k: torch.zeros(3) for k in ("fp32", "exp_avg", "exp_avg_sq")}}, f)
        m = json.load(open(os.path.join(tag, "manifest.json")))
        from zerolab.engine.checkpoint.files import sha256_of
        m["files"][optim_file(1)].update(bytes=os.path.getsize(f), sha256=sha256_of(f))
        json.dump(m, open(os.path.join(tag, "manifest.json"), "w"))
    return f


@pytest.mark.parametrize("how,expect", [("corrupt", "sha256"), ("truncated", "bytes, expected"),
                                        ("missing", "missing"), ("code", "cannot be loaded"),
                                        ("wrong-length", "'fp32' is [3], expected [")])
def test_bad_rank_file_is_named_on_every_rank(tmp_path, how, expect):
    root = str(tmp_path)
    zl.launch(save_two_ranks, world_size=2, args=(root,), threads=1)
    f = spoil(root, how)
    for kind, msg in zl.launch(load_latest, world_size=2, args=(root,), timeout=120, threads=1):
        assert kind == "error" and os.path.basename(f) in msg and expect in msg, msg
        assert "Traceback" not in msg


def test_checkpoint_of_another_model_is_named(tmp_path):
    model, engine = build()
    step(engine, model, 0)
    engine.save_checkpoint(tmp_path)
    other = TinyGPT.preset("micro", d_model=48, seed=1)
    e2 = zl.initialize(other, CFG)
    with pytest.raises(CheckpointError, match=r"manifest.json: parameter '.*' has shape \[.*32\] in the "
                                              r"checkpoint, expected \[.*48\] \(the model's\)"):
        e2.load_checkpoint(tmp_path)
    mlp = zl.initialize(MLP(), CFG)
    with pytest.raises(CheckpointError, match="not in the checkpoint .* another model"):
        mlp.load_checkpoint(tmp_path)
    sgd = zl.initialize(TinyGPT.preset("micro", seed=3), {**CFG, "optimizer": {"type": "SGD", "params": {
        "lr": 0.1, "momentum": 0.9}}})
    with pytest.raises(CheckpointError, match="exp_avg.*momentum_buffer.*load_optimizer_states=False"):
        sgd.load_checkpoint(tmp_path)
    path, _ = sgd.load_checkpoint(tmp_path, load_optimizer_states=False)   # weights only: fine
    assert torch.equal(sgd.full_state_dict()["wte.weight"], engine.full_state_dict()["wte.weight"])


def test_manifest_garbage_is_named(tmp_path):
    model, engine = build()
    engine.save_checkpoint(tmp_path, tag="t")
    (tmp_path / "t" / "manifest.json").write_text("{not json")
    with pytest.raises(CheckpointError, match="manifest.json: cannot be read as JSON"):
        build(seed=3)[1].load_checkpoint(tmp_path)


def test_save_inside_accumulation_window_is_refused(tmp_path):
    model = TinyGPT.preset("micro", seed=1)
    engine = zl.initialize(model, {**CFG, "gradient_accumulation_steps": 2})
    x, y = synthetic_batch(model, 2)
    engine.backward(loss_fn(engine(x), y))
    engine.step()
    with pytest.raises(RuntimeError, match="inside an accumulation window of 2 micro-batches"):
        engine.save_checkpoint(tmp_path)
    assert not os.listdir(tmp_path)


def test_empty_dir_returns_none_with_warning(tmp_path):
    _, engine = build()
    with pytest.warns(UserWarning, match="no 'latest' file"):
        assert engine.load_checkpoint(tmp_path) == (None, None)


def test_client_state_round_trip_and_refusal(tmp_path):
    model, engine = build()
    step(engine, model, 0)
    with pytest.raises(ValueError, match=r"client_state\['sampler'\]: a object cannot be read back"):
        engine.save_checkpoint(tmp_path, client_state={"sampler": object()})
    rng = torch.get_rng_state()
    path = engine.save_checkpoint(tmp_path, client_state={"epoch": 3, "rng": rng})
    assert path.endswith("global_step1") and open(tmp_path / "latest").read().strip() == "global_step1"
    _, e2 = build(seed=4)
    got_path, client = e2.load_checkpoint(tmp_path)
    assert got_path == path and client["epoch"] == 3 and torch.equal(client["rng"], rng)


def test_checksum_is_what_catches_a_flipped_byte(tmp_path):
    """Planted: without the sha256 check, a flipped byte in tensor data loads silently."""
    from zerolab.engine.checkpoint.files import read_checked, read_manifest
    model, engine = build()
    step(engine, model, 0)
    engine.save_checkpoint(tmp_path, tag="a")
    tag = str(tmp_path / "a")
    good = read_checked(tag, optim_file(0), read_manifest(tag))["state"]["fp32"].clone()
    f = os.path.join(tag, optim_file(0))
    data = bytearray(open(f, "rb").read())
    at = data.find(good[:4].numpy().tobytes())   # inside the fp32 tensor's bytes
    data[at] ^= 0x40
    open(f, "wb").write(bytes(data))
    silent = read_checked(tag, optim_file(0), read_manifest(tag), verify=False)["state"]["fp32"]
    assert not torch.equal(silent, good)           # the file still unpickles: only the checksum sees it
    with pytest.raises(CheckpointError, match="sha256"):
        read_checked(tag, optim_file(0), read_manifest(tag))


def test_saving_a_tag_again_replaces_it_whole(tmp_path):
    model, engine = build()
    step(engine, model, 0)
    engine.save_checkpoint(tmp_path, tag="t")
    step(engine, model, 1)
    engine.save_checkpoint(tmp_path, tag="t")
    assert sorted(os.listdir(tmp_path)) == ["latest", "t"]
    _, e2 = build(seed=5)
    e2.load_checkpoint(tmp_path)
    assert e2.global_steps == 2
    assert torch.equal(e2.full_state_dict()["wte.weight"], engine.full_state_dict()["wte.weight"])


def test_load_flags_optimizer_and_schedule(tmp_path):
    """load_optimizer_states=False: weights only, a fresh optimizer; load_lr_scheduler_states=False:
    the schedule restarts at 0. Both default to True (every test above)."""
    cfg = {**CFG, "scheduler": {"type": "WarmupLR", "params": {"warmup_min_lr": 0.0, "warmup_max_lr": 1e-3,
                                                               "warmup_num_steps": 10}}}
    model, engine = build(cfg=cfg)
    for i in range(3):
        step(engine, model, i)
    engine.save_checkpoint(tmp_path)
    sched = engine.scheduler
    for opt_states, sched_states, want_lr, want_count in [(True, True, sched.lr(3), 3), (True, False, sched.lr(0), 3),
                                                          (False, True, sched.lr(3), 0), (False, False, sched.lr(0), 0)]:
        _, e2 = build(seed=8, cfg=cfg)
        e2.load_checkpoint(tmp_path, load_optimizer_states=opt_states, load_lr_scheduler_states=sched_states)
        assert e2.get_lr() == want_lr and e2.optimizer.step_count == want_count, (opt_states, sched_states)
        assert e2.global_steps == 3 and e2.scheduler.warmup_num_steps == 10
        moments_zero = all(not s.any() for s in e2.optimizer.state)
        assert moments_zero == (not opt_states)
        assert torch.equal(e2.full_state_dict()["wte.weight"], engine.full_state_dict()["wte.weight"])


def test_manifest_write_failing_keeps_previous(tmp_path, monkeypatch):
    """Rank 0's last steps (manifest, rename, latest) failing: a clear error, 'latest' untouched."""
    import errno as errno_
    import zerolab.engine.checkpoint.save as ck
    model, engine = build()
    engine.save_checkpoint(tmp_path, tag="a")

    def full(path, text):
        raise OSError(errno_.ENOSPC, os.strerror(errno_.ENOSPC))
    monkeypatch.setattr(ck, "write_text_atomic", full)
    with pytest.raises(CheckpointError, match="rank 0 could not finish .*'latest' still names 'a'"):
        engine.save_checkpoint(tmp_path, tag="b")
    assert sorted(os.listdir(tmp_path)) == ["a", "latest"]


def test_saving_a_tag_again_never_leaves_latest_naming_a_missing_folder(tmp_path, monkeypatch):
    """Re-saving tag "a" (which ``latest`` names) swaps the new folder in with one exchange: after every
    rename the save makes, "a" exists and holds a manifest (two renames — old away, new in — would
    leave a moment without it, and a reader following ``latest`` would find nothing)."""
    import zerolab.engine.checkpoint.files as files
    model, engine = build()
    step(engine, model, 0)
    engine.save_checkpoint(str(tmp_path), tag="a")
    final = tmp_path / "a"
    seen = []
    real_rename = os.rename

    def rename(src, dst):
        real_rename(src, dst)
        seen.append((dst, (final / "manifest.json").exists()))
    monkeypatch.setattr(files.os, "rename", rename)
    step(engine, model, 1)
    engine.save_checkpoint(str(tmp_path), tag="a")
    assert all(ok for _, ok in seen), seen
    assert sorted(os.listdir(tmp_path)) == ["a", "latest"]
    want = {k: v.clone() for k, v in engine.full_state_dict().items()}
    model2, engine2 = build(seed=2)
    engine2.load_checkpoint(str(tmp_path))
    assert all(torch.equal(want[k], v) for k, v in engine2.full_state_dict().items())
