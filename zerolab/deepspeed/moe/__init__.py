"""``deepspeed.moe``: the parameter-group helper scripts call on any model (``utils``); the MoE layer is refused
(``layer``): the door has no expert parallelism (a model's own experts train as ordinary parameters;
zerolab's own is ``zerolab.parallel.MoELayer``)."""
from zerolab.deepspeed.moe import layer, utils

__all__ = ["layer", "utils"]
