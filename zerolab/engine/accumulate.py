"""Two ``engine.backward()`` calls before one ``step()`` add up, as two ``loss.backward()`` do in torch (chapter 3).

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
"""
from __future__ import annotations


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
