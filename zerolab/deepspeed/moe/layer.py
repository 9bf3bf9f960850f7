"""``deepspeed.moe.layer.MoE``: refused by the DeepSpeed door. DeepSpeed's layer (random token selection, second-
expert sampling, its engine's expert parameter groups) is not reproduced here; zerolab's own expert parallelism
is ``zerolab.parallel.MoELayer`` (chapter 11), trained beside ``zl.initialize``."""
from __future__ import annotations


class MoE:
    def __init__(self, *args, **kwargs):
        raise NotImplementedError(
            "deepspeed.moe.layer.MoE: DeepSpeed's expert parallelism (its gate's random token selection and "
            "second-expert sampling, deepspeed.initialize's expert parameter groups) is not implemented by zerolab's "
            "DeepSpeed door. zerolab's own is zerolab.parallel.MoELayer over zl.mesh(dp=, ep=).communicator('ep'), "
            "with detach_experts and reduce_expert_grads beside zl.initialize (chapter 11); or build the mixture as "
            "an ordinary module (every rank holds every expert; ZeRO shards them like any parameter) and mark its "
            "block with deepspeed.utils.set_z3_leaf_modules at stage 3")


__all__ = ["MoE"]
