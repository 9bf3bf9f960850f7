"""``deepspeed.runtime``: the part scripts import directly (``runtime.utils.set_random_seed``)."""
from zerolab.deepspeed.runtime import utils

__all__ = ["utils"]
