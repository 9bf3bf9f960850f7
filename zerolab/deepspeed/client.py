"""A client optimizer (``deepspeed.initialize(optimizer=...)``) read into the config zerolab's engine runs.

DeepSpeed wraps the optimizer object it is given; zerolab's engines keep the
optimizer state themselves, flat and sharded (``zerolab.engine.optim``), so
they can honour a client optimizer only when they can *read* it: an unused
``torch.optim.Adam``, ``AdamW`` or ``SGD`` (or a callable returning one, as
DeepSpeed accepts) becomes the config's ``"optimizer"`` section, and its
parameter groups become ``model_parameters`` (per-group ``lr``,
``weight_decay``...). Anything else is refused with an error naming it. The
optimizer object stays the holder of the learning rates a client scheduler
writes (``schedules.py``).
"""
from __future__ import annotations

import torch

from zerolab.config.optimizer import OPTIMIZER_PARAMS, OPTIMIZER_UNSUPPORTED

# exact classes (as DeepSpeed's ZERO_SUPPORTED_OPTIMIZERS checks type(), not isinstance)
CLIENT_OPTIMIZERS = {torch.optim.Adam: "Adam", torch.optim.AdamW: "AdamW", torch.optim.SGD: "SGD"}


def _plain(v):
    """A hyper-parameter as JSON would hold it (torch allows tensor lr and tuple betas)."""
    if isinstance(v, torch.Tensor):
        return v.item()
    return list(v) if isinstance(v, tuple) else v


def read_client_optimizer(optimizer, model_parameters, model):
    """``(config "optimizer" section, parameter groups, the torch optimizer)`` for ``optimizer=`` of
    ``deepspeed.initialize`` (a callable is called; its optimizer holds the learning rates a client scheduler sets)."""
    if not isinstance(optimizer, torch.optim.Optimizer) and callable(optimizer):
        # DeepSpeedOptimizerCallable: called with model_parameters (without them DeepSpeed passes None
        # and torch fails; here the model's trainable parameters)
        if model_parameters is None:
            model_parameters = [p for p in model.parameters() if p.requires_grad]
        optimizer = optimizer(model_parameters)
    name = CLIENT_OPTIMIZERS.get(type(optimizer))
    if name is None and type(optimizer).__name__ in ("FusedAdam", "DeepSpeedCPUAdam") and \
            type(optimizer).__module__.startswith("zerolab."):
        name = "AdamW" if optimizer.adam_w_mode else "Adam"   # deepspeed.ops.adam's, as zerolab gives them
    if name is None:
        what = f"{type(optimizer).__module__}.{type(optimizer).__qualname__}"
        raise NotImplementedError(
            f"deepspeed.initialize(optimizer=<{what}>): zerolab cannot shard this optimizer -- its engines keep "
            f"the optimizer state themselves, flat and partitioned across ranks, and implement only "
            f"torch.optim.Adam, AdamW and SGD. Pass one of those, or name the optimizer in the config's "
            f"\"optimizer\" section (\"Adam\", \"AdamW\", \"SGD\")")
    if name == "Adam" and optimizer.defaults.get("decoupled_weight_decay"):
        name = "AdamW"   # torch's Adam(decoupled_weight_decay=True) is AdamW
    if optimizer.state:
        raise ValueError(f"deepspeed.initialize(optimizer=...): this {name} has already taken steps (it holds "
                         f"state); zerolab builds the optimizer state afresh, sharded. Pass a fresh optimizer, "
                         f"or resume with engine.load_checkpoint")
    flags = sorted({k for g in optimizer.param_groups for k in OPTIMIZER_UNSUPPORTED if g.get(k)} - {"foreach"})
    if flags:
        raise NotImplementedError(f"deepspeed.initialize(optimizer=torch.optim.{name}({', '.join(f'{k}=True' for k in flags)}"
                                  f")): zerolab's optimizer does not implement {flags}")
    key = name.lower()
    params = {k: _plain(optimizer.defaults[k]) for k in OPTIMIZER_PARAMS[key] if k in optimizer.defaults}
    if key == "adam":
        params["adam_w_mode"] = False   # torch.optim.Adam: L2 weight decay (DeepSpeed's "Adam" means AdamW)
    groups = []
    for g in optimizer.param_groups:
        if not g["params"]:
            continue   # DeepSpeed drops empty groups too
        over = {k: _plain(g[k]) for k in OPTIMIZER_PARAMS[key] if k in g and _plain(g[k]) != params.get(k)}
        groups.append({"params": list(g["params"]), **over})
    return {"type": name, "params": params}, groups, optimizer
