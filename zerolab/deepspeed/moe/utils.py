"""``deepspeed.moe.utils``: ``split_params_into_different_moe_groups_for_optimizer`` and ``is_moe_param``.

DeepSpeed moves each expert-parallel parameter (one its MoE layer marked
``allreduce = False``) into a group of its own; other parameters stay where they
are. The door has no expert-parallel parameters (``zerolab.parallel.MoELayer``'s train beside the engine,
chapter 11), so a model's groups come back as DeepSpeed returns them for a model without MoE layers: a list,
the same groups.
"""
from __future__ import annotations


def is_moe_param(param) -> bool:
    """DeepSpeed's test: an expert-parallel parameter carries ``allreduce = False``."""
    return hasattr(param, "allreduce") and not param.allreduce


def split_params_into_different_moe_groups_for_optimizer(param_groups, max_group_size=178956971) -> list:
    if isinstance(param_groups, tuple):
        param_groups = list(param_groups)
    elif isinstance(param_groups, dict):
        param_groups = [param_groups]
    elif not isinstance(param_groups, list):
        raise ValueError(f"Unknown param group type of {type(param_groups)}")
    for group in param_groups:
        moe = [p for p in group["params"] if is_moe_param(p)]
        if moe:
            raise NotImplementedError("split_params_into_different_moe_groups_for_optimizer: parameters marked "
                                      "allreduce=False (expert-parallel) are not supported by the DeepSpeed door, "
                                      "whose engine would average them over every DP rank; train zerolab.parallel."
                                      "MoELayer's experts beside zl.initialize (detach_experts, reduce_expert_grads), "
                                      "or the experts as ordinary data-parallel parameters")
        group["params"] = list(group["params"])
    return param_groups
