"""Defaults as DeepSpeed's, or listed where they differ (issue 16, point 4): ``zerolab.config.defaults``.

The DeepSpeed column of the table is cited; ``test_deepspeed_column_matches_installed_deepspeed``
reads the installed package's own constants (skipped where DeepSpeed is not installed).
"""
from __future__ import annotations

import inspect
import json
import pathlib

import pytest
import torch

from zerolab.config import Config
from zerolab.config.defaults import DEEPSPEED_DEFAULTS, defaults_markdown, defaults_table, zerolab_defaults
from zerolab.engine.optim import ShardedOptimizer

ROOT = pathlib.Path(__file__).resolve().parents[1]


def test_every_difference_says_why():
    rows = defaults_table()
    assert {r["key"] for r in rows} == set(DEEPSPEED_DEFAULTS) <= set(zerolab_defaults())
    for r in rows:
        assert r["same"] == (r["zerolab"] == r["deepspeed"]) and (r["same"] or len(r["why"]) > 20), r
    differ = {r["key"] for r in rows if not r["same"]}
    assert differ == {"gradient_clipping"}, differ   # the decided difference ("Adam" is AdamW, as DeepSpeed's)


def test_adamw_weight_decay_is_deepspeeds():
    """AdamW without weight_decay: 0 (FusedAdam / DeepSpeedCPUAdam); with torch_adam: torch's 0.01."""
    t = [torch.zeros(3)]
    assert Config.from_deepspeed({"optimizer": {"type": "AdamW", "params": {"lr": 1e-3}}}).optimizer.params == \
        {"lr": 1e-3}
    assert ShardedOptimizer("adamw", {"lr": 1e-3}, t).weight_decay == 0.0
    torch_adam = Config.from_deepspeed({"optimizer": {"type": "AdamW", "params": {"torch_adam": True}}})
    assert torch_adam.optimizer.params == {"weight_decay": 0.01} and "optimizer.params.torch_adam" not in \
        torch_adam.ignored
    given = Config.from_deepspeed({"optimizer": {"type": "AdamW", "params": {"torch_adam": True, "weight_decay": 0.1}}})
    assert given.optimizer.params == {"weight_decay": 0.1}


def test_chapter_12_prints_the_generated_table():
    nb = json.loads((ROOT / "chapters" / "12_in_practice.ipynb").read_text(encoding="utf-8"))
    code = ["".join(c["source"]) for c in nb["cells"] if c["cell_type"] == "code"]
    assert any("defaults_markdown()" in src for src in code)
    assert "| `gradient_clipping` | 0.0 | 1.0 | differs" in defaults_markdown()


def test_deepspeed_column_matches_installed_deepspeed():
    from zerolab.bench.peers import deepspeed_available
    if not deepspeed_available():
        pytest.skip("DeepSpeed is not installed (pip install -e '.[bench]')")
    import deepspeed.runtime.constants as c
    from deepspeed.ops.adam import DeepSpeedCPUAdam, FusedAdam
    from deepspeed.runtime.precision_config import DeepSpeedFP16Config
    from deepspeed.runtime.zero.config import DeepSpeedZeroConfig
    from deepspeed.runtime.zero.offload_config import (DeepSpeedZeroOffloadOptimizerConfig,
                                                        DeepSpeedZeroOffloadParamConfig)
    ds = DEEPSPEED_DEFAULTS
    assert c.GRADIENT_CLIPPING_DEFAULT == ds["gradient_clipping"]
    for opt in (FusedAdam, DeepSpeedCPUAdam):
        sig = inspect.signature(opt.__init__).parameters
        assert sig["weight_decay"].default == ds["optimizer.params.weight_decay (Adam, AdamW)"]
        assert (sig["lr"].default, sig["betas"].default, sig["eps"].default) == \
            (ds["optimizer.params.lr"], ds["optimizer.params.betas"], ds["optimizer.params.eps"])
    assert torch.optim.AdamW([torch.zeros(1, requires_grad=True)]).defaults["weight_decay"] == \
        ds["optimizer.params.weight_decay (AdamW, torch_adam true)"]
    fp16 = DeepSpeedFP16Config()
    for k in ("loss_scale", "initial_scale_power", "loss_scale_window", "hysteresis", "min_loss_scale"):
        assert getattr(fp16, k) == ds[f"fp16.{k}"], k
    z, z3 = DeepSpeedZeroConfig(), DeepSpeedZeroConfig(stage=3)
    names = {"stage3_prefetch_bucket_size": "prefetch_bucket_size",
             "stage3_param_persistence_threshold": "param_persistence_threshold",
             "stage3_max_live_parameters": "max_live_parameters", "stage3_max_reuse_distance": "max_reuse_distance"}
    for key in ("stage", "reduce_bucket_size", "allgather_bucket_size", "contiguous_gradients", "reduce_scatter",
                "sub_group_size", *names):
        assert getattr(z, names.get(key, key)) == ds[f"zero_optimization.{key}"], key
    assert (z.overlap_comm, z3.overlap_comm) == (ds["zero_optimization.overlap_comm (stage 0-2)"],
                                                 ds["zero_optimization.overlap_comm (stage 3)"])
    for name, off in (("offload_optimizer", DeepSpeedZeroOffloadOptimizerConfig()),
                      ("offload_param", DeepSpeedZeroOffloadParamConfig())):
        assert off.pin_memory == ds[f"zero_optimization.{name}.pin_memory"]
        assert off.buffer_count == ds[f"zero_optimization.{name}.buffer_count"]
    assert DeepSpeedZeroOffloadParamConfig().buffer_size == ds["zero_optimization.offload_param.buffer_size"]
