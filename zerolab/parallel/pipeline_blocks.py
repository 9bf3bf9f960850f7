"""What a pipeline can cut: a model's blocks as an ``nn.Sequential`` (chapter 10; ``pipeline.py`` is the overview).

``pipeline_stage`` (contiguous stages) and ``pipeline_interleaved.chunked_stage`` (virtual stages)
both cut a model that is not GPT-shaped by its blocks; ``as_sequential`` is their one reading of it.
It sits in a file of its own because ``pipeline.py`` imports ``pipeline_interleaved``.
"""
from __future__ import annotations

from torch import nn


def as_sequential(model) -> nn.Sequential:
    """``model`` as an ``nn.Sequential`` of blocks: a list or ``nn.ModuleList`` becomes one, an
    ``nn.Sequential`` is itself, anything else is refused by name."""
    if isinstance(model, (list, nn.ModuleList)):
        model = nn.Sequential(*model)
    if not isinstance(model, nn.Sequential):
        raise ValueError(f"pipeline_stage: a model is split by its blocks: an nn.Sequential (or list) of "
                         f"blocks, or a GPT-shaped model (wte, wpe, blocks, ln_f, head); got "
                         f"{type(model).__name__}, which cannot be cut")
    return model
