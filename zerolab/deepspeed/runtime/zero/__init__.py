"""``deepspeed.runtime.zero``: the module path libraries reach into (transformers' ZeRO-3 loading)."""
from zerolab.deepspeed.runtime.zero import partition_parameters
from zerolab.deepspeed.zero import GatheredParameters, Init

__all__ = ["GatheredParameters", "Init", "partition_parameters"]
