"""Zero-bubble pipelining: the backward split into B and W, and the ZB-H1 order (chapter 10; ``pipeline.py`` is the overview).

Qi et al. 2023 ("Zero Bubble Pipeline Parallelism", ICLR 2024) split a stage's backward in
two. **B** computes the gradient with respect to the stage's *input* — what the previous stage
waits for — and **W** the gradients with respect to its *weights*, which nobody waits for
until the optimizer step. Deferring W fills the pipeline's bubbles.

The split, for every ``nn.Linear`` (every ``F.linear`` call) of a stage: ``split_linears(store)``
is a ``TorchFunctionMode`` active during the forward; it runs each ``F.linear`` whose weight
needs a gradient as ``SplitLinear``, whose backward returns the input's gradient only
(g·Wᵀ) and files W's work in ``store`` (a list of callables, one per Linear: grad W += gᵀ·x,
grad bias += Σ g, accumulated into ``.grad`` as autograd would have). ``run_w(store)`` is W: it
calls them. Every other parameter (LayerNorm, embeddings: a few vectors) gets its gradient
during B. A layer with a split of its own files its W the same way: ``deferred()`` is the store
of the forward running now (None outside a split forward).

``zb_h1_order(m, p, s)``: ZB-H1, the variant that keeps 1F1B's memory (at most p micro-batches
between F and W on every stage, the first stage's 1F1B peak). In step x = 0 .. m + p - 2, stage
s runs F_x, then B_(x - (p-1-s)), then W_(x - (p-1)), each when it exists (0 <= index < m): the
first stage runs each micro-batch's W right after its B, each later stage defers its W by one
more slot (the last by p - 1), into what was its bubble under 1F1B. With unit costs (f = b = w) the idle time per stage is (p-1)(f+b-w), a third of
1F1B's (p-1)(f+b+w) (``theory/bubble.py``; the formula assumes w <= f and w <= b).
"""
from __future__ import annotations

import functools

import torch
from torch.nn import functional as F
from torch.overrides import TorchFunctionMode


def zb_h1_order(m: int, p: int, s: int) -> list:
    """Stage ``s``'s ("F" | "B" | "W", micro-batch) under ZB-H1 (module docstring)."""
    if m < p:
        raise ValueError(f"ZB-H1 needs at least as many micro-batches as stages: {m} micro-batches, pp={p}")
    out = []
    for x in range(m + p - 1):
        for op, i in (("F", x), ("B", x - (p - 1 - s)), ("W", x - (p - 1))):
            if 0 <= i < m:
                out.append((op, i))
    return out


class SplitLinear(torch.autograd.Function):
    """``F.linear`` whose backward is B only: the input's gradient; (input, output gradient) are filed
    for W (``run_w``)."""

    @staticmethod
    def forward(ctx, x, weight, bias, store, params):
        # params: the layer's own (weight, bias) objects, where W accumulates (forward's weight and bias
        # may arrive as other tensor objects sharing their storage, under a saved-tensor hook)
        ctx.save_for_backward(x, weight)
        ctx.store, ctx.params = store, params
        return F.linear(x, weight, bias)

    @staticmethod
    def backward(ctx, g):
        x, weight = ctx.saved_tensors
        ctx.store.append(functools.partial(_linear_w, *ctx.params.pair, x, g))     # W's work, deferred
        return g @ weight.to(g.dtype), None, None, None, None


class split_linears(TorchFunctionMode):
    """Within it, every ``F.linear`` whose weight requires a gradient defers its weight gradient to
    ``store`` (a list: one per micro-batch)."""

    def __init__(self, store: list):
        super().__init__()
        self.store = store

    def __enter__(self):
        _ACTIVE.append(self.store)
        return super().__enter__()

    def __exit__(self, *exc):
        _ACTIVE.pop()
        return super().__exit__(*exc)

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is F.linear:   # F.linear(input, weight, bias=None); inside this handler the mode is off
            x, weight, bias = (list(args) + [kwargs.get("weight"), kwargs.get("bias")][len(args) - 1:])[:3]
            if isinstance(weight, torch.nn.Parameter) and weight.requires_grad and torch.is_grad_enabled():
                return SplitLinear.apply(x, weight, bias, self.store, _Params(weight, bias))
        return func(*args, **kwargs)


class _Params:
    def __init__(self, weight, bias):
        self.pair = (weight, bias)


_ACTIVE = []   # the stores of the split forwards running now (innermost last)


def deferred():
    """The store of the split forward running now, or None: where a layer files its own W."""
    return _ACTIVE[-1] if _ACTIVE else None


def run_w(store: list) -> int:
    """W: run every weight-gradient pass filed in ``store`` (in the order filed), emptying it; returns how many."""
    n = 0
    while store:
        store.pop(0)()
        n += 1
    return n


@torch.no_grad()
def _linear_w(weight, bias, x, g) -> None:
    g2, x2 = g.reshape(-1, g.shape[-1]), x.reshape(-1, x.shape[-1]).to(g.dtype)
    _accumulate(weight, (g2.t() @ x2).to(weight.dtype))
    if bias is not None and bias.requires_grad:
        _accumulate(bias, g2.sum(0).to(bias.dtype))


def _accumulate(param, grad) -> None:
    if param.grad is None:
        param.grad = grad.clone()
    else:
        param.grad += grad
