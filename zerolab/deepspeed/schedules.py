"""Client learning-rate schedulers (``deepspeed.initialize(lr_scheduler=...)``) driving zerolab's engine.

DeepSpeed takes a torch scheduler object, or a callable it calls with the
optimizer (how Accelerate's ``DummyScheduler(lr_scheduler_callable=...)`` and
the Hugging Face Trainer's schedules arrive), and steps it after each optimizer
step that was applied. A torch scheduler writes ``lr`` into its optimizer's
``param_groups``; zerolab's engine reads each group's rate from there at every
step (``ShardedOptimizer.lr_source``). The optimizer the scheduler holds is the
client's torch optimizer, or, when the config names the optimizer, a torch
optimizer of the config's kind over the same groups that is never stepped (it
holds no state) -- the scheduler's handle on the learning rates.
"""
from __future__ import annotations

import torch

from zerolab.config.optimizer import OPTIMIZER_DEFAULTS

TORCH = {"adam": torch.optim.Adam, "adamw": torch.optim.AdamW, "sgd": torch.optim.SGD}


def rate_holder(config_optimizer, groups, model):
    """A torch optimizer holding the config's groups and learning rates, for a scheduler to write into."""
    params = list(groups) if groups is not None else [p for p in model.parameters() if p.requires_grad]
    hyper = {**OPTIMIZER_DEFAULTS[config_optimizer.type], **config_optimizer.params}
    return TORCH[config_optimizer.type](params, **hyper)


def make_client_scheduler(lr_scheduler, holder):
    """The scheduler object: ``lr_scheduler`` itself (it must drive ``holder``), or ``lr_scheduler(holder)``."""
    if lr_scheduler is None:
        return None
    if not hasattr(lr_scheduler, "step") and callable(lr_scheduler):
        lr_scheduler = lr_scheduler(holder)
    bound = getattr(lr_scheduler, "optimizer", None)
    if bound is not holder:
        raise ValueError(f"deepspeed.initialize(lr_scheduler=<{type(lr_scheduler).__name__}>): the scheduler drives "
                         f"a different optimizer from the one given to initialize; build it on that optimizer "
                         f"(or pass a callable taking the optimizer)")
    if not hasattr(lr_scheduler, "step"):
        raise TypeError(f"deepspeed.initialize(lr_scheduler=...): expected a torch LR scheduler or a callable "
                        f"returning one, got {type(lr_scheduler).__name__}")
    return lr_scheduler


def lr_source(holder, live: list[int]):
    """The engine's per-group learning rates: ``holder.param_groups[i]["lr"]`` for the groups it trains."""
    return lambda: [holder.param_groups[i]["lr"] for i in live]
