"""``loss.backward()`` then ``engine.step()``: the PyTorch-style loop DeepSpeed 0.19 accepts beside ``engine.backward``.

DeepSpeed hooks the outputs of ``engine(x)``: when autograd first reaches one,
its backward prologue runs (what ``engine.backward`` does before autograd), each
output's gradient is divided by ``gradient_accumulation_steps``, and a callback
queued on autograd's engine runs the epilogue when the backward ends. zerolab does
the same around its engine: the prologue is ``Engine.begin_backward`` (the
gradient hooks then keep and reduce each gradient as under ``engine.backward``), the
epilogue ``_end_of_backward`` (flush the buckets, wait for what is in flight).
``engine.backward(loss)`` stays the documented way and the hooks stand aside for it.
fp16's dynamic loss scale must multiply the loss before autograd: refused by name.
"""
from __future__ import annotations

import torch


def output_tensors(out) -> list:
    """The tensors needing a gradient in what a model returned (a tensor, tuple, list, dict, ModelOutput)."""
    if isinstance(out, torch.Tensor):
        return [out] if out.requires_grad and out.grad_fn is not None else []
    if isinstance(out, dict):
        out = list(out.values())
    if isinstance(out, (list, tuple)):
        return [t for o in out for t in output_tensors(o)]
    return []


def hook_outputs(engine, out) -> None:
    """Make a later ``loss.backward()`` through ``out`` run the engine's backward (``engine``: zerolab's)."""
    tensors = output_tensors(out) if torch.is_grad_enabled() else []
    if not tensors:
        return
    state = {"started": False}

    def hook(grad):
        if not state["started"]:
            if engine._in_backward:   # engine.backward(loss) is running: it scales and reduces
                return None
            start(engine)
            state["started"] = True
        return grad / engine.gas if engine.gas > 1 else None

    for t in tensors:
        t.register_hook(hook)


def start(engine) -> None:
    if engine.scaler is not None:
        raise RuntimeError("loss.backward() with fp16 enabled: the dynamic loss scale must multiply the loss "
                           "before autograd runs; call engine.backward(loss) (it scales, then engine.step() "
                           "unscales and skips overflowing steps)")
    engine.begin_backward()

    def finish():
        engine._in_backward = False
        engine._end_of_backward()

    torch.autograd.Variable._execution_engine.queue_callback(finish)
