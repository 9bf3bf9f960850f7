"""``deepspeed.ops``: the optimizer classes scripts and Accelerate construct (``ops.adam``)."""
from zerolab.deepspeed.ops import adam

__all__ = ["adam"]
