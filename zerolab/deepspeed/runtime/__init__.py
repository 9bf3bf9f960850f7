"""``deepspeed.runtime``: the part scripts import directly (``runtime.utils.set_random_seed``)."""
from zerolab.deepspeed.runtime import lr_schedules, utils

__all__ = ["lr_schedules", "utils"]
