"""Pipeline parallelism: a model's blocks split into stages, micro-batches sent point to point (chapter 10).

``pipeline_stage(model, mesh)`` keeps this rank's contiguous share of the
blocks — of an ``nn.Sequential`` (or list) of blocks, or of a GPT-shaped model
(``wte``, ``wpe``, ``blocks``, ``ln_f``, ``head``: the embeddings go to the first
stage, the final LayerNorm and head to the last) — under their original names.
``zl.initialize(model, config, mesh=mesh)`` calls it when pp > 1: the user passes
the whole model. A head tied to the embedding (``tie_weights=True``) is kept on
both the first and the last stage, as Megatron-LM keeps it: ``sync_tied`` starts
the last stage's copy from the first stage's, their gradients are summed over the
embedding group (``mesh.communicator("embed")``) before the DP reduction, so both
copies get the same update; the gradient norm counts it once (``engine/mesh_norm.py``).

``train_batch(stage, mesh, batches, loss_fn, schedule_kind)`` (``pipeline_run.py``;
``engine.train_batch(batches, loss_fn)`` delegates to it) runs one step's
micro-batches through the pipeline: the first stage reads the inputs, the last
computes the loss on the targets, activations go forward and their gradients
backward between neighbouring stages of the PP group (one send per micro-batch
and boundary, booked under ``group="pp"``). ``stage`` is the stage module (plain
autograd: the gradients accumulate in ``.grad``, divided by the number of
micro-batches) or a zerolab engine built over it with ``mesh=`` (ZeRO-0/1 over the
DP group; ``engine.step()`` after every backward, so the optimizer steps after
the last micro-batch). What the step measured — each F and B's start and end,
the micro-batches in flight, the activation bytes kept, the bubble — is left in
``.pipeline_stats`` (``pipeline_stats.py``; ``pipeline_bubble`` over all ranks).

Schedules (``pipeline_schedule.py``; lists of ("F" | "B", micro-batch) per stage):
``"gpipe"`` — every forward, then every backward (m micro-batches' activations in
flight); ``"1f1b"`` — p - s - 1 warm-up forwards on stage s, then one forward and
one backward in turn, then the remaining backwards (at most p - s in flight).
The bubble is (p - 1)/(m + p - 1) of the step in both. Modern schedules, on a plain stage module:
``"interleaved"`` — Megatron-LM's virtual stages, v chunks per rank (``pipeline_stage(model, mesh,
virtual=v)``; ``pipeline_interleaved.py``), bubble (p - 1)/(v·m + p - 1); ``"zb-h1"`` — zero bubble:
the backward split into B (the input's gradient) and W (the weights', deferred to fill the bubble;
``pipeline_zb.py``), bubble (p-1)(f+b-w) in time against 1F1B's (p-1)(f+b+w). Each schedule's
formula against its order simulated with unit costs: ``theory/bubble.py``.
"""
from __future__ import annotations

from collections import OrderedDict

import torch
from torch import nn

from zerolab.parallel.pipeline_blocks import as_sequential
from zerolab.parallel.pipeline_interleaved import chunked_stage
from zerolab.parallel.pipeline_run import pipeline_bubble, train_batch
from zerolab.parallel.pipeline_schedule import SCHEDULES, P2P, schedule, split_blocks

__all__ = ["schedule", "split_blocks", "pipeline_stage", "is_stage", "sync_tied", "train_batch", "pipeline_bubble",
           "GPTStage", "SCHEDULES", "P2P"]


class GPTStage(nn.Module):
    """Stage ``s`` of a GPT-shaped model: its blocks (original indices), plus the embeddings on the
    first stage and the final LayerNorm and head on the last."""

    def __init__(self, model, lo, hi, first, last, tied=False):
        super().__init__()
        self.first, self.last = first, last
        # a head tied to the embedding (pp > 1): both stages hold a copy, their gradients summed over
        # the embedding group; the last stage's copy is not counted again in the gradient norm
        self.tied = (["wte.weight"] if first else ["head.weight"]) if tied and (first or last) else []
        self.tied_copies = ["head.weight"] if tied and last and not first else []
        if first:
            self.wte, self.wpe = model.wte, model.wpe
        self.blocks = nn.ModuleDict(OrderedDict((str(i), model.blocks[i]) for i in range(lo, hi)))
        if last:
            self.ln_f, self.head = model.ln_f, model.head

    def forward(self, x):
        if self.first:
            x = self.wte(x) + self.wpe(torch.arange(x.shape[1], device=x.device))
        for block in self.blocks.values():
            x = block(x)
        return self.head(self.ln_f(x)) if self.last else x


def pipeline_stage(model, mesh, virtual: int = 1) -> nn.Module:
    """This rank's stage of ``model`` (``mesh.pp`` stages, ``mesh.pp_rank`` this one); with ``virtual`` = v > 1
    its v chunks for the interleaved schedule (``pipeline_interleaved.chunked_stage``)."""
    p, s = mesh.pp, mesh.pp_rank
    if p > 1 and getattr(mesh, "cp", 1) > 1:
        raise ValueError(f"pipeline_stage: pp={p} with cp={mesh.cp} (context parallelism) is not supported: a stage "
                         f"numbers its tokens' positions from 0 and runs the blocks as modules, while each cp rank "
                         f"holds a later chunk of the sequence (ContextParallelLM: its own forward); use pp=1 with "
                         f"cp > 1, or cp=1 with pp > 1")
    if is_stage(model):
        raise ValueError(f"pipeline_stage: {type(model).__name__} is already stage {model.pipeline_position[0]} of "
                         f"{model.pipeline_position[1]}; pass the whole model")
    if not isinstance(virtual, int) or virtual < 1:
        raise ValueError(f"pipeline_stage: virtual (model chunks per rank) must be an int >= 1, got {virtual!r}")
    if virtual > 1:
        return chunked_stage(model, mesh, virtual)
    if all(hasattr(model, a) for a in ("wte", "wpe", "blocks", "ln_f", "head")):
        lo, hi = split_blocks(len(model.blocks), p)[s]
        tied = p > 1 and model.head.weight is model.wte.weight
        stage = GPTStage(model, lo, hi, s == 0, s == p - 1, tied)
    else:
        model = as_sequential(model)
        bounds = split_blocks(len(model), p)
        owner = {id(q): k for k, (lo, hi) in enumerate(bounds) for i in range(lo, hi) for q in model[i].parameters()}
        lo, hi = bounds[s]
        for i in range(lo, hi):
            for name, q in model[i].named_parameters():
                if owner[id(q)] != s:
                    raise ValueError(f"pipeline_stage: parameter {i}.{name} is shared with stage {owner[id(q)]}; "
                                     f"only a GPT's embedding tied to its head may cross stages")
        stage = nn.Sequential(OrderedDict((str(i), model[i]) for i in range(lo, hi)))
        stage.tied, stage.tied_copies = [], []
    stage.pipeline_position = (s, p)
    return stage


def is_stage(model) -> bool:
    """Whether ``model`` is a stage ``pipeline_stage`` cut (``zl.initialize`` then keeps it as it is)."""
    return getattr(model, "pipeline_position", None) is not None


@torch.no_grad()
def sync_tied(stage, mesh) -> None:
    """Collective over the embedding group: the last stage's copy of a tied weight starts as the
    first stage's (both copies are then updated identically). Nothing without a tied weight."""
    if not getattr(stage, "tied", None):
        return
    params = dict(stage.named_parameters())
    comm = mesh.communicator("embed")
    for name in stage.tied:
        comm.broadcast(params[name].data, src=0, tag="tied-init")   # group rank 0: the first stage
