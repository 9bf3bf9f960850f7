"""Configs real users have (issue 16, point 5): Hugging Face transformers' DeepSpeed test configs.

``tests/configs/hf_zero2_auto.json`` ("auto" everywhere the Trainer fills in) and
``hf_zero3_buckets0.json`` (``reduce_bucket_size`` and ``stage3_prefetch_bucket_size`` 0)
are read, warn once naming what was replaced, and train on 2 ranks to the parameters
of plain single-process training.
"""
from __future__ import annotations

import math
import pathlib
import warnings

import pytest
import torch
import torch.distributed as dist

import zerolab as zl
from zerolab.book.models import MLP, loss_fn, synthetic_batch
from zerolab.config import Config
from zerolab.config.schema import load_json

CONFIGS = pathlib.Path(__file__).parent / "configs"
STEPS, MBS = 3, 2


def read(path_or_dict):
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        cfg = Config.from_deepspeed(path_or_dict)
    return cfg, [str(w.message) for w in seen]


def test_hf_zero2_auto_one_warning_naming_every_key():
    cfg, seen = read(CONFIGS / "hf_zero2_auto.json")
    assert len(seen) == 1, seen
    replaced = ["fp16.enabled", "bf16.enabled", "optimizer.params.lr", "optimizer.params.betas",
                "optimizer.params.eps", "optimizer.params.weight_decay", "scheduler.params.warmup_min_lr",
                "scheduler.params.warmup_max_lr", "scheduler.params.warmup_num_steps",
                "gradient_accumulation_steps", "gradient_clipping", "train_batch_size",
                "train_micro_batch_size_per_gpu"]
    assert seen[0] == f'"auto" replaced by zerolab\'s defaults (zerolab.config.defaults) for: {", ".join(replaced)}'
    assert seen[0] in cfg.notes
    assert (cfg.zero.stage, cfg.precision, cfg.optimizer.type, cfg.optimizer.params, cfg.gradient_clipping) == \
        (2, "fp32", "adamw", {}, 0.0)
    assert cfg.zero.reduce_bucket_size == cfg.zero.allgather_bucket_size == 200_000_000
    assert cfg.zero.offload_optimizer.device == "cpu"


def test_hf_zero3_bucket_sizes_zero_are_accepted():
    cfg, seen = read(CONFIGS / "hf_zero3_buckets0.json")
    assert len(seen) == 1 and seen[0].startswith('"auto" replaced') and \
        "zero_optimization.stage3_param_persistence_threshold" in seen[0], seen
    z = cfg.zero
    assert (z.stage, z.reduce_bucket_size, z.stage3_prefetch_bucket_size) == (3, 0, 0)
    assert (z.offload_optimizer.device, z.offload_param.device) == ("cpu", "cpu")


def test_keys_without_effect_warn_when_not_default():
    cfg, seen = read({"zero_optimization": {"stage": 3, "contiguous_gradients": False, "offload_param": {
        "device": "cpu", "pin_memory": False, "buffer_size": 1e7}}})
    assert len(seen) == 1, seen
    for key in ("zero_optimization.contiguous_gradients=False", "zero_optimization.offload_param.pin_memory=False",
                "zero_optimization.offload_param.buffer_size=10000000"):
        assert key in seen[0]
    assert seen[0] in cfg.notes
    _, quiet = read({"zero_optimization": {"stage": 3, "contiguous_gradients": True, "offload_param": {
        "device": "cpu", "pin_memory": True, "buffer_size": 1e8}}})
    assert quiet == []


def train(path, zero_overrides):
    rank, n = dist.get_rank(), dist.get_world_size()
    model = MLP(depth=3, seed=3)
    raw = load_json(path)
    raw["zero_optimization"].update(zero_overrides)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        engine = zl.initialize(model, Config.from_deepspeed(raw))
    for step in range(STEPS):
        x, y = synthetic_batch(model, n * MBS, seed=7, step=step, rank=rank, world_size=n)
        engine.backward(loss_fn(engine(x), y))
        engine.step()
    info = {"buckets": len(engine.buckets), "units": len(engine.flat.units),
            "prefetch": getattr(engine, "prefetch_elements", None)}
    return engine.full_state_dict(), info


def reference(n, warmup):
    """Plain torch: AdamW with the defaults "auto" stands for (lr 1e-3, weight decay 0), no clipping;
    with ``warmup``, DeepSpeed's WarmupLR at its defaults (log warm-up from 0 to 1e-3 over 1000 steps),
    step for step as DeepSpeed's engine applies it (tests/test_engine_api.py checks that against DeepSpeed)."""
    model = MLP(depth=3, seed=3)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.0)
    for step in range(STEPS):
        if warmup:   # DeepSpeed's engine: step k + 1 runs at the scheduler's iteration k - 1 (-1: the minimum)
            opt.param_groups[0]["lr"] = 1e-3 * math.log(step) / math.log(1000) if step >= 1 else 0.0
        x, y = synthetic_batch(model, n * MBS, seed=7, step=step)
        opt.zero_grad()
        loss_fn(model(x), y).backward()
        opt.step()
    return model.state_dict()


@pytest.mark.parametrize("name,overrides", [("hf_zero2_auto.json", {}), ("hf_zero3_buckets0.json", {}),
                                            ("hf_zero3_buckets0.json", {"stage3_param_persistence_threshold": 0})])
def test_hf_configs_train_like_plain_torch(name, overrides):
    results = zl.launch(train, world_size=2, args=(str(CONFIGS / name), overrides), timeout=120, threads=1)
    want = reference(2, warmup="zero2" in name)
    for sd, info in results:
        for k, w in want.items():
            torch.testing.assert_close(sd[k], w, rtol=0, atol=1e-5, msg=lambda m: f"{name} {k}: {m}")
    info = results[0][1]
    if overrides:   # units partitioned: reduce_bucket_size 0 is one bucket per unit; prefetch off
        assert info["buckets"] == info["units"] > 1 and info["prefetch"] == 0, info
    elif "zero2" in name:
        assert info["buckets"] == 1, info   # 2e8 elements hold the whole model
