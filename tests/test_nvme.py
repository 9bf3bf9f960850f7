"""NVMe swap files (issue 6, item 3): real I/O, unlinked files, bad paths, full disks, tmpfs."""
from __future__ import annotations

import errno
import os
import signal
import subprocess
import sys
import textwrap

import pytest
import torch

import zerolab as zl
from zerolab.engine.offload import nvme
from zerolab.engine.offload.nvme import ChunkStore, MappedFile, NVMeError, SwapFile
from zerolab.book.models import TinyGPT, loss_fn, synthetic_batch


def cfg_for(path, stage=2, device="nvme", bf16=True):
    cfg = {"optimizer": {"type": "Adam", "params": {"lr": 3e-3}}, "gradient_clipping": 0.3,
           "zero_optimization": {"stage": stage, "sub_group_size": 4000,
                                 "offload_optimizer": {"device": device, "nvme_path": str(path)}}}
    if bf16:
        cfg["bf16"] = {"enabled": True}
    return cfg


def train(engine, model, steps, start=0):
    for s in range(start, start + steps):
        x, y = synthetic_batch(model, 2, seed=7, step=s)
        engine.backward(loss_fn(engine(x), y))
        engine.step()


@pytest.mark.parametrize("buffer_count", [1, 2, 4])
def test_chunk_store_round_trip(tmp_path, buffer_count):
    sizes = [5000, 10, 3000, 7000, 1]
    store = ChunkStore(str(tmp_path), sizes, buffer_count=buffer_count)
    data = [torch.randn(n) for n in sizes]
    for i, d in enumerate(data):
        store.write_now(i, d)
    assert store.staging_bytes() == buffer_count * max(sizes) * 4
    seen = []
    for i, buf in store.stream(range(len(sizes))):   # read, modify in place, written behind
        assert torch.equal(buf, data[i])
        buf.mul_(2)
        seen.append(i)
    assert seen == list(range(len(sizes)))
    for i, d in enumerate(data):
        assert torch.equal(store.read_now(i), 2 * d)
    assert os.listdir(tmp_path) == []               # unlinked at creation
    store.close()


def test_swap_file_is_unlinked_but_open(tmp_path):
    f = SwapFile(str(tmp_path), 1 << 16, "t")
    assert os.listdir(tmp_path) == []
    target = os.readlink(f"/proc/self/fd/{f.fd}")
    assert target.startswith(str(tmp_path)) and target.endswith("(deleted)")
    assert os.fstat(f.fd).st_size == 1 << 16         # blocks reserved up front (posix_fallocate)
    x = torch.arange(1000, dtype=torch.float32)
    f.write(x, 4096)
    y = torch.empty(1000)
    f.read(y, 4096)
    assert torch.equal(x, y)
    f.close()


def test_mapped_file_release_keeps_data(tmp_path):
    m = MappedFile(str(tmp_path), 1 << 20)
    t = m.tensor(torch.bfloat16, (1 << 19))
    t.copy_(torch.arange(1 << 19).to(torch.bfloat16))
    want = t.clone()
    m.release()                                        # written back, pages dropped
    assert torch.equal(t, want)
    del t
    m.close()


def test_engine_leaves_no_files_even_when_killed(tmp_path):
    script = textwrap.dedent(f"""
        import sys, time, torch, zerolab as zl
        from zerolab.book.models import TinyGPT, loss_fn, synthetic_batch
        m = TinyGPT.preset("micro", seed=1)
        cfg = {cfg_for(tmp_path)!r}
        cfg["zero_optimization"]["stage"] = 3
        cfg["zero_optimization"]["offload_param"] = {{"device": "nvme", "nvme_path": {str(tmp_path)!r}}}
        e = zl.initialize(m, cfg)
        x, y = synthetic_batch(m, 2)
        e.backward(loss_fn(e(x), y)); e.step()
        print("ready", flush=True)
        time.sleep(60)
    """)
    p = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True)
    try:
        assert p.stdout.readline().strip() == "ready"
        fds = [os.readlink(f"/proc/{p.pid}/fd/{fd}") for fd in os.listdir(f"/proc/{p.pid}/fd")]
        swaps = [f for f in fds if f.startswith(str(tmp_path))]
        # optimizer + params (Python's mmap holds a dup of the params descriptor)
        assert len(set(swaps)) == 2 and all(f.endswith("(deleted)") for f in swaps), fds
        assert os.listdir(tmp_path) == []
    finally:
        p.send_signal(signal.SIGKILL)
        p.wait()
    assert os.listdir(tmp_path) == []


def test_missing_or_bad_path_is_a_config_error(tmp_path):
    with pytest.raises(zl.ConfigError, match="nvme_path .* does not exist"):
        zl.initialize(TinyGPT.preset("micro", seed=1), cfg_for(tmp_path / "nope"))
    (tmp_path / "file").write_text("x")
    with pytest.raises(zl.ConfigError, match="not a directory"):
        zl.initialize(TinyGPT.preset("micro", seed=1), cfg_for(tmp_path / "file"))


def test_unwritable_path_is_a_clear_error(tmp_path, monkeypatch):
    def denied(*a, **k):
        raise PermissionError(errno.EACCES, "Permission denied")
    monkeypatch.setattr(nvme.tempfile, "mkstemp", denied)   # root ignores chmod: inject the refusal
    with pytest.raises(NVMeError, match="cannot create a swap file .* must be writable") as e:
        zl.initialize(TinyGPT.preset("micro", seed=1), cfg_for(tmp_path))
    assert e.value.errno == errno.EACCES


def test_full_disk_at_initialize(tmp_path, monkeypatch):
    def full(fd, off, n):
        raise OSError(errno.ENOSPC, "No space left on device")
    monkeypatch.setattr(nvme.os, "posix_fallocate", full)
    with pytest.raises(NVMeError, match="disk is full") as e:
        zl.initialize(TinyGPT.preset("micro", seed=1), cfg_for(tmp_path))
    assert e.value.errno == errno.ENOSPC
    assert os.listdir(tmp_path) == []


def test_full_disk_mid_training_keeps_state(tmp_path, monkeypatch):
    """A write that fails with ENOSPC: a clear error, the step still completes, the new state
    stays in RAM and is written later; training then ends where the run without failure ends."""
    ref_model = TinyGPT.preset("micro", key_bias=False, seed=1)
    ref = zl.initialize(ref_model, cfg_for(tmp_path, device="none"))
    train(ref, ref_model, 4)
    want = ref.full_state_dict()

    model = TinyGPT.preset("micro", key_bias=False, seed=1)
    engine = zl.initialize(model, cfg_for(tmp_path))
    train(engine, model, 1)
    real_write, calls = SwapFile.write, []

    def flaky(self, t, offset):
        calls.append(offset)
        if len(calls) in (2, 3):
            raise OSError(errno.ENOSPC, "No space left on device")
        return real_write(self, t, offset)
    monkeypatch.setattr(SwapFile, "write", flaky)
    with pytest.raises(NVMeError, match="No space left.*2 of .* units. The step completed") as e:
        train(engine, model, 1, start=1)
    assert e.value.errno == errno.ENOSPC
    assert engine.memory().buffers > 0 and len(engine.optimizer.store.dirty) == 2   # held in RAM
    monkeypatch.setattr(SwapFile, "write", real_write)
    train(engine, model, 2, start=2)
    assert engine.optimizer.store.dirty == {}
    got = engine.full_state_dict()
    assert max((got[k] - want[k]).abs().max().item() for k in want) <= 1e-5


def test_tmpfs_warns():
    if nvme.filesystem_type("/dev/shm") != "tmpfs":
        pytest.skip("/dev/shm is not tmpfs here")
    with pytest.warns(UserWarning, match="tmpfs: that is RAM"):
        nvme.check_nvme_path("/dev/shm", "zero_optimization.offload_optimizer")
