"""The ``optimizer`` and ``scheduler`` sections (chapters 4 and 12).

Key tables, defaults and readers side by side. Every parameter name is checked
here against what the engine's optimizer (``zerolab.engine.optim``) and
schedules accept, so a typo fails when the config is read, not at the first step.
Defaults (``OPTIMIZER_DEFAULTS``) are DeepSpeed's: weight decay 0 for Adam and
AdamW, torch.optim.AdamW's 0.01 with ``"torch_adam": true`` (as DeepSpeed).
``"type": "Adam"`` means what it means in DeepSpeed: AdamW (decoupled weight
decay) unless ``"adam_w_mode": false`` (then torch.optim.Adam, L2 decay).
"""
from __future__ import annotations

from dataclasses import dataclass, field

from zerolab.config.schema import ConfigError, read_float, section

OPTIMIZER_TYPES = {"adam": "Adam", "adamw": "AdamW", "sgd": "SGD"}
# torch.optim names each optimizer takes
OPTIMIZER_PARAMS = {"adam": ("lr", "betas", "eps", "weight_decay"),
                    "adamw": ("lr", "betas", "eps", "weight_decay"),
                    "sgd": ("lr", "momentum", "dampening", "nesterov", "weight_decay")}
# DeepSpeed's optimizer switches with no meaning here: accepted and listed in Config.ignored
OPTIMIZER_IGNORED = ("bias_correction", "amsgrad_mode", "fused")
# the defaults of each optimizer's params, as DeepSpeed's FusedAdam / DeepSpeedCPUAdam (weight decay 0)
OPTIMIZER_DEFAULTS = {"adam": {"lr": 1e-3, "betas": (0.9, 0.999), "eps": 1e-8, "weight_decay": 0.0},
                      "adamw": {"lr": 1e-3, "betas": (0.9, 0.999), "eps": 1e-8, "weight_decay": 0.0},
                      "sgd": {"lr": 1e-3, "momentum": 0.0, "dampening": 0.0, "nesterov": False, "weight_decay": 0.0}}
TORCH_ADAMW_WEIGHT_DECAY = 0.01   # torch.optim.AdamW's default: DeepSpeed's with "torch_adam": true
# torch.optim flags zerolab's optimizer does not implement: an error when switched on
OPTIMIZER_UNSUPPORTED = ("amsgrad", "maximize", "foreach", "capturable", "differentiable")
SCHEDULER_PARAMS = {"WarmupLR": ("warmup_min_lr", "warmup_max_lr", "warmup_num_steps", "warmup_type",
                                 "last_batch_iteration"),
                    "WarmupDecayLR": ("total_num_steps", "warmup_min_lr", "warmup_max_lr", "warmup_num_steps",
                                      "warmup_type", "last_batch_iteration")}
SCHEDULER_TYPES = tuple(SCHEDULER_PARAMS)


@dataclass
class OptimizerConfig:
    type: str = "adam"              # normalised lower case: "adam" | "adamw" | "sgd"
    params: dict = field(default_factory=dict)   # torch.optim names: lr, betas, eps, weight_decay, momentum


@dataclass
class SchedulerConfig:
    type: str = "WarmupLR"          # "WarmupLR" | "WarmupDecayLR"
    params: dict = field(default_factory=dict)


def _is_auto(v) -> bool:
    return isinstance(v, str) and v.strip().lower() == "auto"


def read_optimizer(raw, notes: list, ignored: list) -> OptimizerConfig:
    if raw is None:
        return OptimizerConfig()
    d = section(raw, "optimizer", ignored, ("type", "params"))
    typ = d.get("type", "adam")
    if not isinstance(typ, str) or typ.lower() not in OPTIMIZER_TYPES:
        raise ConfigError(f"optimizer.type: {typ!r} is not supported; expected one of "
                          f"{tuple(OPTIMIZER_TYPES.values())}")
    typ = typ.lower()
    params = d.get("params") or {}
    if not isinstance(params, dict):
        raise ConfigError(f"optimizer.params: expected a JSON object, got {params!r}")
    params = {k: v for k, v in params.items() if not _is_auto(v)}
    for k in OPTIMIZER_IGNORED:
        if params.pop(k, None) is not None:
            ignored.append(f"optimizer.params.{k}")
    torch_adam = params.pop("torch_adam", False)
    w_mode = params.pop("adam_w_mode", None)
    if w_mode is not None and not isinstance(w_mode, bool):
        raise ConfigError(f"optimizer.params.adam_w_mode: expected true or false, got {w_mode!r}")
    if typ == "adam" and w_mode is not False:   # DeepSpeed: "Adam" is AdamW unless adam_w_mode is false
        typ = "adamw"
        notes.append("optimizer: 'Adam' is AdamW (decoupled weight decay), as DeepSpeed's adam_w_mode defaults to "
                     "true; \"adam_w_mode\": false gives torch.optim.Adam (L2 weight decay)")
    elif typ == "adam":
        notes.append("optimizer: 'Adam' with adam_w_mode false is torch.optim.Adam (L2 weight decay)")
    if torch_adam is True and typ == "adamw" and "weight_decay" not in params:   # torch.optim.AdamW's default
        params["weight_decay"] = TORCH_ADAMW_WEIGHT_DECAY
    check_optimizer_params(typ, params)
    if "betas" in params:
        params["betas"] = tuple(params["betas"])
    return OptimizerConfig(type=typ, params=params)


def check_optimizer_params(typ: str, params: dict) -> None:
    """Names and values of ``optimizer.params`` for ``typ`` ("adam" | "adamw" | "sgd")."""
    on = [k for k in OPTIMIZER_UNSUPPORTED if params.get(k)]
    if on:
        raise ConfigError(f"optimizer.params: {on} are not supported by zerolab's optimizer")
    unknown = sorted(k for k in params if k not in OPTIMIZER_PARAMS[typ] and k not in OPTIMIZER_UNSUPPORTED)
    if unknown:
        raise ConfigError(f"optimizer.params: unknown for {OPTIMIZER_TYPES[typ]}: {unknown}; "
                          f"allowed: {OPTIMIZER_PARAMS[typ]}")
    for k in ("lr", "eps", "weight_decay", "momentum", "dampening"):
        v = params.get(k)
        if v is not None and (isinstance(v, bool) or not isinstance(v, (int, float)) or v < 0):
            raise ConfigError(f"optimizer.params.{k}: expected a number >= 0, got {v!r}")
    betas = params.get("betas")
    if betas is not None and not (isinstance(betas, (list, tuple)) and len(betas) == 2
                                  and all(isinstance(b, (int, float)) and 0 <= b < 1 for b in betas)):
        raise ConfigError(f"optimizer.params.betas: expected two numbers in [0, 1), got {betas!r}")
    if params.get("nesterov") and (float(params.get("momentum", 0)) <= 0 or float(params.get("dampening", 0)) != 0):
        raise ConfigError("optimizer.params.nesterov: needs momentum > 0 and dampening 0 (as torch.optim.SGD)")


def read_scheduler(raw, ignored: list) -> SchedulerConfig | None:
    if raw is None:
        return None
    d = section(raw, "scheduler", ignored, ("type", "params"))
    typ = d.get("type")
    if typ not in SCHEDULER_TYPES:
        raise ConfigError(f"scheduler.type: {typ!r} is not supported; expected one of {SCHEDULER_TYPES}")
    params = {k: v for k, v in (d.get("params") or {}).items() if not _is_auto(v)}
    unknown = sorted(k for k in params if k not in SCHEDULER_PARAMS[typ])
    if unknown:
        raise ConfigError(f"scheduler.params: unknown for {typ}: {unknown}; allowed: {SCHEDULER_PARAMS[typ]}")
    for k in ("warmup_min_lr", "warmup_max_lr", "warmup_num_steps", "total_num_steps"):
        read_float(params, k, "scheduler.params", None)
    wt = params.get("warmup_type", "log")
    if wt not in ("log", "linear"):
        raise ConfigError(f"scheduler.params.warmup_type: {wt!r} is not allowed; expected one of ('log', 'linear')")
    if typ == "WarmupDecayLR" and "total_num_steps" not in params:
        raise ConfigError("scheduler.params.total_num_steps: required by WarmupDecayLR")
    return SchedulerConfig(type=typ, params=params)
