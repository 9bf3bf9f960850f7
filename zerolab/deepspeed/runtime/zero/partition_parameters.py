"""``deepspeed.runtime.zero.partition_parameters``: where DeepSpeed defines ``Init``; transformers reaches in.

transformers' ``from_pretrained`` under ZeRO-3 swaps ``zero_wrapper_for_fp_tensor_constructor`` for the
time of ``zero.Init`` (so that ``torch.arange`` keeps its dtype in RoPE buffers). DeepSpeed's ``Init``
wraps every tensor constructor to create floating tensors in its dtype; zerolab's casts the parameters
when it partitions them and wraps no constructor, so the swap has nothing to change — the names exist so
that the library's code runs as written.
"""
from __future__ import annotations

import torch

from zerolab.deepspeed.accelerator import get_accelerator
from zerolab.deepspeed.zero import GatheredParameters, Init

_orig_torch_arange = torch.arange


def zero_wrapper_for_fp_tensor_constructor(fn, target_fp_dtype, target_device=None):
    """DeepSpeed's wrapper: ``fn``'s floating results in ``target_fp_dtype`` on ``target_device``
    (never installed by zerolab's ``Init``; a script may call it)."""
    def wrapped(*args, **kwargs):
        if kwargs.get("device") is None and target_device is not None:
            kwargs["device"] = target_device
        t = fn(*args, **kwargs)
        return t.to(target_fp_dtype) if t.is_floating_point() else t
    return wrapped


__all__ = ["GatheredParameters", "Init", "get_accelerator", "zero_wrapper_for_fp_tensor_constructor"]
