"""``deepspeed.moe``: the parameter-group helper scripts call on any model (``utils``); the MoE layer is refused
(``layer``): zerolab has no expert parallelism (a model's own experts train as ordinary parameters)."""
from zerolab.deepspeed.moe import layer, utils

__all__ = ["layer", "utils"]
