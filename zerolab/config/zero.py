"""The ``zero_optimization`` section and its two offload sections (chapters 4-7, 11).

Key table, defaults (the dataclasses) and reader side by side. The rules that
tie keys together are checked here, once: offloading the optimizer needs a
partitioned optimizer (stage >= 1), offloading parameters needs partitioned
parameters (stage 3), ZeRO++ needs stage 3, hpZ's partition must fit in a
node, qgZ needs 16-bit gradients (``check_zeropp``, once the world is known).
zerolab's own ZeRO++ knobs (the quantization group sizes) live in the
``"zerolab"`` section: ``ZEROPP_KEYS``.

``reduce_bucket_size: 0`` (Hugging Face's ZeRO-3 test configs write it; DeepSpeed
0.19.8's own config class rejects it) means "each gradient on its own": here the
smallest collective is one *unit* (the parameters a module owns directly travel
together), so 0 is one bucket per unit. ``stage3_prefetch_bucket_size: 0`` turns
prefetch off, as in DeepSpeed. Keys accepted without effect
(``NO_EFFECT``) warn when set to something other than their default.
"""
from __future__ import annotations

import os
import warnings
from dataclasses import dataclass, field

from zerolab.config.schema import ConfigError, read_bool, read_choice, read_int, section

DEVICES = ("none", "cpu", "nvme")

ZERO_KEYS = ("stage", "reduce_bucket_size", "allgather_bucket_size", "overlap_comm", "contiguous_gradients",
             "reduce_scatter", "offload_optimizer", "offload_param", "stage3_prefetch_bucket_size",
             "stage3_param_persistence_threshold", "stage3_max_live_parameters", "stage3_max_reuse_distance",
             "sub_group_size", "zero_quantized_weights", "zero_quantized_gradients", "zero_hpz_partition_size")
# DeepSpeed's short names -> the name used here
ZERO_ALIASES = {"prefetch_bucket_size": "stage3_prefetch_bucket_size",
                "param_persistence_threshold": "stage3_param_persistence_threshold",
                "max_live_parameters": "stage3_max_live_parameters",
                "max_reuse_distance": "stage3_max_reuse_distance"}
# valid in DeepSpeed, not implemented here: accepted and listed in Config.ignored
ZERO_IGNORED = ("allgather_partitions", "round_robin_gradients", "elastic_checkpoint",
                "load_from_fp32_weights", "stage3_gather_16bit_weights_on_model_save",
                "gather_16bit_weights_on_model_save", "stage3_gather_fp16_weights_on_model_save",
                "ignore_unused_parameters", "legacy_stage1", "memory_efficient_linear",
                "zero_quantized_nontrainable_weights", "mics_shard_size", "mics_hierarchical_params_gather",
                "use_multi_rank_bucket_allreduce", "zeropp_loco_param", "pipeline_loading_checkpoint",
                "override_module_apply", "use_all_reduce_for_fetch_params", "log_trace_cache_warnings",
                "stage3_model_persistence_threshold", "model_persistence_threshold",
                "stage3_module_granularity_threshold", "module_granularity_threshold",
                "cpu_offload", "cpu_offload_params", "cpu_offload_use_pin_memory")
OFFLOAD_KEYS = ("device", "nvme_path", "pin_memory", "buffer_count", "buffer_size")
OFFLOAD_IGNORED = {"offload_optimizer": ("pipeline_read", "pipeline_write", "pipeline", "fast_init", "ratio"),
                   "offload_param": ("max_in_cpu",)}

# accepted for DeepSpeed's sake but without effect here: (path, default, why), warned when not default
NO_EFFECT = (("zero_optimization.contiguous_gradients", True,
              "the gradient shard is always one contiguous buffer"),
             ("zero_optimization.offload_param.pin_memory", True,
              "parameters are offloaded unit by unit without a pinned staging buffer"),
             ("zero_optimization.offload_param.buffer_size", 100_000_000,
              "each unit is read whole; buffer_count alone bounds the read-ahead"))


# {"zerolab": {"qwz_group_size": 8000, "qgz_group_size": 0}}: elements per quantization group of
# qwZ's weight all-gathers (DeepSpeed's quantizer targets about 8,000) and of qgZ's all-to-alls
# (0: DeepSpeed's rule, one group per row of the bucket's smallest-row matrix, engine/zeropp/engine.py)
ZEROPP_KEYS = {"qwz_group_size": 8000, "qgz_group_size": 0}


@dataclass
class OffloadConfig:
    device: str = "none"            # "none" | "cpu" | "nvme"
    nvme_path: str | None = None
    pin_memory: bool = True         # DeepSpeed's default; pinning happens only with a CUDA device
    buffer_count: int = 4            # DeepSpeed: 4 for offload_optimizer, 5 for offload_param
    buffer_size: int = 100_000_000   # offload_param only (elements per staging buffer)


@dataclass
class ZeroConfig:
    stage: int = 0
    reduce_bucket_size: int = 500_000_000          # elements (DeepSpeed default 5e8); 0 = one unit per bucket
    allgather_bucket_size: int = 500_000_000
    overlap_comm: bool | None = None               # None -> False for stages 0-2, True for stage 3
    contiguous_gradients: bool = True
    reduce_scatter: bool = True
    offload_optimizer: OffloadConfig = field(default_factory=OffloadConfig)
    offload_param: OffloadConfig = field(default_factory=lambda: OffloadConfig(buffer_count=5))
    stage3_prefetch_bucket_size: int = 50_000_000  # alias prefetch_bucket_size; 0 = prefetch off
    stage3_param_persistence_threshold: int = 100_000
    stage3_max_live_parameters: int = 1_000_000_000
    stage3_max_reuse_distance: int = 1_000_000_000
    sub_group_size: int = 1_000_000_000
    zero_quantized_weights: bool = False
    zero_quantized_gradients: bool = False
    zero_hpz_partition_size: int = 1

    def __post_init__(self):
        if self.overlap_comm is None:       # DeepSpeed's default depends on the stage
            self.overlap_comm = self.stage == 3

    @property
    def zeropp(self) -> tuple[str, ...]:
        """The ZeRO++ keys switched on."""
        return tuple(k for k, on in (("zero_quantized_weights", self.zero_quantized_weights),
                                     ("zero_quantized_gradients", self.zero_quantized_gradients),
                                     ("zero_hpz_partition_size", self.zero_hpz_partition_size > 1)) if on)


def read_offload(raw, path: str, ignored: list) -> OffloadConfig:
    """``zero_optimization.offload_optimizer`` or ``.offload_param``."""
    name = path.rsplit(".", 1)[-1]
    d = section(raw, path, ignored, OFFLOAD_KEYS, skip=OFFLOAD_IGNORED[name])
    device = read_choice(d, "device", path, "none", DEVICES)
    nvme_path = d.get("nvme_path")
    if nvme_path is not None and not isinstance(nvme_path, (str, os.PathLike)):
        raise ConfigError(f"{path}.nvme_path: expected a directory path string, got {nvme_path!r}")
    if device == "nvme" and not nvme_path:
        raise ConfigError(f"{path}.device is 'nvme' but {path}.nvme_path is missing; give a directory on the NVMe drive")
    return OffloadConfig(device=device, nvme_path=None if nvme_path is None else os.fspath(nvme_path),
                         pin_memory=read_bool(d, "pin_memory", path, True),
                         buffer_count=read_int(d, "buffer_count", path, 4 if name == "offload_optimizer" else 5,
                                               minimum=1),
                         buffer_size=read_int(d, "buffer_size", path, 100_000_000, minimum=1))


def read_zero(raw, ignored: list, notes: list | None = None) -> ZeroConfig:
    p, z = "zero_optimization", ZeroConfig()
    d = section(raw, p, ignored, ZERO_KEYS, ZERO_ALIASES, ZERO_IGNORED)
    stage = d.get("stage", 0)
    if isinstance(stage, str) and stage.strip().lower() == "auto":
        stage = 0
    if isinstance(stage, bool) or not isinstance(stage, (int, float)) or stage not in (0, 1, 2, 3):
        raise ConfigError(f"{p}.stage: {stage!r} is not allowed; expected one of (0, 1, 2, 3)")
    stage = int(stage)
    sizes = {k: read_int(d, k, p, getattr(z, k)) for k in (
        "reduce_bucket_size", "allgather_bucket_size", "stage3_prefetch_bucket_size",
        "stage3_param_persistence_threshold", "stage3_max_live_parameters", "stage3_max_reuse_distance")}
    sizes["sub_group_size"] = read_int(d, "sub_group_size", p, z.sub_group_size, minimum=1)
    if sizes["allgather_bucket_size"] < 1:
        raise ConfigError(f"{p}.allgather_bucket_size: must be >= 1 element, got {d['allgather_bucket_size']!r}")
    out = ZeroConfig(
        stage=stage, overlap_comm=read_bool(d, "overlap_comm", p, None),
        contiguous_gradients=read_bool(d, "contiguous_gradients", p, True),
        reduce_scatter=read_bool(d, "reduce_scatter", p, True),
        offload_optimizer=read_offload(d.get("offload_optimizer"), f"{p}.offload_optimizer", ignored),
        offload_param=read_offload(d.get("offload_param"), f"{p}.offload_param", ignored),
        zero_quantized_weights=read_bool(d, "zero_quantized_weights", p, False),
        zero_quantized_gradients=read_bool(d, "zero_quantized_gradients", p, False),
        zero_hpz_partition_size=read_int(d, "zero_hpz_partition_size", p, 1, minimum=1), **sizes)
    check_zero(out)
    warn_no_effect(out, notes)
    return out


def warn_no_effect(z: ZeroConfig, notes: list | None) -> None:
    """One warning naming every key set to a non-default value that has no effect here."""
    values = {"zero_optimization.contiguous_gradients": z.contiguous_gradients,
              "zero_optimization.offload_param.pin_memory": z.offload_param.pin_memory,
              "zero_optimization.offload_param.buffer_size": z.offload_param.buffer_size}
    set_ = [f"{key}={values[key]!r} ({why})" for key, default, why in NO_EFFECT if values[key] != default]
    if set_:
        msg = f"accepted without effect in zerolab: {'; '.join(set_)}"
        warnings.warn(msg, UserWarning, stacklevel=4)
        if notes is not None:
            notes.append(msg)


def check_zero(z: ZeroConfig) -> None:
    """The rules between keys (also run on a ZeroConfig built in code, by ``zl.initialize``)."""
    p = "zero_optimization"
    if z.stage not in (0, 1, 2, 3):
        raise ConfigError(f"{p}.stage: {z.stage!r} is not allowed; expected one of (0, 1, 2, 3)")
    for name, off in (("offload_optimizer", z.offload_optimizer), ("offload_param", z.offload_param)):
        if off.device not in DEVICES:
            raise ConfigError(f"{p}.{name}.device: {off.device!r} is not allowed; expected one of {DEVICES}")
    if z.offload_optimizer.device != "none" and z.stage < 1:
        raise ConfigError(f"{p}.offload_optimizer needs stage 1, 2 or 3 (got stage 0): only a partitioned "
                          f"optimizer is offloaded; allowed device at stage 0: 'none'")
    if z.offload_param.device != "none" and z.stage < 3:
        raise ConfigError(f"{p}.offload_param needs stage 3 (got stage {z.stage}): only ZeRO-3 partitions the "
                          f"parameters, so only it can offload them; use stage 3 or offload_optimizer")
    if z.zeropp and z.stage < 3:
        raise ConfigError(f"{p}: ZeRO++ keys {', '.join(z.zeropp)} need stage 3 (got stage {z.stage})")


def check_zeropp(z: ZeroConfig, precision: str | None = None, world_size: int | None = None,
                 ranks_per_node: int | None = None) -> None:
    """ZeRO++'s rules that need the precision and the topology (``zl.initialize`` knows both)."""
    p = "zero_optimization"
    check_zero(z)
    if not z.zeropp:
        return
    if z.offload_optimizer.device != "none" or z.offload_param.device != "none":
        raise ConfigError(f"{p}: ZeRO++ ({', '.join(z.zeropp)}) with offload_optimizer/offload_param is not "
                          f"implemented by zerolab; turn one of them off")
    if z.zero_quantized_gradients and precision == "fp32":
        raise ConfigError(f"{p}.zero_quantized_gradients needs 16-bit training (bf16 or fp16 enabled): qgZ "
                          f"quantizes the 16-bit gradient all-to-all; this config trains in fp32")
    h = z.zero_hpz_partition_size
    if h > 1 and world_size is not None and ranks_per_node is not None:
        if ranks_per_node % h or world_size % h:
            raise ConfigError(f"{p}.zero_hpz_partition_size: {h} must divide the ranks per node "
                              f"({ranks_per_node}) and the world size ({world_size}): the secondary partition "
                              f"is split over {h} ranks of one node; allowed: "
                              f"{[d for d in range(1, ranks_per_node + 1) if ranks_per_node % d == 0]}")
