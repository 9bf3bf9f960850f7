"""``zl.estimate_config``: the memory model (``zerolab.theory``) for a DeepSpeed config (chapter 12)."""
from __future__ import annotations

from zerolab.config.core import Config
from zerolab.theory.memory import Estimate, estimate


def estimate_config(psi, n_gpus, config) -> Estimate:
    """``estimate`` for a ``zl.Config`` (or DeepSpeed dict/path): stage, precision,
    optimizer (SGD with momentum > 0 -> "sgd_momentum") and offload devices from it."""
    cfg = Config.from_any(config)
    opt = cfg.optimizer.type
    if opt == "sgd" and float(cfg.optimizer.params.get("momentum", 0) or 0) > 0:
        opt = "sgd_momentum"
    z = cfg.zero
    return estimate(psi, n_gpus, z.stage, cfg.precision, opt, z.offload_optimizer.device, z.offload_param.device)

