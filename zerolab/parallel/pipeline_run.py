"""One training step through the pipeline: ``train_batch`` (chapter 10; ``pipeline.py`` is the overview).

``train_batch(stage, mesh, batches, loss_fn, schedule_kind)`` runs this rank's
schedule: a forward receives its input from the previous stage (the first stage
reads the micro-batch), a backward receives its output's gradient from the next
stage (the last stage starts from the loss). ``stage``: a stage module (plain
autograd, gradients in ``.grad``) or an engine over it (``engine.train_batch``
delegates here; ZeRO-0/1 reduce over the DP group at the last micro-batch, the
optimizer steps once). With pp == 1 (``mesh`` None or ``mesh.pp == 1``) it is plain
gradient accumulation: forward, backward, step per micro-batch.

A weight tied between the first and the last stage (``stage.tied``) has a copy on
both: before the data-parallel reduction its two local gradients are summed over
the embedding group (``mesh.communicator("embed")``, booked under "embed"). An
engine would reduce during the last backward, while the other stage's gradient is
not complete (the last stage finishes first, and the first stage waits for it): so
the last backward keeps its gradients local, the tied gradient is summed, then the
engine's gradient buckets are reduced as that backward would have, and it steps.
The loss returned is the mean over the micro-batches and the DP group, the same on
every rank (broadcast from the last stage, booked under "pp"; the DP mean, a
bookkeeping all-reduce, in ``ledger.control``). ``stage.pipeline_stats`` (or ``engine.pipeline_stats``): what the step
measured (``pipeline_stats.py``).

The modern schedules run on a plain stage module (gradients in ``.grad``; the caller's optimizer
steps): ``"interleaved"`` on a stage cut into v chunks (``pipeline_stage(model, mesh, virtual=v)``;
each action names its chunk, virtual stage j = chunk·p + rank receives from j - 1 and sends to
j + 1, around the ranks), ``"zb-h1"`` with the backward split: the forward runs under
``split_linears`` (``pipeline_zb.py``), "B" sends the input's gradient back, "W" (``run_w``)
adds the deferred weight gradients later. An engine reduces and steps inside its one backward
per micro-batch: those schedules refuse it by name.
"""
from __future__ import annotations

import contextlib

import torch

from zerolab.parallel.pipeline_interleaved import ChunkedStage
from zerolab.parallel.pipeline_schedule import P2P, schedule
from zerolab.parallel.pipeline_stats import StepRecorder, pipeline_bubble
from zerolab.parallel.pipeline_trace import PipeTracer
from zerolab.parallel.pipeline_zb import run_w, split_linears
from zerolab.theory.replay_pipe import p2p_tag   # the one rule both the run and its replay follow

__all__ = ["train_batch", "pipeline_bubble"]


def _is_engine(stage) -> bool:
    return hasattr(stage, "backward") and hasattr(stage, "gas") and hasattr(stage, "step")


def train_batch(stage, mesh, batches, loss_fn, schedule_kind: str = "1f1b", trace=None) -> float:
    """One step over ``batches`` (a list of (inputs, targets), the same on every stage of a
    pipeline) through the pipeline; returns the mean loss, the same on every rank. ``stage``:
    this rank's stage module, or an engine over it (then ``len(batches)`` must be its
    gradient_accumulation_steps). What a stage returns passes to the next as it is: a tensor or a
    tuple of tensors, of any dtype and shape (an integer tensor travels without a gradient). ``trace``: a
    list that receives this rank's step for the replay on modelled GPUs (``pipeline_trace.py``)."""
    p, s = (mesh.pp, mesh.pp_rank) if mesh is not None else (1, 0)
    m = len(batches)
    engine = stage if _is_engine(stage) else None
    if m == 0:
        raise ValueError("train_batch: batches is empty; give one (inputs, targets) per micro-batch")
    if engine is not None and engine.gas != m:
        raise ValueError(f"train_batch: len(batches) = {m} micro-batches, but the engine's "
                         f"gradient_accumulation_steps is {engine.gas}; they must be equal (one optimizer step "
                         f"per batch list)")
    module = engine.module if engine is not None else stage
    tied = getattr(module, "tied", []) if p > 1 else []
    if tied and engine is not None and not engine.keeps_full_grads:
        raise ValueError(f"train_batch: a weight tied across pipeline stages needs ZeRO-0/1's whole local "
                         f"gradients (zero_optimization.stage 0 or 1); stage {engine.stage} keeps only a shard")
    v = module.v if isinstance(module, ChunkedStage) else 1
    _check_kind(schedule_kind, v, engine)
    # the exercise's harness replaces `schedule` by a function of (kind, m, p, s): v is passed only when > 1
    order = schedule(schedule_kind, m, p, s) if v == 1 else schedule(schedule_kind, m, p, s, v)
    V, split = p * v, schedule_kind == "zb-h1"
    tracer = PipeTracer(trace, mesh, module, v) if trace is not None else None
    link = P2P(mesh, tracer) if p > 1 else None
    rec = StepRecorder(module.parameters(), split=split)
    timed = rec.op if tracer is None else lambda op, i, c: _both(rec.op(op, i, c), tracer.op(op, i, c, c * p + s))
    inputs, outputs, losses, stores = {}, {}, [], {}
    last_b = max(k for k, (op, *_) in enumerate(order) if op == "B")
    for k, action in enumerate(order):
        op, i, c = (*action, 0)[:3]
        j = c * p + s                                   # this action's virtual stage (v = 1: the stage)
        first, last = j == 0, j == V - 1
        if op == "W":
            with timed("W", i, c):
                rec.weight_passes += run_w(stores.pop((i, c)))
            continue
        if op == "F":
            x = batches[i][0] if first else _leaf(link.recv((j - 1) % p, p2p_tag(v, "F", j)))
            deferring = split_linears(stores.setdefault((i, c), [])) if split else contextlib.nullcontext()
            with timed("F", i, c), deferring:
                y = module.forward_chunk(c, x) if v > 1 else stage(x)
                if last:
                    y = loss_fn(y, batches[i][1])
                    losses.append(y.detach().float())
            if not last:
                link.send(y, (j + 1) % p, p2p_tag(v, "F", j + 1))
            inputs[(i, c)], outputs[(i, c)] = x, y
            continue
        x, y = inputs.pop((i, c)), outputs.pop((i, c))
        grad = link.recv((j + 1) % p, p2p_tag(v, "B", j)) if not last and _floats(y) else None
        defer = bool(tied) and engine is not None and k == last_b
        with timed("B", i, c):
            if last:
                target = y if engine is not None else y / m   # an engine divides by its gas itself
            else:   # an engine divides what it is given by gas: the gradient received already was
                target = _dot(y, grad, s) * (m if engine is not None else 1)
            if engine is None:
                target.backward()
            elif defer:   # the gradients stay local: the tied weight's are summed first
                engine.backward(target, allreduce_gradients=False)
            else:
                engine.backward(target)
        if not first and _floats(x):   # before the step: at the boundary it all-reduces the norm over PP too
            link.send(_input_grads(x), (j - 1) % p, p2p_tag(v, "B", j - 1))
        if defer:
            _sum_tied_then_reduce(engine, mesh, tied)
        if engine is not None:
            engine.step()
    if tied and engine is None:
        params = dict(stage.named_parameters())
        for name in tied:
            mesh.communicator("embed").all_reduce(params[name].grad, tag="tied-grad")
    if link is not None:
        link.wait()
    loss = torch.stack(losses).mean() if s == p - 1 else torch.zeros((), dtype=torch.float32)
    if p > 1:
        mesh.communicator("pp").broadcast(loss, src=p - 1, tag="pipeline-loss")
    dp = engine.communicator if engine is not None else (mesh.communicator("dp") if mesh is not None else None)
    if dp is not None and dp.world_size > 1:   # the mean over the DP group too: the same on every rank
        dp.all_reduce(loss, op="avg", tag="pipeline-loss", control=True)   # bookkeeping: in ledger.control
    stage.pipeline_stats = rec.stats()
    return float(loss)


@contextlib.contextmanager
def _both(a, b):
    with a, b:
        yield


def _check_kind(kind: str, v: int, engine) -> None:
    if kind == "interleaved" and v == 1:
        raise ValueError("train_batch: the 'interleaved' schedule runs a stage cut into chunks: "
                         "pipeline_stage(model, mesh, virtual=v) with v >= 2")
    if v > 1 and kind != "interleaved":
        raise ValueError(f"train_batch: this stage holds {v} chunks (virtual stages): run it with the "
                         f"'interleaved' schedule, not {kind!r}")
    if engine is not None and kind in ("interleaved", "zb-h1"):
        raise ValueError(f"train_batch: the {kind!r} schedule runs on a plain stage module (gradients in .grad, "
                         f"your optimizer steps); an engine reduces and steps inside one whole backward per "
                         f"micro-batch")


def _floats(t) -> list:
    """The floating tensors of ``t`` (a tensor or a tuple): those that carry gradients between stages."""
    return [q for q in (t if isinstance(t, tuple) else (t,)) if q.is_floating_point()]


def _leaf(x):
    """A received input: its floating tensors become leaves whose gradients go back to the sender."""
    for q in _floats(x):
        q.requires_grad_()
    return x


def _input_grads(x):
    """The gradient of each floating input, sent back: zeros for an input the stage left unused."""
    grads = [q.grad if q.grad is not None else torch.zeros_like(q) for q in _floats(x)]
    return tuple(grads) if isinstance(x, tuple) else grads[0]


def _dot(y, grad, s: int):
    """sum(y_i * dL/dy_i) over the floating outputs: its backward is the backward of the loss."""
    grads = grad if isinstance(grad, tuple) else (grad,)
    terms = [(a.float() * g.float()).sum() for a, g in zip(_floats(y), grads) if a.requires_grad]
    if not terms:
        raise ValueError(f"train_batch: pipeline stage {s}'s output does not depend on its parameters or its "
                         f"input (no floating tensor requiring a gradient): nothing to backpropagate")
    return sum(terms)


def _sum_tied_then_reduce(engine, mesh, tied) -> None:
    """Sum the tied weight's local gradients over the embedding group, then let the engine reduce
    every gradient over the DP group, as the boundary backward would have."""
    params = dict(engine.module.named_parameters(remove_duplicate=False))
    comm = mesh.communicator("embed")
    for name in tied:
        comm.all_reduce(engine.local_grad(params[name]), tag="tied-grad")
    engine.allreduce_gradients()
