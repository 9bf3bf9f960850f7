"""The offloading engines: a stage class plus what offload changes, one named class each (chapter 7).

    ZeRO-Offload (optimizer state and step on the CPU, in RAM or on NVMe):
        Stage1OffloadEngine, Stage2OffloadEngine, Stage3OffloadEngine      = OffloadMixin + stage
                                            (stages 2-3: + WholeBucketStaging, a bucket to the host at once)
    ZeRO-Infinity's parameter offload (stage 3's parameter shard in RAM or on NVMe):
        Stage3ParamOffloadEngine                                          = ParamOffloadMixin + stage 3
        Stage3FullOffloadEngine        (both)                             = OffloadMixin + ParamOffloadMixin + stage 3

``OffloadMixin`` is in ``optimizer_mixin.py``, ``ParamOffloadMixin`` in ``params.py``;
``offload_engine`` picks the class for a config's ``zero_optimization`` section.
"""
from __future__ import annotations

from zerolab.engine.offload.optimizer_mixin import OffloadMixin
from zerolab.engine.offload.params import ParamOffloadMixin
from zerolab.engine.stage1 import Stage1Engine
from zerolab.engine.stage2 import Stage2Engine
from zerolab.engine.stage3 import Stage3Engine
from zerolab.engine.whole_buckets import WholeBucketStaging


class Stage1OffloadEngine(OffloadMixin, Stage1Engine):
    """ZeRO-1 with the optimizer shard's state and step on the CPU (RAM or NVMe)."""


class Stage2OffloadEngine(OffloadMixin, WholeBucketStaging, Stage2Engine):
    """ZeRO-2 with the optimizer shard's state and step on the CPU: ZeRO-Offload's setting."""


class Stage3OffloadEngine(OffloadMixin, WholeBucketStaging, Stage3Engine):
    """ZeRO-3 with the optimizer shard's state and step on the CPU."""


class Stage3ParamOffloadEngine(ParamOffloadMixin, Stage3Engine):
    """ZeRO-3 with the parameter shard in host RAM or on NVMe; the optimizer stays on the device."""


class Stage3FullOffloadEngine(OffloadMixin, ParamOffloadMixin, WholeBucketStaging, Stage3Engine):
    """ZeRO-Infinity: parameter shard and optimizer state both off the device."""


# (stage, optimizer offloaded, parameters offloaded) -> class
OFFLOAD_ENGINES = {
    (1, True, False): Stage1OffloadEngine,
    (2, True, False): Stage2OffloadEngine,
    (3, True, False): Stage3OffloadEngine,
    (3, False, True): Stage3ParamOffloadEngine,
    (3, True, True): Stage3FullOffloadEngine,
}


def offload_engine(zero):
    """The engine class for a ``zero_optimization`` section that offloads something
    (the config has already checked the stage allows it)."""
    return OFFLOAD_ENGINES[(zero.stage, zero.offload_optimizer.device != "none", zero.offload_param.device != "none")]
