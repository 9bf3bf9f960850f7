"""Robustness found in review (issue 16, point 6).

A failed ``zl.initialize`` leaves the model untouched (a retry works); a failed NVMe
read mid-step makes every rank raise (none waits for the others); ``zl.launch``'s
``timeout`` is the whole run's and ``collective_timeout`` torch.distributed's; stage 3
trains under non-reentrant activation checkpointing like plain torch does.
"""
from __future__ import annotations

import errno
import time

import pytest
import torch
import torch.distributed as dist
import torch.utils.checkpoint as cp
from torch import nn

import zerolab as zl
from zerolab.engine import ModelSnapshot
from zerolab.engine.offload import nvme
from zerolab.engine.offload.nvme import NVMeError, SwapFile
from zerolab.book.models import TinyGPT, loss_fn, synthetic_batch


def gpt_config(stage=1, bf16=True, **zero):
    cfg = {"optimizer": {"type": "Adam", "params": {"lr": 3e-3}},
           "zero_optimization": {"stage": stage, "sub_group_size": 4000, **zero}}
    if bf16:
        cfg["bf16"] = {"enabled": True}
    return cfg


def train(engine, model, steps):
    for s in range(steps):
        x, y = synthetic_batch(model, 2, seed=7, step=s)
        engine.backward(loss_fn(engine(x), y))
        engine.step()
    return engine.full_state_dict()


def picture(model):
    """Everything a failed initialize must leave as it was."""
    return {"params": [(n, p, p.data_ptr(), p.dtype, p.requires_grad, p.detach().clone())
                       for n, p in model.named_parameters()],
            "buffers": [(n, b, b.dtype, b.detach().clone()) for n, b in model.named_buffers()],
            "hooks": sum(len(m._forward_pre_hooks) + len(m._forward_hooks) for m in model.modules()),
            "grad_hooks": sum(len(getattr(p, "_post_accumulate_grad_hooks", None) or {}) for p in model.parameters()),
            "marked": any(hasattr(p, "_zerolab_engine") for p in model.parameters())}


def assert_same_picture(before, after):
    assert [(n, id(p), ptr, dt, rg) for n, p, ptr, dt, rg, _ in before["params"]] == \
        [(n, id(p), ptr, dt, rg) for n, p, ptr, dt, rg, _ in after["params"]], "parameters replaced or moved"
    for (n, _, _, _, _, v), (_, p, _, _, _, _) in zip(before["params"], after["params"]):
        assert torch.equal(p.detach(), v), f"{n} changed"
    for (n, b0, dt0, v), (_, b1, dt1, _) in zip(before["buffers"], after["buffers"]):
        assert b0 is b1 and dt0 == dt1 and torch.equal(b1, v), f"buffer {n} changed"
    assert after["hooks"] == before["hooks"] and after["grad_hooks"] == before["grad_hooks"] == 0
    assert not after["marked"]


def failing_configs(tmp_path):
    (tmp_path / "file").write_text("x")
    return {"stage 1, nvme_path is a file": gpt_config(1, offload_optimizer={"device": "nvme",
                                                                             "nvme_path": str(tmp_path / "file")}),
            "stage 3, offload_param nvme_path missing": gpt_config(3, offload_param={
                "device": "nvme", "nvme_path": str(tmp_path / "nope")}, stage3_param_persistence_threshold=0),
            "stage 3, optimizer nvme_path is a file": gpt_config(3, offload_optimizer={
                "device": "nvme", "nvme_path": str(tmp_path / "file")}, stage3_param_persistence_threshold=0)}


def check_failed_initialize_then_retry(tmp_path):
    want = train(*(lambda m: (zl.initialize(m, gpt_config(2)), m))(TinyGPT.preset("micro", key_bias=False, seed=1)), 2)
    for label, bad in failing_configs(tmp_path).items():
        model = TinyGPT.preset("micro", key_bias=False, seed=1)
        before = picture(model)
        with pytest.raises((zl.ConfigError, NVMeError)):
            zl.initialize(model, bad)
        assert_same_picture(before, picture(model))
        got = train(zl.initialize(model, gpt_config(2)), model, 2)   # the retry
        for k in want:
            assert torch.equal(got[k], want[k]), (label, k)


def test_failed_initialize_leaves_the_model_untouched_and_a_retry_works(tmp_path):
    check_failed_initialize_then_retry(tmp_path)


def test_planted_no_restore_is_caught(tmp_path, monkeypatch):
    monkeypatch.setattr(ModelSnapshot, "restore", lambda self: None)
    with pytest.raises(AssertionError):
        check_failed_initialize_then_retry(tmp_path)


def nvme_read_fails_on_rank1(path, stage, planted=False):
    """Rank 1's third optimizer step cannot read its state; every rank must raise NVMeError.
    ``planted``: the ranks do not agree first (the failing rank raises alone)."""
    rank = dist.get_rank()
    if planted:
        from zerolab.engine.offload.optimizer_mixin import OffloadMixin

        def alone(self):
            if self.optimizer.read_error is not None:
                raise self.optimizer.read_error
            super(OffloadMixin, self).after_update()
        OffloadMixin.after_update = alone
    model = TinyGPT.preset("micro", key_bias=False, seed=1)
    engine = zl.initialize(model, gpt_config(stage, offload_optimizer={"device": "nvme", "nvme_path": path},
                                             stage3_param_persistence_threshold=0))
    real = SwapFile.read

    def failing(self, t, offset):
        if engine.optimizer.step_count == 3 and rank == 1:
            raise OSError(errno.EIO, "Input/output error")
        return real(self, t, offset)
    SwapFile.read = failing
    try:
        for s in range(5):
            x, y = synthetic_batch(model, 4, seed=7, step=s, rank=rank, world_size=2)
            engine.backward(loss_fn(engine(x), y))
            engine.step()
    except NVMeError as e:
        return engine.optimizer.step_count, e.errno, str(e)
    return engine.optimizer.step_count, None, "no error"


@pytest.mark.parametrize("stage", [1, 3])
def test_failed_nvme_read_mid_step_raises_on_every_rank(tmp_path, stage):
    t0 = time.monotonic()
    results = zl.launch(nvme_read_fails_on_rank1, world_size=2, args=(str(tmp_path), stage), timeout=60, threads=1)
    assert time.monotonic() - t0 < 30
    (s0, e0, m0), (s1, e1, m1) = results
    assert (s0, s1, e0, e1) == (3, 3, errno.EIO, errno.EIO), results
    assert "reading the optimizer state from NVMe failed at step 3" in m1
    assert "rank 1 failed to read its optimizer state from NVMe at step 3" in m0


def test_planted_rank_raising_alone_is_caught(tmp_path):
    """Without the agreement, rank 0 waits in the all-gather for a rank that has left."""
    t0 = time.monotonic()
    try:
        results = zl.launch(nvme_read_fails_on_rank1, world_size=2, args=(str(tmp_path), 1, True), timeout=60,
                            collective_timeout=5, threads=1)
    except zl.LaunchError:
        results = None
    assert time.monotonic() - t0 < 30
    assert results is None or "rank 1 failed to read" not in results[0][2]


def late_rank(delay):
    if dist.get_rank() == 1:
        time.sleep(delay)
    dist.all_reduce(torch.ones(1))
    return dist.get_rank()


def test_collective_timeout_is_separate_from_the_run_timeout():
    assert zl.launch(late_rank, world_size=2, args=(3,), timeout=60, collective_timeout=30, threads=1) == [0, 1]
    t0 = time.monotonic()
    with pytest.raises(zl.LaunchError) as e:
        zl.launch(late_rank, world_size=2, args=(20,), timeout=60, collective_timeout=2, threads=1)
    assert time.monotonic() - t0 < 15, "the collective should time out after 2 s, not at the run's 60 s"
    assert "timed out after" not in str(e.value)   # a rank raised: not the whole-run timeout
    with pytest.raises(ValueError, match="collective_timeout"):
        zl.launch(late_rank, world_size=2, args=(0,), collective_timeout=0)


class CheckpointedMLP(nn.Module):
    """Residual blocks, each run under torch.utils.checkpoint (non-reentrant)."""

    def __init__(self, d=16, depth=3, seed=5):
        super().__init__()
        torch.manual_seed(seed)
        self.blocks = nn.ModuleList(nn.Sequential(nn.Linear(d, 2 * d), nn.Tanh(), nn.Linear(2 * d, d))
                                    for _ in range(depth))
        self.head = nn.Linear(d, 4)

    def forward(self, x):
        for b in self.blocks:
            x = x + cp.checkpoint(b, x, use_reentrant=False)
        return self.head(x)


def batch(step, n_rows):
    g = torch.Generator().manual_seed(100 + step)
    return torch.randn(n_rows, 16, generator=g), torch.randn(n_rows, 4, generator=g)


def checkpointed_stage3(steps):
    rank, n = dist.get_rank(), dist.get_world_size()
    model = CheckpointedMLP()
    engine = zl.initialize(model, {"optimizer": {"type": "Adam", "params": {"lr": 1e-2}}, "zero_optimization": {
        "stage": 3, "stage3_param_persistence_threshold": 0, "reduce_bucket_size": 500}})
    for s in range(steps):
        x, y = batch(s, 2 * n)
        out = engine(x[2 * rank: 2 * rank + 2])
        engine.backward(nn.functional.mse_loss(out, y[2 * rank: 2 * rank + 2]))
        engine.step()
    return engine.full_state_dict(), len(engine.flat.units)


def test_stage3_with_non_reentrant_checkpointing_matches_plain_torch():
    steps = 4
    results = zl.launch(checkpointed_stage3, world_size=2, args=(steps,), timeout=120, threads=1)
    model = CheckpointedMLP()
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    for s in range(steps):
        x, y = batch(s, 4)
        opt.zero_grad()
        nn.functional.mse_loss(model(x), y).backward()
        opt.step()
    for sd, units in results:
        assert units > 1
        for k, w in model.state_dict().items():
            torch.testing.assert_close(sd[k], w, rtol=0, atol=1e-5, msg=lambda m: f"{k}: {m}")
