"""DeepSpeed-style JSON -> a validated ``Config`` (chapter 12; used by ``zl.initialize``).

    cfg = zl.Config.from_deepspeed("ds.json", world_size=8)   # dict, path or JSON text
    cfg.zero.stage, cfg.precision, cfg.ignored, cfg.notes

The keys are DeepSpeed's, spelled the same; each section's table, defaults
and reader live in a file of their own (``zero``, ``optimizer``, ``precision``;
the top level here). Accepted: "auto" (-> our default), integer sizes written 5e8 or
"5e8", // and # comments and trailing commas in files, DeepSpeed's short
aliases (``prefetch_bucket_size``). Unknown keys warn with the closest known
key; DeepSpeed keys we do not implement are listed in ``Config.ignored``.
Bad values raise ``ConfigError`` naming the key path and the allowed values.
"""
from __future__ import annotations

import dataclasses
import os
import warnings
from dataclasses import dataclass, field

from zerolab.config.optimizer import OptimizerConfig, SchedulerConfig, read_optimizer, read_scheduler
from zerolab.config.precision import FP16Config, check_precision, read_bf16, read_fp16, read_grad_accum_dtype
from zerolab.config.schema import ConfigError, is_auto, load_json, read_bool, read_choice, read_float, read_int, section
from zerolab.config.zero import ZEROPP_KEYS, ZeroConfig, check_zeropp, read_zero

TOP_KEYS = ("train_batch_size", "train_micro_batch_size_per_gpu", "gradient_accumulation_steps",
            "gradient_clipping", "optimizer", "scheduler", "fp16", "bf16", "data_types",
            "zero_optimization", "zerolab")
TOP_ALIASES = {"bfloat16": "bf16"}
# valid in DeepSpeed, not implemented here: accepted and listed in Config.ignored
TOP_IGNORED = ("steps_per_print", "wall_clock_breakdown", "flops_profiler", "activation_checkpointing",
               "tensorboard", "wandb", "csv_monitor", "comet", "comms_logger", "dump_state", "memory_breakdown",
               "prescale_gradients", "gradient_predivide_factor", "sparse_gradients", "zero_allow_untested_optimizer",
               "zero_force_ds_cpu_optimizer", "amp", "communication_data_type", "checkpoint", "aio", "autotuning",
               "elasticity", "pipeline", "data_efficiency", "compression_training", "curriculum_learning",
               "seq_parallel_communication_data_type", "disable_allgather", "train_batch_size_per_gpu",
               "gradient_accumulation_dtype", "eigenvalue", "progressive_layer_drop", "nebula", "sparse_attention",
               "quantize_training", "weight_quantization", "hybrid_engine", "timers", "torch_autocast")
ZEROLAB_KEYS = ("debug", "link", "trace", "units", "collectives",   # zerolab's own section
                "pipeline_schedule") + tuple(ZEROPP_KEYS)
# stages 1-2's collectives (engine/stage1.py): "reduce_scatter" = reduce-scatter the gradients, all-gather the
# parameters (the ring algorithm's bytes, NCCL's fast pair); "all_reduce" = all-reduce the gradients, each rank
# broadcasts its shard (gloo's fast pair); "per_backend" = all_reduce on gloo, reduce_scatter on any other backend
COLLECTIVES = ("per_backend", "reduce_scatter", "all_reduce")
PIPELINE_SCHEDULES = ("1f1b", "gpipe")   # engine.train_batch's order of forwards and backwards (chapter 10)


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
    link: str | dict | None = None          # LINKS preset name, {"intra": name, "inter": name}, or None
    trace: bool = False
    qwz_group_size: int = ZEROPP_KEYS["qwz_group_size"]   # ZeRO++ quantization groups (config/zero.py)
    qgz_group_size: int = ZEROPP_KEYS["qgz_group_size"]
    collectives: str = "per_backend"        # stages 1-2: "per_backend" | "reduce_scatter" | "all_reduce"
    pipeline_schedule: str = "1f1b"         # engine.train_batch under pp > 1: "1f1b" | "gpipe"
    units: tuple[str, ...] | None = None    # stage 3's wrap policy: module class names that are units (None: default)
    ignored: tuple[str, ...] = ()           # DeepSpeed keys accepted but not implemented
    notes: tuple[str, ...] = ()
    gas_given: bool = field(default=True, repr=False, compare=False)   # was gradient_accumulation_steps set?

    @property
    def precision(self) -> str:
        """ "fp32" | "mixed" | "mixed_fp32_grads" (the theory's PRECISIONS). """
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
        top = section(raw, "", ignored, TOP_KEYS, TOP_ALIASES, TOP_IGNORED)
        autos = auto_keys(raw)
        if autos:   # Hugging Face Trainer's placeholders: one warning naming them all
            msg = f'"auto" replaced by zerolab\'s defaults (zerolab.config.defaults) for: {", ".join(autos)}'
            warnings.warn(msg, UserWarning, stacklevel=3)
            notes.append(msg)
        fp16, bf16 = read_fp16(top.get("fp16"), ignored), read_bf16(top.get("bf16"), ignored)
        check_precision(fp16, bf16)
        zl = section(top.get("zerolab"), "zerolab", ignored, ZEROLAB_KEYS)
        cfg = cls(
            train_batch_size=read_int(top, "train_batch_size", "", None, minimum=1),
            train_micro_batch_size_per_gpu=read_int(top, "train_micro_batch_size_per_gpu", "", None, minimum=1),
            gradient_accumulation_steps=read_int(top, "gradient_accumulation_steps", "", 1, minimum=1),
            gradient_clipping=read_float(top, "gradient_clipping", "", 0.0),
            optimizer=read_optimizer(top.get("optimizer"), notes, ignored),
            scheduler=read_scheduler(top.get("scheduler"), ignored),
            fp16=fp16, bf16_enabled=bf16, grad_accum_dtype=read_grad_accum_dtype(top.get("data_types"), ignored),
            zero=read_zero(top.get("zero_optimization"), ignored, notes),
            debug=read_bool(zl, "debug", "zerolab", False), link=read_link(zl), trace=read_bool(zl, "trace", "zerolab", False),
            **{k: read_int(zl, k, "zerolab", v, minimum=0 if k == "qgz_group_size" else 1)
               for k, v in ZEROPP_KEYS.items()},
            units=read_units(zl),
            collectives=read_choice(zl, "collectives", "zerolab", "per_backend", COLLECTIVES),
            pipeline_schedule=read_choice(zl, "pipeline_schedule", "zerolab", "1f1b", PIPELINE_SCHEDULES),
            ignored=tuple(ignored), notes=tuple(notes),
            gas_given=read_int(top, "gradient_accumulation_steps", "", None, minimum=1) is not None)
        check_zeropp(cfg.zero, cfg.precision)
        mbs, gas, tbs = cfg.train_micro_batch_size_per_gpu, cfg.gradient_accumulation_steps, cfg.train_batch_size
        if tbs is not None and mbs is not None and tbs % (mbs * (gas if cfg.gas_given else 1)):
            raise ConfigError(f"train_batch_size ({tbs}) must equal train_micro_batch_size_per_gpu ({mbs}) x "
                              f"gradient_accumulation_steps ({gas}) x world size, but {tbs} is not a multiple "
                              f"of {mbs * gas}")
        if ignored:
            cfg.notes += (f"accepted but not implemented by zerolab (ignored): {', '.join(ignored)}",)
        if "activation_checkpointing" in ignored:   # its keys tune DeepSpeed's checkpoint; none chooses what
            cfg.notes += ("activation_checkpointing: what is recomputed is the model's choice; zerolab's switch is "
                          "zl.recompute(model, 'full' | 'selective')",)
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


def read_units(zl: dict) -> tuple[str, ...] | None:
    """``zerolab.units``: a list of module class names (the wrap policy; [] = one unit), or absent / null."""
    units = zl.get("units")
    if units is None:
        return None
    if isinstance(units, str) or not isinstance(units, (list, tuple)) or \
            not all(isinstance(u, str) and u.isidentifier() for u in units):
        raise ConfigError(f"zerolab.units: expected a list of module class names, e.g. [\"Block\", "
                          f"\"Embedding\"] ([] = the whole model is one unit), got {units!r}")
    return tuple(units)


def auto_keys(raw, path: str = "") -> list[str]:
    """The dotted paths of every "auto" value in a raw config (dicts nested in dicts)."""
    out = []
    for k, v in raw.items():
        full = f"{path}.{k}" if path else str(k)
        if isinstance(v, dict):
            out += auto_keys(v, full)
        elif isinstance(v, str) and is_auto(v):
            out.append(full)
    return out


def read_link(zl: dict):
    """A preset name, null, or one preset per tier: {"intra": "nvlink3", "inter": "ethernet-10g"}."""
    from zerolab.theory.network import LINKS
    link = zl.get("link")
    tiers = link if isinstance(link, dict) else {"": link}
    if isinstance(link, dict) and set(link) != {"intra", "inter"}:
        raise ConfigError(f"zerolab.link: a per-tier link needs exactly the keys 'intra' and 'inter', got {sorted(link)}")
    for tier, name in tiers.items():
        if (name is not None or tier) and name not in LINKS:
            where = f"zerolab.link.{tier}" if tier else "zerolab.link"
            raise ConfigError(f"{where}: {name!r} is not a preset; expected one of {tuple(sorted(LINKS))}"
                              + ("" if tier else " or null"))
    return dict(link) if isinstance(link, dict) else link
