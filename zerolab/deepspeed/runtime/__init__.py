"""``deepspeed.runtime``: the part scripts import directly (``runtime.utils.set_random_seed``), and
``runtime.zero.partition_parameters``, which transformers reaches into under ZeRO-3."""
from zerolab.deepspeed.runtime import lr_schedules, utils, zero

__all__ = ["lr_schedules", "utils", "zero"]
