"""When the accumulated gradients are reduced: two ``engine.backward()`` calls before one ``step()``
add up, as two ``loss.backward()`` do in torch (chapter 3); and the caller may reduce them itself.

A multi-task step often has two losses: ``engine.backward(l1); engine.backward(l2);
engine.step()``. Plain torch sums the two gradients. In an engine that reduces
during backward, the second backward finds the first one's gradients already
reduced:

    stages 2-3   every backward reduces into the gradient shard; only the first backward of
                 a step may *write* it, every later one adds (``first_backward_of_step``)
    stages 0-1   the boundary backward reduced the flat buffer in place; a second one adds its
                 local gradients there and reduces again, so the first sum must count once:
                 ``keep_reduced_once`` keeps it on rank 0 (all-reduce: every rank holds it)
                 or in each rank's own slice (reduce-scatter), zero elsewhere — exact, no
                 division. The offload engines reduce into a host copy and leave the device
                 buffer as it was: nothing to do.

``engine.backward(loss, allreduce_gradients=False)`` at the boundary (stages 0-1) leaves the
gradients local: ``local_grad(p)`` is this rank's own, writable, and ``allreduce_gradients()``
reduces every bucket as the backward would have (``CallerReduces``; the pipeline sums a weight
tied across stages in between, ``parallel/pipeline_run.py``).
"""
from __future__ import annotations

import torch


def first_backward_of_step(engine) -> bool:
    """Whether this backward's reduction writes the gradient shard (the step's first) or adds to it."""
    return engine.micro_steps % engine.gas == 0 and engine.backwards_this_micro_step == 1


def keep_reduced_once(engine) -> None:
    """Stages 0-1, before a second backward at the accumulation boundary (see the module docstring)."""
    if getattr(engine, "host_grads", None) is not None:
        return
    if getattr(engine, "grad_collective", "all_reduce") == "reduce_scatter":
        for u in engine.flat.units:
            mine = engine.own(engine.grads, u).clone()
            engine.flat.unit_view(engine.grads, u).zero_()
            engine.own(engine.grads, u).copy_(mine)
    elif engine.rank != 0:
        engine.grads.zero_()


class CallerReduces:
    """The engine's part: the reduction a ``backward(loss, allreduce_gradients=False)`` left to the caller."""

    def allreduce_gradients(self) -> None:
        """Collective: after ``backward(loss, allreduce_gradients=False)``, reduce every gradient
        bucket over the DP group in bucket order, as the boundary backward would have."""
        if not self._reduce_deferred:
            raise RuntimeError("engine.allreduce_gradients(): nothing to reduce -- it follows "
                               "engine.backward(loss, allreduce_gradients=False) at the accumulation boundary, "
                               "once")
        self._reduce_deferred = False
        self._reducing = self._reduced_unstepped = True
        self.reset_buckets()
        for p in self.flat.params():
            self.grad_arrived(p)
        self.flush_buckets()
        self._reducing = False

    def local_grad(self, p) -> torch.Tensor:
        """This rank's whole gradient of parameter ``p`` (stages 0-1), a view into the engine's buffer:
        before the reduction, this rank's own; writes to it are what gets reduced."""
        raise ValueError(f"engine.local_grad: stage {self.stage} keeps only its shard of the gradients "
                         f"(zero_optimization.stage 0 or 1 keeps them whole)")
