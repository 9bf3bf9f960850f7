"""What a 3D mesh adds to the step: the gradient norm and the fp16 overflow over TP and PP too (chapter 10).

Under ``zl.initialize(..., mesh=mesh)`` the engine reduces gradients over its
DP group only; each DP rank's shards cover one model-parallel slice. Clipping
needs the norm of the *whole* model's gradient, each element counted once:

* a parameter split by tensor parallelism (the ``tensor_parallel`` attribute
  ``zerolab.parallel`` sets on it) is a different slice on each TP rank — every
  TP rank counts its slice;
* a parameter every TP rank keeps whole (LayerNorms, row-parallel biases) has the
  same gradient on every TP rank — only TP rank 0 counts it (as Megatron-LM does);
* every PP stage holds its own parameters — each stage counts its own, except a
  weight tied between the first and the last stage (a GPT's embedding and head,
  ``zerolab.parallel.pipeline``): both stages hold it, with the same summed
  gradient, so only the first stage counts it (the last stage's module names its
  copy in ``tied_copies``).

So each rank sums the squares of what it counts, the sum is all-reduced over
the DP group (a ZeRO shard), then over the TP and PP groups. An fp16 overflow
anywhere must skip the step everywhere: the flag is all-reduced (max) over the
same groups.
"""
from __future__ import annotations

import torch

from zerolab.engine.optim import sum_of_squares


def _weights(engine, grads) -> list:
    """Per unit, 1.0 where this rank counts the gradient element and 0.0 where another TP rank
    (or the first pipeline stage, for a tied copy) does."""
    flat, mine = engine.flat, engine.mesh.tp_rank == 0
    copies = set(getattr(engine.module, "tied_copies", None) or ())
    out = []
    for u, g in zip(flat.units, grads):
        w = torch.zeros(u.padded, dtype=torch.float32, device=g.device)
        ends = u.offsets[1:] + [u.numel]   # params lie back to back (stage 3 empties released ones)
        for (name, p), off, end in zip(u.params, u.offsets, ends):
            if (mine or getattr(p, "tensor_parallel", False)) and name not in copies:
                w[off: end] = 1.0
        lo = 0 if g.numel() == u.padded else flat.rank * u.shard   # the whole unit (stage 0) or the shard
        out.append(w[lo: lo + g.numel()])
    return out


def grad_sq(engine, grads) -> torch.Tensor:
    """Σ g² over what this rank counts (module docstring); plain ``sum_of_squares`` without a mesh."""
    mesh = getattr(engine, "mesh", None)
    if mesh is None or (mesh.tp == 1 and not getattr(engine.module, "tied_copies", None)):
        return sum_of_squares(grads)
    if getattr(engine, "_norm_weights", None) is None:
        engine._norm_weights = _weights(engine, grads)
    return sum(((g.float() ** 2) * w).sum() for g, w in zip(grads, engine._norm_weights)) \
        if grads else torch.zeros((), dtype=torch.float32)


def model_parallel_all_reduce(engine, t: torch.Tensor, op: str = "sum") -> None:
    """In place: ``t`` reduced over the mesh's TP and PP groups (nothing without a mesh)."""
    mesh = getattr(engine, "mesh", None)
    for name in ("tp", "pp"):
        if mesh is not None and mesh.size(name) > 1:
            mesh.communicator(name).all_reduce(t, op=op, tag=f"grad-norm-{name}" if op == "sum" else "overflow")
