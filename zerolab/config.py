"""DeepSpeed-style JSON -> a validated ``Config`` (chapter 9; used by ``zl.initialize``).

    cfg = zl.Config.from_deepspeed("ds.json", world_size=8)   # dict, path or JSON text
    cfg.zero.stage, cfg.precision, cfg.ignored, cfg.notes

The keys are DeepSpeed's, spelled the same (see ``config_schema`` for the
tables). Accepted: "auto" (-> our default), integer sizes written 5e8 or
"5e8", // and # comments and trailing commas in files, DeepSpeed's short
aliases (``prefetch_bucket_size``). Unknown keys warn with the closest known
key; DeepSpeed keys we do not implement are listed in ``Config.ignored``.
Bad values raise ``ConfigError`` naming the key path and the allowed values.
"""
from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass, field

from zerolab.config_schema import (ConfigError, load_json, read_bool, read_choice, read_float, read_int,
                                   section)

__all__ = ["Config", "ConfigError", "ZeroConfig", "OffloadConfig", "OptimizerConfig", "SchedulerConfig",
           "FP16Config"]

DEVICES = ("none", "cpu", "nvme")
OPTIMIZER_TYPES = {"adam": "Adam", "adamw": "AdamW", "sgd": "SGD"}
SCHEDULER_TYPES = ("WarmupLR", "WarmupDecayLR")
DTYPES = {"fp32": "fp32", "float32": "fp32", "fp16": "fp16", "float16": "fp16", "bf16": "bf16",
          "bfloat16": "bf16"}


@dataclass
class OffloadConfig:
    device: str = "none"            # "none" | "cpu" | "nvme"
    nvme_path: str | None = None
    pin_memory: bool = False
    buffer_count: int = 4            # DeepSpeed: 4 for offload_optimizer, 5 for offload_param
    buffer_size: int = 100_000_000   # offload_param only (elements per staging buffer)


@dataclass
class ZeroConfig:
    stage: int = 0
    reduce_bucket_size: int = 500_000_000          # elements (DeepSpeed default 5e8)
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
        """The ZeRO++ keys switched on (the engine refuses these until it implements them)."""
        return tuple(k for k, on in (("zero_quantized_weights", self.zero_quantized_weights),
                                     ("zero_quantized_gradients", self.zero_quantized_gradients),
                                     ("zero_hpz_partition_size", self.zero_hpz_partition_size > 1)) if on)


@dataclass
class OptimizerConfig:
    type: str = "adam"              # normalised lower case: "adam" | "adamw" | "sgd"
    params: dict = field(default_factory=dict)   # torch.optim names: lr, betas, eps, weight_decay, momentum


@dataclass
class SchedulerConfig:
    type: str = "WarmupLR"          # "WarmupLR" | "WarmupDecayLR"
    params: dict = field(default_factory=dict)


@dataclass
class FP16Config:
    enabled: bool = False
    loss_scale: float = 0.0         # 0 = dynamic
    initial_scale_power: int = 16
    loss_scale_window: int = 1000
    hysteresis: int = 2
    min_loss_scale: float = 1.0


@dataclass
class Config:
    train_batch_size: int | None = None
    train_micro_batch_size_per_gpu: int | None = None
    gradient_accumulation_steps: int = 1
    gradient_clipping: float = 0.0          # 0 = off
    optimizer: OptimizerConfig = field(default_factory=OptimizerConfig)
    scheduler: SchedulerConfig | None = None
    fp16: FP16Config = field(default_factory=FP16Config)
    bf16_enabled: bool = False
    grad_accum_dtype: str | None = None     # "fp32" | "fp16" | "bf16" ("data_types": {"grad_accum_dtype": ...})
    zero: ZeroConfig = field(default_factory=ZeroConfig)
    debug: bool = False                     # {"zerolab": {"debug": ..., "link": ..., "trace": ...}}
    link: str | None = None                 # zerolab.network.LINKS preset name or None
    trace: bool = False
    ignored: tuple[str, ...] = ()           # DeepSpeed keys accepted but not implemented
    notes: tuple[str, ...] = ()
    gas_given: bool = field(default=True, repr=False, compare=False)   # was gradient_accumulation_steps set?

    @property
    def precision(self) -> str:
        """ "fp32" | "mixed" | "mixed_fp32_grads" (DESIGN.md's list). """
        if not (self.fp16.enabled or self.bf16_enabled):
            return "fp32"
        return "mixed_fp32_grads" if self.grad_accum_dtype == "fp32" else "mixed"

    @property
    def compute_dtype(self) -> str:
        return "float16" if self.fp16.enabled else ("bfloat16" if self.bf16_enabled else "float32")

    # ---- construction ----
    @classmethod
    def from_any(cls, x) -> "Config":
        """A Config, a dict, a path or JSON text (what ``zl.initialize`` accepts)."""
        return x if isinstance(x, Config) else cls.from_deepspeed(x)

    @classmethod
    def from_deepspeed(cls, ds, world_size: int | None = None) -> "Config":
        raw = load_json(ds if not isinstance(ds, os.PathLike) else os.fspath(ds))
        ignored: list[str] = []
        notes: list[str] = []
        top = section(raw, "", ignored)
        fp16 = _fp16(section(top.get("fp16"), "fp16", ignored))
        bf16 = read_bool(section(top.get("bf16"), "bf16", ignored), "enabled", "bf16", False)
        if fp16.enabled and bf16:
            raise ConfigError("fp16.enabled and bf16.enabled are both true; enable at most one of them")
        dtypes = section(top.get("data_types"), "data_types", ignored)
        gad = read_choice(dtypes, "grad_accum_dtype", "data_types", None, tuple(DTYPES))
        zl = section(top.get("zerolab"), "zerolab", ignored)
        cfg = cls(
            train_batch_size=read_int(top, "train_batch_size", "", None, minimum=1),
            train_micro_batch_size_per_gpu=read_int(top, "train_micro_batch_size_per_gpu", "", None, minimum=1),
            gradient_accumulation_steps=read_int(top, "gradient_accumulation_steps", "", 1, minimum=1),
            gradient_clipping=read_float(top, "gradient_clipping", "", 0.0),
            optimizer=_optimizer(top.get("optimizer"), notes, ignored),
            scheduler=_scheduler(top.get("scheduler"), ignored),
            fp16=fp16, bf16_enabled=bf16, grad_accum_dtype=DTYPES.get(gad),
            zero=_zero(section(top.get("zero_optimization"), "zero_optimization", ignored), ignored),
            debug=read_bool(zl, "debug", "zerolab", False), link=_link(zl), trace=read_bool(zl, "trace", "zerolab", False),
            ignored=tuple(ignored), notes=tuple(notes),
            gas_given=read_int(top, "gradient_accumulation_steps", "", None, minimum=1) is not None)
        mbs, gas, tbs = cfg.train_micro_batch_size_per_gpu, cfg.gradient_accumulation_steps, cfg.train_batch_size
        if tbs is not None and mbs is not None and tbs % (mbs * (gas if cfg.gas_given else 1)):
            raise ConfigError(f"train_batch_size ({tbs}) must equal train_micro_batch_size_per_gpu ({mbs}) x "
                              f"gradient_accumulation_steps ({gas}) x world size, but {tbs} is not a multiple "
                              f"of {mbs * gas}")
        if ignored:
            cfg.notes += (f"accepted but not implemented by zerolab (ignored): {', '.join(ignored)}",)
        return cfg if world_size is None else cfg.with_world_size(world_size)

    def with_world_size(self, world_size: int) -> "Config":
        """Fill in and check the batch rule train = micro x accumulation x world (as DeepSpeed does)."""
        if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1:
            raise ConfigError(f"world_size must be an integer >= 1, got {world_size!r}")
        tbs, mbs, gas, w = (self.train_batch_size, self.train_micro_batch_size_per_gpu,
                            self.gradient_accumulation_steps, world_size)
        rule = (f"train_batch_size = train_micro_batch_size_per_gpu x gradient_accumulation_steps x world size "
                f"({w})")
        if tbs is not None and mbs is not None and not self.gas_given:
            if tbs % (mbs * w):
                raise ConfigError(f"{rule}: train_batch_size {tbs} is not divisible by {mbs} x {w}")
            gas = tbs // (mbs * w)
        elif tbs is not None and mbs is None:
            if tbs % (gas * w):
                raise ConfigError(f"{rule}: train_batch_size {tbs} is not divisible by {gas} x {w}")
            mbs = tbs // (gas * w)
        elif tbs is None and mbs is not None:
            tbs = mbs * gas * w
        if tbs is not None and tbs != mbs * gas * w:
            raise ConfigError(f"{rule}: {tbs} != {mbs} x {gas} x {w} = {mbs * gas * w}")
        return dataclasses.replace(self, train_batch_size=tbs, train_micro_batch_size_per_gpu=mbs,
                                   gradient_accumulation_steps=gas, gas_given=True)


# ---- section readers ----

def _fp16(d: dict) -> FP16Config:
    p, f = "fp16", FP16Config()
    return FP16Config(enabled=read_bool(d, "enabled", p, False),
                      loss_scale=read_float(d, "loss_scale", p, f.loss_scale),
                      initial_scale_power=read_int(d, "initial_scale_power", p, f.initial_scale_power),
                      loss_scale_window=read_int(d, "loss_scale_window", p, f.loss_scale_window, minimum=1),
                      hysteresis=read_int(d, "hysteresis", p, f.hysteresis, minimum=1),
                      min_loss_scale=read_float(d, "min_loss_scale", p, f.min_loss_scale))


def _offload(d: dict, path: str, buffer_count: int) -> OffloadConfig:
    device = read_choice(d, "device", path, "none", DEVICES)
    nvme_path = d.get("nvme_path")
    if nvme_path is not None and not isinstance(nvme_path, (str, os.PathLike)):
        raise ConfigError(f"{path}.nvme_path: expected a directory path string, got {nvme_path!r}")
    if device == "nvme" and not nvme_path:
        raise ConfigError(f"{path}.device is 'nvme' but {path}.nvme_path is missing; give a directory on the NVMe drive")
    return OffloadConfig(device=device, nvme_path=None if nvme_path is None else os.fspath(nvme_path),
                         pin_memory=read_bool(d, "pin_memory", path, False),
                         buffer_count=read_int(d, "buffer_count", path, buffer_count, minimum=1),
                         buffer_size=read_int(d, "buffer_size", path, 100_000_000, minimum=1))


def _zero(d: dict, ignored: list) -> ZeroConfig:
    p, z = "zero_optimization", ZeroConfig()
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
    for k in ("reduce_bucket_size", "allgather_bucket_size"):
        if sizes[k] < 1:
            raise ConfigError(f"{p}.{k}: must be >= 1 element, got {d[k]!r}")
    out = ZeroConfig(
        stage=stage, overlap_comm=read_bool(d, "overlap_comm", p, None),
        contiguous_gradients=read_bool(d, "contiguous_gradients", p, True),
        reduce_scatter=read_bool(d, "reduce_scatter", p, True),
        offload_optimizer=_offload(section(d.get("offload_optimizer"), f"{p}.offload_optimizer", ignored),
                                   f"{p}.offload_optimizer", 4),
        offload_param=_offload(section(d.get("offload_param"), f"{p}.offload_param", ignored), f"{p}.offload_param", 5),
        zero_quantized_weights=read_bool(d, "zero_quantized_weights", p, False),
        zero_quantized_gradients=read_bool(d, "zero_quantized_gradients", p, False),
        zero_hpz_partition_size=read_int(d, "zero_hpz_partition_size", p, 1, minimum=1), **sizes)
    if out.offload_optimizer.device != "none" and stage < 1:
        raise ConfigError(f"{p}.offload_optimizer needs stage 1, 2 or 3 (got stage 0); allowed device at stage 0: 'none'")
    if out.offload_param.device != "none" and stage < 3:
        raise ConfigError(f"{p}.offload_param needs stage 3 (got stage {stage}): only ZeRO-3 partitions the "
                          f"parameters, so only it can offload them; use stage 3 or offload_optimizer")
    if out.zeropp and stage < 3:
        raise ConfigError(f"{p}: ZeRO++ keys {', '.join(out.zeropp)} need stage 3 (got stage {stage})")
    return out


def _optimizer(raw, notes: list, ignored: list) -> OptimizerConfig:
    if raw is None:
        return OptimizerConfig()
    d = section(raw, "optimizer", ignored)
    typ = d.get("type", "adam")
    if not isinstance(typ, str) or typ.lower() not in OPTIMIZER_TYPES:
        raise ConfigError(f"optimizer.type: {typ!r} is not supported; expected one of "
                          f"{tuple(OPTIMIZER_TYPES.values())}")
    typ = typ.lower()
    params = d.get("params") or {}
    if not isinstance(params, dict):
        raise ConfigError(f"optimizer.params: expected a JSON object, got {params!r}")
    params = {k: v for k, v in params.items() if not (isinstance(v, str) and v.lower() == "auto")}
    for k in ("torch_adam", "bias_correction", "amsgrad_mode", "fused"):
        if params.pop(k, None) is not None:
            ignored.append(f"optimizer.params.{k}")
    w_mode = params.pop("adam_w_mode", None)
    if typ == "adam" and w_mode is True:
        typ = "adamw"
        notes.append("optimizer: DeepSpeed 'Adam' with adam_w_mode true is AdamW (decoupled weight decay); using adamw")
    elif typ == "adam" and w_mode is None:
        notes.append("optimizer: 'Adam' here is torch.optim.Adam (L2 weight decay); DeepSpeed's 'Adam' defaults "
                     "to AdamW mode -- write \"AdamW\" or \"adam_w_mode\": true to match it")
    for k in ("lr", "eps", "weight_decay", "momentum", "dampening"):
        v = params.get(k)
        if v is not None and (isinstance(v, bool) or not isinstance(v, (int, float)) or v < 0):
            raise ConfigError(f"optimizer.params.{k}: expected a number >= 0, got {v!r}")
    betas = params.get("betas")
    if betas is not None:
        if not (isinstance(betas, (list, tuple)) and len(betas) == 2
                and all(isinstance(b, (int, float)) and 0 <= b < 1 for b in betas)):
            raise ConfigError(f"optimizer.params.betas: expected two numbers in [0, 1), got {betas!r}")
        params["betas"] = tuple(betas)
    return OptimizerConfig(type=typ, params=params)


def _scheduler(raw, ignored: list) -> SchedulerConfig | None:
    if raw is None:
        return None
    d = section(raw, "scheduler", ignored)
    typ = d.get("type")
    if typ not in SCHEDULER_TYPES:
        raise ConfigError(f"scheduler.type: {typ!r} is not supported; expected one of {SCHEDULER_TYPES}")
    params = {k: v for k, v in (d.get("params") or {}).items() if not (isinstance(v, str) and v.lower() == "auto")}
    for k in ("warmup_min_lr", "warmup_max_lr", "warmup_num_steps", "total_num_steps"):
        read_float(params, k, "scheduler.params", None)
    wt = params.get("warmup_type", "log")
    if wt not in ("log", "linear"):
        raise ConfigError(f"scheduler.params.warmup_type: {wt!r} is not allowed; expected one of ('log', 'linear')")
    if typ == "WarmupDecayLR" and "total_num_steps" not in params:
        raise ConfigError("scheduler.params.total_num_steps: required by WarmupDecayLR")
    return SchedulerConfig(type=typ, params=params)


def _link(zl: dict) -> str | None:
    from zerolab.network import LINKS
    link = zl.get("link")
    if link is not None and link not in LINKS:
        raise ConfigError(f"zerolab.link: {link!r} is not a preset; expected one of {tuple(sorted(LINKS))} or null")
    return link
