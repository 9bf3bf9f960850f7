"""The DeepSpeed JSON, read and validated once (chapter 12): ``zl.Config``, ``zl.ConfigError``.

    cfg = zl.Config.from_deepspeed("ds.json", world_size=8)

Files: ``schema`` (shared readers), one per section (``zero``, ``optimizer``,
``precision``), ``core`` (the top level, ``Config``), ``estimate``
(``estimate_config``: the memory model for a config). Imports the theory only.
"""
from zerolab.config.core import Config
from zerolab.config.estimate import estimate_config
from zerolab.config.optimizer import OptimizerConfig, SchedulerConfig
from zerolab.config.precision import FP16Config
from zerolab.config.schema import ConfigError
from zerolab.config.zero import OffloadConfig, ZeroConfig

__all__ = ["Config", "ConfigError", "ZeroConfig", "OffloadConfig", "OptimizerConfig", "SchedulerConfig",
           "FP16Config", "estimate_config"]
