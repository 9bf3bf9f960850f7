"""``deepspeed.moe.layer.MoE``: refused. DeepSpeed's MoE layer shards experts over an expert-parallel group with
all-to-all token routing; zerolab has no expert parallelism."""
from __future__ import annotations


class MoE:
    def __init__(self, *args, **kwargs):
        raise NotImplementedError(
            "deepspeed.moe.layer.MoE: expert parallelism (experts sharded over ranks, all-to-all routing) is not "
            "implemented by zerolab. Build the mixture of experts as an ordinary module (every rank holds every "
            "expert; ZeRO shards them like any parameter) and mark its block with "
            "deepspeed.utils.set_z3_leaf_modules at stage 3")


__all__ = ["MoE"]
