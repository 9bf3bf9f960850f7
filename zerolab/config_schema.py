"""The DeepSpeed JSON keys zerolab reads, and the small parsers behind them (chapter 9).

``zerolab.config`` builds the dataclasses; this file holds the tables (which
keys exist, their aliases, which DeepSpeed keys are accepted but ignored) and
the value readers (comments in JSON, "auto", numbers written as 5e8), each
raising ``ConfigError`` with the key path and the allowed values.
"""
from __future__ import annotations

import difflib
import json
import os
import warnings


class ConfigError(ValueError):
    """A DeepSpeed-style config that zerolab cannot accept; names the key and what is allowed."""


AUTO = object()   # marker: the value was "auto" (or absent) -> use the default

# section -> implemented keys (DeepSpeed spelling)
TOP_KEYS = ("train_batch_size", "train_micro_batch_size_per_gpu", "gradient_accumulation_steps",
            "gradient_clipping", "optimizer", "scheduler", "fp16", "bf16", "data_types",
            "zero_optimization", "zerolab")
ZERO_KEYS = ("stage", "reduce_bucket_size", "allgather_bucket_size", "overlap_comm", "contiguous_gradients",
             "reduce_scatter", "offload_optimizer", "offload_param", "stage3_prefetch_bucket_size",
             "stage3_param_persistence_threshold", "stage3_max_live_parameters", "stage3_max_reuse_distance",
             "sub_group_size", "zero_quantized_weights", "zero_quantized_gradients", "zero_hpz_partition_size")
OFFLOAD_KEYS = ("device", "nvme_path", "pin_memory", "buffer_count", "buffer_size")
FP16_KEYS = ("enabled", "loss_scale", "initial_scale_power", "loss_scale_window", "hysteresis", "min_loss_scale")
SECTION_KEYS = {
    "": TOP_KEYS, "zero_optimization": ZERO_KEYS,
    "zero_optimization.offload_optimizer": OFFLOAD_KEYS, "zero_optimization.offload_param": OFFLOAD_KEYS,
    "fp16": FP16_KEYS, "bf16": ("enabled",), "data_types": ("grad_accum_dtype",),
    "optimizer": ("type", "params"), "scheduler": ("type", "params"), "zerolab": ("debug", "link", "trace"),
}
# DeepSpeed's short names -> the name used here
ALIASES = {
    "": {"bfloat16": "bf16"},
    "zero_optimization": {"prefetch_bucket_size": "stage3_prefetch_bucket_size",
                          "param_persistence_threshold": "stage3_param_persistence_threshold",
                          "max_live_parameters": "stage3_max_live_parameters",
                          "max_reuse_distance": "stage3_max_reuse_distance"},
}
# DeepSpeed keys that are valid there but not implemented here: accepted, listed in Config.ignored
IGNORED = {
    "": ("steps_per_print", "wall_clock_breakdown", "flops_profiler", "activation_checkpointing", "tensorboard",
         "wandb", "csv_monitor", "comet", "comms_logger", "dump_state", "memory_breakdown", "prescale_gradients",
         "gradient_predivide_factor", "sparse_gradients", "zero_allow_untested_optimizer",
         "zero_force_ds_cpu_optimizer", "amp", "communication_data_type", "checkpoint", "aio", "autotuning",
         "elasticity", "pipeline", "data_efficiency", "compression_training", "curriculum_learning",
         "seq_parallel_communication_data_type", "disable_allgather", "train_batch_size_per_gpu",
         "gradient_accumulation_dtype", "eigenvalue", "progressive_layer_drop", "nebula", "sparse_attention",
         "quantize_training", "weight_quantization", "hybrid_engine", "timers", "torch_autocast"),
    "zero_optimization": ("allgather_partitions", "round_robin_gradients", "elastic_checkpoint",
                          "load_from_fp32_weights", "stage3_gather_16bit_weights_on_model_save",
                          "gather_16bit_weights_on_model_save", "stage3_gather_fp16_weights_on_model_save",
                          "ignore_unused_parameters", "legacy_stage1", "memory_efficient_linear",
                          "zero_quantized_nontrainable_weights", "mics_shard_size", "mics_hierarchical_params_gather",
                          "use_multi_rank_bucket_allreduce", "zeropp_loco_param", "pipeline_loading_checkpoint",
                          "override_module_apply", "use_all_reduce_for_fetch_params", "log_trace_cache_warnings",
                          "stage3_model_persistence_threshold", "model_persistence_threshold",
                          "stage3_module_granularity_threshold", "module_granularity_threshold",
                          "cpu_offload", "cpu_offload_params", "cpu_offload_use_pin_memory"),
    "zero_optimization.offload_optimizer": ("pipeline_read", "pipeline_write", "pipeline", "fast_init", "ratio"),
    "zero_optimization.offload_param": ("max_in_cpu",),
    "fp16": ("auto_cast", "consecutive_hysteresis", "fp16_master_weights_and_grads", "type"),
    "bf16": ("immediate_grad_update", "check_grad_overflow", "bf16_master_weights_and_grads",
             "bf16_optimizer_states"),
}


def strip_comments(text: str) -> str:
    """Remove // and # comments and trailing commas outside JSON strings."""
    out, i, n, in_str = [], 0, len(text), False
    while i < n:
        c = text[i]
        if in_str:
            out.append(c)
            if c == "\\" and i + 1 < n:
                out.append(text[i + 1])
                i += 1
            elif c == '"':
                in_str = False
        elif c == '"':
            in_str = True
            out.append(c)
        elif c == "#" or text.startswith("//", i):
            while i < n and text[i] != "\n":
                i += 1
            continue
        elif c in "}]":
            j = len(out) - 1                       # drop a trailing comma before } or ]
            while j >= 0 and out[j].isspace():
                j -= 1
            if j >= 0 and out[j] == ",":
                del out[j]
            out.append(c)
        else:
            out.append(c)
        i += 1
    return "".join(out)


def load_json(ds) -> dict:
    """A dict, a path to a JSON file (comments allowed), or JSON text."""
    if isinstance(ds, dict):
        return ds
    if isinstance(ds, (str, os.PathLike)):
        if isinstance(ds, str) and ds.lstrip().startswith("{"):
            text, where = ds, "config text"
        else:
            try:
                with open(ds, encoding="utf-8") as f:
                    text, where = f.read(), os.fspath(ds)
            except OSError as e:
                raise ConfigError(f"cannot read config file {os.fspath(ds)!r}: {e.strerror}") from None
        try:
            data = json.loads(strip_comments(text))
        except json.JSONDecodeError as e:
            raise ConfigError(f"{where}: not valid JSON (after removing comments): {e}") from None
        if not isinstance(data, dict):
            raise ConfigError(f"{where}: the top level must be a JSON object, got {type(data).__name__}")
        return data
    raise ConfigError(f"config must be a dict, a path or a zerolab.Config, got {type(ds).__name__}")


def section(raw, path: str, ignored: list) -> dict:
    """Check a section's keys: resolve aliases, collect ignored keys, warn about unknown ones."""
    if raw is None:
        return {}
    if not isinstance(raw, dict):
        raise ConfigError(f"{path or 'config'}: expected a JSON object, got {raw!r}")
    known, aliases, skip = SECTION_KEYS[path], ALIASES.get(path, {}), IGNORED.get(path, ())
    out = {}
    for key, value in raw.items():
        name = aliases.get(key, key)
        full = f"{path}.{key}" if path else key
        if name in known:
            if name in out:
                raise ConfigError(f"{full}: given twice (once under an alias)")
            out[name] = value
        elif key in skip:
            ignored.append(full)
        else:
            close = difflib.get_close_matches(key, list(known) + list(aliases) + list(skip), n=1)
            hint = f"; did you mean {close[0]!r}?" if close else f"; known keys: {', '.join(known)}"
            warnings.warn(f"unknown key {full!r}{hint} (ignored)", UserWarning, stacklevel=4)
    return out


def is_auto(v) -> bool:
    return v is None or (isinstance(v, str) and v.strip().lower() == "auto")


def read_int(d: dict, key: str, path: str, default, minimum=0):
    """An integer >= minimum; accepts 5e8, "5e8", "auto" (-> default)."""
    if key not in d or is_auto(d[key]):
        return default
    v, full = d[key], f"{path}.{key}" if path else key
    if isinstance(v, str):
        try:
            v = float(v)
        except ValueError:
            raise ConfigError(f"{full}: expected an integer >= {minimum} (e.g. 5e8), got {d[key]!r}") from None
    if isinstance(v, bool) or not isinstance(v, (int, float)) or v != v or v != int(v):
        raise ConfigError(f"{full}: expected an integer >= {minimum} (e.g. 5e8), got {d[key]!r}")
    if v < minimum:
        raise ConfigError(f"{full}: must be >= {minimum}, got {d[key]!r}")
    return int(v)


def read_float(d: dict, key: str, path: str, default, minimum=0.0):
    if key not in d or is_auto(d[key]):
        return default
    v, full = d[key], f"{path}.{key}" if path else key
    if isinstance(v, bool) or not isinstance(v, (int, float)) or v != v:
        raise ConfigError(f"{full}: expected a number >= {minimum}, got {v!r}")
    if v < minimum:
        raise ConfigError(f"{full}: must be >= {minimum}, got {v!r}")
    return float(v)


def read_bool(d: dict, key: str, path: str, default):
    if key not in d or is_auto(d[key]):
        return default
    v = d[key]
    if not isinstance(v, bool):
        raise ConfigError(f"{path}.{key}: expected true or false, got {v!r}")
    return v


def read_choice(d: dict, key: str, path: str, default, allowed, lower=True):
    if key not in d or is_auto(d[key]):
        return default
    v = d[key]
    norm = v.lower() if (lower and isinstance(v, str)) else v
    if norm not in allowed:
        raise ConfigError(f"{path}.{key}: {v!r} is not allowed; expected one of {allowed}")
    return norm
