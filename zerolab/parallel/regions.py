"""Parameters kept whole but used inside a split region (chapter 10).

Between a column-parallel layer and the row-parallel one after it, each TP rank
computes its own heads (or MLP columns). A module there that is not split —
Qwen3's per-head ``q_norm`` and ``k_norm``, applied to each head after the
q/k projections — holds the same whole parameters on every rank, but each rank
only sees its heads: its gradient is a partial sum, and the whole gradient is
the sum over the TP ranks. Megatron-LM all-reduces such gradients (its q/k
LayerNorms) over the TP group; so does zerolab: every trainable parameter of
such a module is marked ``replicated_in_split = True`` and a gradient hook
all-reduces its gradient over TP in every backward, before it is accumulated
into ``.grad`` (tag ``tp-split-grad``) — then the gradient is whole and equal
on every TP rank, as a LayerNorm's outside the split.

Which modules: those a plan names with the style ``"replicated_in_split"``,
and, found by themselves, the children with parameters of an attention module
(one with an integer ``head_dim``) whose projections were split column-wise,
other than its converted layers. Where neither tells, ``check.py`` finds the
partial gradient and names the parameter.
"""
from __future__ import annotations

from zerolab.parallel.sequence import all_reduce_grad




def found_in_split(model, converted: dict) -> list:
    """Names of the unconverted children, with parameters, of attention modules whose projections were split
    column-wise (``converted``: {module name: style})."""
    out = []
    for name, m in model.named_modules():
        if not isinstance(getattr(m, "head_dim", None), int):
            continue
        children = {f"{name}.{c}".lstrip("."): child for c, child in m.named_children()}
        if not any(converted.get(c, "").startswith("colwise") for c in children):
            continue
        out += [c for c, child in children.items()
                if c not in converted and any(p.requires_grad for p in child.parameters())]
    return out


def mark_replicated_in_split(model, names: list, comm) -> list:
    """Hook every trainable parameter of the modules ``names``; returns the parameters' names."""
    marked = []
    for mname in names:
        for pname, p in model.get_submodule(mname).named_parameters():
            if not p.requires_grad or getattr(p, "replicated_in_split", False) or getattr(p, "tensor_parallel", False):
                continue
            p.replicated_in_split = True
            if comm.world_size > 1:
                p.register_hook(all_reduce_grad(comm, "tp-split-grad"))
            marked.append(f"{mname}.{pname}")
    return marked


def replicated_in_split_params(model) -> list:
    """Names of the parameters whose gradient is all-reduced over TP because they sit in a split region."""
    return [n for n, p in model.named_parameters() if getattr(p, "replicated_in_split", False)]
