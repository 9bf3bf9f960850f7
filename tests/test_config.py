"""DeepSpeed-style config parsing and validation (zerolab.config.core)."""
import json
import pathlib
import re
import warnings

import pytest

import zerolab as zl
from zerolab.config import Config, ConfigError, OffloadConfig, ZeroConfig

CONFIGS = pathlib.Path(__file__).parent / "configs"
SOURCES = sorted(p for p in CONFIGS.glob("source_*.json") if "WRONG" not in p.name)


AUTO = r'"auto" replaced'


def parse(d, allow=(), **kw):
    """Valid configs must not warn, except with the warnings matching ``allow`` (each must be seen)."""
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        cfg = Config.from_deepspeed(d, **kw)
    for w in seen:
        assert any(re.search(a, str(w.message)) for a in allow), f"unexpected warning: {w.message}"
    for a in allow:
        assert any(re.search(a, str(w.message)) for w in seen), f"expected a warning matching {a!r}"
    return cfg


def test_defaults_match_interfaces():
    c = parse({})
    assert c.zero == ZeroConfig() and c.zero.stage == 0 and c.zero.overlap_comm is False
    assert c.zero.reduce_bucket_size == 500_000_000 and c.zero.stage3_prefetch_bucket_size == 50_000_000
    assert c.zero.offload_optimizer == OffloadConfig() and c.zero.offload_param.buffer_count == 5
    assert (c.precision, c.compute_dtype, c.optimizer.type, c.gradient_accumulation_steps) == \
        ("fp32", "float32", "adam", 1)
    assert zl.Config is Config and zl.ConfigError is ConfigError and issubclass(ConfigError, ValueError)
    assert parse({"zero_optimization": {"stage": 3}}).zero.overlap_comm is True   # DeepSpeed's stage-3 default


@pytest.mark.parametrize("path", SOURCES, ids=lambda p: p.name)
def test_every_source_config_is_accepted(path):
    raw_text = path.read_text(encoding="utf-8")
    cfg = parse(path, allow=(AUTO,) if '"auto"' in raw_text else ())
    if '"stage": 3' in raw_text:
        assert cfg.zero.stage == 3
    assert parse(path, allow=(AUTO,) if "\"auto\"" in raw_text else ()) == cfg and Config.from_any(cfg) is cfg


def test_source_values_read_exactly():
    c = parse(CONFIGS / "source_000_megatron_stage3.json", world_size=128)
    assert (c.train_batch_size, c.gradient_accumulation_steps, c.train_micro_batch_size_per_gpu) == (1536, 12, 1)
    assert c.zero.reduce_bucket_size == 500_000_000 and c.zero.stage3_param_persistence_threshold == 1_000_000
    assert c.zero.sub_group_size == 10**9 and c.zero.offload_optimizer.device == "cpu"
    assert c.zero.offload_optimizer.pin_memory is True and c.precision == "mixed" and c.fp16.loss_scale_window == 100
    assert c.optimizer.type == "adamw" and c.optimizer.params == {"lr": 6e-5, "weight_decay": 0.01}
    b = parse(CONFIGS / "source_004b_stage3_8xA100.json", world_size=8)
    assert b.train_micro_batch_size_per_gpu == 1 and b.zero.allgather_bucket_size == 10**9
    assert b.ignored == ("steps_per_print",) and any("steps_per_print" in n for n in b.notes)
    assert parse(CONFIGS / "source_001a_stage2_fragment.json").zero.reduce_bucket_size == 500_000_000
    assert parse(CONFIGS / "source_001b_stage3_offload.json").zero.offload_optimizer.buffer_count == 4
    chatglm = parse(CONFIGS / "source_001c_chatglm_stage2.json", allow=(AUTO,))
    assert chatglm.train_micro_batch_size_per_gpu is None and chatglm.gradient_clipping == 1.0   # "auto"
    fp16 = parse(CONFIGS / "source_004d_fp16.json").fp16
    assert (fp16.enabled, fp16.loss_scale, fp16.hysteresis, fp16.min_loss_scale) == (True, 0.0, 2, 1.0)
    assert parse(CONFIGS / "source_004e_activation_checkpointing.json").ignored == ("activation_checkpointing",)
    assert parse(CONFIGS / "source_004c_flops_profiler.json").ignored == ("flops_profiler",)


def test_source_config_with_offload_param_under_stage1_is_rejected():
    with pytest.raises(ConfigError) as err:
        Config.from_deepspeed(CONFIGS / "source_004g_stage1_offload_param_WRONG.json")
    msg = str(err.value)
    assert "zero_optimization.offload_param" in msg and "stage 3" in msg and "stage 1" in msg


BAD = [
    ({"zero_optimization": {"stage": 4}}, "zero_optimization.stage", "(0, 1, 2, 3)"),
    ({"zero_optimization": {"stage": "3"}}, "zero_optimization.stage", "(0, 1, 2, 3)"),
    ({"zero_optimization": {"stage": True}}, "zero_optimization.stage", "(0, 1, 2, 3)"),
    ({"zero_optimization": {"reduce_bucket_size": -1}}, "zero_optimization.reduce_bucket_size", ">= 0"),
    ({"zero_optimization": {"reduce_bucket_size": "big"}}, "zero_optimization.reduce_bucket_size", "integer"),
    ({"zero_optimization": {"allgather_bucket_size": 2.5}}, "zero_optimization.allgather_bucket_size", "integer"),
    ({"zero_optimization": {"stage3_prefetch_bucket_size": -5e7}}, "stage3_prefetch_bucket_size", ">= 0"),
    ({"zero_optimization": {"overlap_comm": "yes"}}, "zero_optimization.overlap_comm", "true or false"),
    ({"fp16": {"enabled": True}, "bf16": {"enabled": True}}, "fp16.enabled and bf16.enabled", "at most one"),
    ({"zero_optimization": {"stage": 2, "offload_param": {"device": "cpu"}}},
     "zero_optimization.offload_param", "stage 3"),
    ({"zero_optimization": {"stage": 0, "offload_optimizer": {"device": "cpu"}}},
     "zero_optimization.offload_optimizer", "stage 1, 2 or 3"),
    ({"zero_optimization": {"stage": 3, "offload_optimizer": {"device": "nvme"}}},
     "zero_optimization.offload_optimizer.nvme_path", "nvme"),
    ({"zero_optimization": {"stage": 3, "offload_param": {"device": "gpu"}}},
     "zero_optimization.offload_param.device", "('none', 'cpu', 'nvme')"),
    ({"optimizer": {"type": "Lamb"}}, "optimizer.type", "AdamW"),
    ({"optimizer": {"type": "Adam", "params": {"lr": -1}}}, "optimizer.params.lr", ">= 0"),
    ({"optimizer": {"type": "Adam", "params": {"betas": [0.9]}}}, "optimizer.params.betas", "two numbers"),
    ({"scheduler": {"type": "OneCycle"}}, "scheduler.type", "WarmupDecayLR"),
    ({"scheduler": {"type": "WarmupDecayLR", "params": {}}}, "scheduler.params.total_num_steps", "required"),
    ({"train_batch_size": 0}, "train_batch_size", ">= 1"),
    ({"gradient_accumulation_steps": 1.5}, "gradient_accumulation_steps", "integer"),
    ({"gradient_clipping": -1.0}, "gradient_clipping", ">= 0"),
    ({"train_batch_size": 30, "train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": 2},
     "train_batch_size", "multiple of 8"),
    ({"zero_optimization": {"stage": 2, "zero_quantized_weights": True}}, "zero_quantized_weights", "stage 3"),
    ({"zero_optimization": {"stage": 3, "zero_hpz_partition_size": 0}}, "zero_hpz_partition_size", ">= 1"),
    ({"data_types": {"grad_accum_dtype": "fp8"}}, "data_types.grad_accum_dtype", "fp32"),
    ({"zerolab": {"link": "carrier-pigeon"}}, "zerolab.link", "nvlink3"),
    ({"zero_optimization": 3}, "zero_optimization", "JSON object"),
]


@pytest.mark.parametrize("ds,key,allowed", BAD, ids=[b[1] + "-" + str(i) for i, b in enumerate(BAD)])
def test_bad_configs_name_key_and_allowed_values(ds, key, allowed):
    with pytest.raises(ConfigError) as err:
        Config.from_deepspeed(ds)
    assert key in str(err.value) and allowed in str(err.value), str(err.value)


def test_batch_rule_with_world_size():
    ds = {"train_batch_size": 32, "train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 4}
    assert parse(ds, world_size=4).train_batch_size == 32
    with pytest.raises(ConfigError, match=r"32 != 2 x 4 x 8 = 64"):
        Config.from_deepspeed(ds, world_size=8)
    # the missing one of the three is filled in, as DeepSpeed does
    assert parse({"train_batch_size": 32, "train_micro_batch_size_per_gpu": 2}, world_size=4)\
        .gradient_accumulation_steps == 4
    assert parse({"train_batch_size": 32, "gradient_accumulation_steps": 2}, world_size=4)\
        .train_micro_batch_size_per_gpu == 4
    assert parse({"train_micro_batch_size_per_gpu": 3, "gradient_accumulation_steps": 2}, world_size=4)\
        .train_batch_size == 24
    with pytest.raises(ConfigError, match="not divisible"):
        Config.from_deepspeed({"train_batch_size": 30, "train_micro_batch_size_per_gpu": 2}, world_size=4)
    with pytest.raises(ConfigError, match="world_size"):
        parse({}).with_world_size(0)


def test_comments_numbers_auto_aliases(tmp_path):
    f = tmp_path / "ds.json"
    f.write_text('{\n  // a comment\n  "zero_optimization": { # another\n'
                 '    "stage": 3, "prefetch_bucket_size": "5e7", "max_live_parameters": 1e9,\n'
                 '    "param_persistence_threshold": "auto", "max_reuse_distance": 2e8,\n'
                 '    "offload_param": {"device": "nvme", "nvme_path": "http://not-a//comment#x"},\n'
                 '    "offload_optimizer": {"device": "cpu"},\n  },\n'
                 '  "bfloat16": {"enabled": true},\n  "data_types": {"grad_accum_dtype": "fp32"}\n}\n')
    c = parse(f, allow=(AUTO + ".*zero_optimization.param_persistence_threshold",))
    z = c.zero
    assert (z.stage3_prefetch_bucket_size, z.stage3_max_live_parameters, z.stage3_max_reuse_distance) == \
        (50_000_000, 10**9, 200_000_000)
    assert z.stage3_param_persistence_threshold == 100_000                  # "auto" -> default
    assert z.offload_param.nvme_path == "http://not-a//comment#x"           # comments only outside strings
    assert (c.precision, c.compute_dtype, c.bf16_enabled) == ("mixed_fp32_grads", "bfloat16", True)
    assert parse(str(f), allow=(AUTO,)) == c and parse(f.read_text(), allow=(AUTO,)) == c                 # str path and JSON text too
    with pytest.raises(ConfigError, match="given twice"):
        Config.from_deepspeed({"zero_optimization": {"prefetch_bucket_size": 1, "stage3_prefetch_bucket_size": 2}})
    with pytest.raises(ConfigError, match="cannot read"):
        Config.from_deepspeed(tmp_path / "missing.json")
    with pytest.raises(ConfigError, match="not valid JSON"):
        Config.from_deepspeed("{ 'single': quotes }")


def test_misspelt_key_warns_with_suggestion():
    with pytest.warns(UserWarning, match=r"unknown key 'zero_optimization.stagee'; did you mean 'stage'\?"):
        c = Config.from_deepspeed({"zero_optimization": {"stagee": 2}})
    assert c.zero.stage == 0
    with pytest.warns(UserWarning, match=r"'train_batch_szie'; did you mean 'train_batch_size'"):
        Config.from_deepspeed({"train_batch_szie": 8})
    with pytest.warns(UserWarning, match=r"did you mean 'device'"):
        Config.from_deepspeed({"zero_optimization": {"stage": 3, "offload_param": {"devise": "cpu"}}})


def test_ignored_keys_and_notes():
    c = parse({"steps_per_print": 10, "wall_clock_breakdown": False,
               "zero_optimization": {"stage": 2, "round_robin_gradients": True},
               "optimizer": {"type": "Adam", "params": {"lr": "auto", "adam_w_mode": True, "torch_adam": True}}},
              allow=(AUTO + ".*optimizer.params.lr",))
    assert set(c.ignored) == {"steps_per_print", "wall_clock_breakdown", "zero_optimization.round_robin_gradients"}
    assert c.optimizer.type == "adamw" and c.optimizer.params == {"weight_decay": 0.01}   # torch_adam: torch's AdamW
    assert any("adam_w_mode" in n for n in c.notes)
    plain = parse({"optimizer": {"type": "Adam", "params": {"lr": 1e-3, "betas": [0.9, 0.95]}}})
    assert plain.optimizer.type == "adamw" and plain.optimizer.params["betas"] == (0.9, 0.95)   # DeepSpeed's "Adam"
    assert any("AdamW" in n for n in plain.notes)
    l2 = parse({"optimizer": {"type": "Adam", "params": {"weight_decay": 0.1, "adam_w_mode": False}}})
    assert l2.optimizer.type == "adam" and any("torch.optim.Adam" in n for n in l2.notes)
    with pytest.raises(ConfigError, match="adam_w_mode"):
        parse({"optimizer": {"type": "Adam", "params": {"adam_w_mode": "no"}}})
    assert parse({"optimizer": {"type": "SGD", "params": {"lr": 0.1, "momentum": 0.9}}}).optimizer.type == "sgd"


def test_zeropp_and_zerolab_sections():
    c = parse({"zero_optimization": {"stage": 3, "zero_quantized_weights": True, "zero_quantized_gradients": True,
                                     "zero_hpz_partition_size": 8}, "bf16": {"enabled": True},
               "zerolab": {"debug": True, "link": "demo", "trace": True},
               "scheduler": {"type": "WarmupLR", "params": {"warmup_num_steps": 10, "warmup_type": "linear"}}})
    assert c.zero.zeropp == ("zero_quantized_weights", "zero_quantized_gradients", "zero_hpz_partition_size")
    assert (c.debug, c.link, c.trace) == (True, "demo", True)
    assert c.scheduler.type == "WarmupLR" and c.scheduler.params["warmup_num_steps"] == 10
    assert json.loads(json.dumps(c.optimizer.params)) == {}
