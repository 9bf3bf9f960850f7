"""A conversion checked by construction: ``tensor_parallel(..., check=True)`` (chapter 10).

A plan is a claim — "this model, split so, computes the same function" — that a
glob cannot prove: a fused layer split as if it were one (Phi-3's gate|up), a
parameter kept whole but used inside a split region, a tied weight split on
one side only. So before ``tensor_parallel`` returns, ``check`` runs a tiny
batch (two sequences of ``2·tp`` tokens, the same on every rank, or the
caller's ``example=``) through the converted model and through a copy of the
model taken before the conversion, both in eval mode (no dropout; each
module's mode restored after), backward from a fixed random weighting of the
outputs, and compares on every TP rank:

* the outputs (this rank's slice where the output is split along the
  vocabulary or the sequence),
* the gradient of every original parameter (this rank's slice of a split
  one, in the original layout: GPT-2's ``Conv1D`` transposed back),
* every tie group of the original (one parameter under several names) —
  still one parameter.

The first difference raises ``TensorParallelCheckError`` naming the tie, the
module or the parameter, and the plan entry responsible (or that no entry
converts it). The ranks agree on the verdict (an all-reduce of a flag over TP,
tag ``tp-check``), so all raise together. The check's gradients are cleared
afterwards (the parameters' ``.grad`` as before).
"""
from __future__ import annotations

import torch
from torch import nn

from zerolab.parallel.layers import shard
from zerolab.parallel.ops import SEQ


class TensorParallelCheckError(ValueError):
    """The converted model does not compute what the plain model computes (``tensor_parallel(check=True)``)."""


def _first_tensor(out):
    if hasattr(out, "logits"):
        return out.logits
    if isinstance(out, (tuple, list)):
        out = out[0] if out else None
    if isinstance(out, dict):
        out = next((v for v in out.values() if torch.is_tensor(v)), None)
    return out if torch.is_tensor(out) and out.is_floating_point() else None


def _seq_len(model, tp: int) -> int:
    cfg = getattr(model, "config", None)
    limit = min([n for n in (getattr(cfg, "max_position_embeddings", None), getattr(cfg, "n_positions", None),
                             getattr(model, "seq_len", None)) if isinstance(n, int)] or [4 * tp])
    return max(tp, (min(2 * tp, limit) // tp) * tp)


def example_inputs(model: nn.Module, tp: int, example=None) -> tuple:
    """(args, kwargs) of the check's batch: ``example`` (a tensor, a tuple of arguments or a dict of keyword
    arguments) or derived: token ids within the vocabulary (a Hugging Face model: ``input_ids=``), else
    a float batch for the first linear layer."""
    if example is not None:
        if isinstance(example, dict):
            return (), example
        return (example if isinstance(example, tuple) else (example,)), {}
    g = torch.Generator().manual_seed(1234)
    device = next(model.parameters()).device
    t, cfg = _seq_len(model, tp), getattr(model, "config", None)
    emb = next((m for m in model.modules() if isinstance(m, nn.Embedding)), None)
    vocab = getattr(cfg, "vocab_size", None) or (emb.num_embeddings if emb is not None else None)
    if vocab:
        ids = torch.randint(0, vocab, (2, t), generator=g).to(device)
        if cfg is not None and hasattr(cfg, "vocab_size"):
            return (), {"input_ids": ids, **({"use_cache": False} if hasattr(cfg, "use_cache") else {})}
        return (ids,), {}
    lin = next((m for m in model.modules() if isinstance(m, nn.Linear)), None)
    if lin is None:
        raise TensorParallelCheckError("tensor_parallel(check=True): cannot derive an input for this model; pass "
                                       "example= (a batch for the model) or check=False")
    dtype = next(model.parameters()).dtype
    return (torch.randn(2, t, lin.in_features, generator=g).to(device, dtype),), {}


def _local(ref: torch.Tensor, shape, comm):
    """``ref`` as this rank holds it: whole, split along the last dimension or along the sequence."""
    if tuple(ref.shape) == tuple(shape):
        return ref
    for dim in (-1, SEQ):
        if ref.dim() >= 2 and ref.shape[dim] == shape[dim] * comm.world_size:
            return ref.chunk(comm.world_size, dim=dim)[comm.rank]
    return None


def _differs(got, want, tol) -> float | None:
    if want is None or tuple(got.shape) != tuple(want.shape):
        return float("inf")
    d = (got.float() - want.float()).abs().max().item() if got.numel() else 0.0
    return d if not d <= tol * (want.float().abs().max().item() + 1e-3) else None


def _run(model, args, kwargs, record: dict):
    def keep(name):
        def hook(module, args, out):   # returns None: the output unchanged
            if torch.is_tensor(out) and name not in record:
                record[name] = out.detach()
        return hook
    hooks = [m.register_forward_hook(keep(n)) for n, m in model.named_modules() if n]
    try:
        out = _first_tensor(model(*args, **kwargs))
    finally:
        for h in hooks:
            h.remove()
    return out


def check(ref: nn.Module, model: nn.Module, comm, entries: dict, example=None) -> None:
    """Raise ``TensorParallelCheckError`` where ``model`` (converted) and ``ref`` (a copy of it before the
    conversion) differ (module docstring). ``entries``: {module name: (glob, style)} of the plan."""
    modes = {m: m.training for m in model.modules()}
    grads = {p: p.grad for p in model.parameters()}
    for p in [*model.parameters(), *ref.parameters()]:
        p.grad = None
    ref.eval()
    model.eval()
    try:
        with torch.enable_grad():
            problem = _compare(ref, model, comm, entries, example)
    finally:
        for m, training in modes.items():
            m.train(training)
        for p, grad in grads.items():
            p.grad = grad
    flag = torch.tensor([0.0 if problem is None else 1.0])
    comm.all_reduce(flag, tag="tp-check", control=True)   # every rank raises, or none
    if problem is not None or flag.item():
        raise TensorParallelCheckError(f"tensor_parallel(check=True) on TP rank {comm.rank}: " + (
            problem or "another TP rank found the converted model differs from the plain one (see its error)") +
            "; fix the plan, or pass check=False to skip this check")


def _plan_of(name: str, entries: dict) -> str:
    """The plan entry converting ``name`` or the module holding it."""
    parts = name.split(".")
    for i in range(len(parts), 0, -1):
        n = ".".join(parts[:i])
        if n in entries:
            glob, style = entries[n]
            return f"plan entry {glob!r}: {style!r}"
    return "no plan entry converts it (kept whole on every TP rank)"


def _compare(ref, model, comm, entries, example) -> str | None:
    names = {}   # id(parameter) -> names, the original's tie groups
    for n, p in ref.named_parameters(remove_duplicate=False):
        names.setdefault(id(p), []).append(n)
    for group in (g for g in names.values() if len(g) > 1):
        held = [model.get_parameter(n) if _has(model, n) else None for n in group]
        if any(h is None or h is not held[0] for h in held):
            return (f"the tie {group} (one parameter in the plain model) is no longer one parameter: "
                    f"{group[0]} ({_plan_of(group[0], entries)}), {group[1]} ({_plan_of(group[1], entries)})")
    args, kwargs = example_inputs(ref, comm.world_size, example)
    fp32 = next(ref.parameters()).dtype == torch.float32
    tol = 1e-3 if fp32 else 5e-2   # of the largest |value|: fp32 sums in another order; a wrong split is O(1)
    rec_ref, rec = {}, {}
    want = _run(ref, args, kwargs, rec_ref)
    try:
        got = _run(model, args, kwargs, rec)
    except (RuntimeError, ValueError, IndexError) as e:   # a shape error inside: name the module it ran in
        inside = [n for n in rec_ref if n not in rec]
        where = inside[0] if inside else "?"
        return (f"the converted model fails in forward at {where!r} ({_plan_of(where, entries)}): "
                f"{type(e).__name__}: {str(e)[:200]}")
    if want is None or got is None:
        raise TensorParallelCheckError("tensor_parallel(check=True): the model's output is no floating tensor (or "
                                       "has no .logits); pass example= for a model that returns its logits, or "
                                       "check=False")
    w = torch.randn(want.shape, generator=torch.Generator().manual_seed(99)).to(want.device, want.dtype)
    mine = _local(want, got.shape, comm)
    if mine is None or _differs(got, mine, tol) is not None:
        return _first_module(model, rec_ref, rec, comm, entries, tol) or (
            f"the model's output differs from the plain model's (shape {tuple(got.shape)} against "
            f"{tuple(want.shape)})")
    (want * w).sum().backward()
    (got * _local(w, got.shape, comm)).sum().backward()
    for name, p in ref.named_parameters():
        if not p.requires_grad:
            continue
        if not _has(model, name):
            return f"the parameter {name!r} is missing from the converted model ({_plan_of(name, entries)})"
        q = model.get_parameter(name)
        mod = model.get_submodule(name.rpartition(".")[0]) if "." in name else model
        g = p.grad if p.grad is not None else torch.zeros_like(p)
        leaf = name.rpartition(".")[2]
        if leaf in (getattr(mod, "tp_dims", None) or {}):
            if getattr(mod, "tp_transposed", False) and g.dim() == 2:
                g = g.t()
            dim, parts = mod.tp_dims[leaf]
            g = shard(g, dim, comm, parts)
        mine = q.grad if q.grad is not None else torch.zeros_like(q)
        d = _differs(mine, g, tol)
        if d is not None:
            hint = "" if leaf in (getattr(mod, "tp_dims", None) or {}) else (
                "; a parameter kept whole but used inside a split region (after a head split) has a partial "
                "gradient on each TP rank: give its module the style 'replicated_in_split'")
            return (f"the gradient of {name!r} differs from the plain model's by {d:.3g} "
                    f"({_plan_of(name, entries)}){hint}")
    return None


def _has(model, name) -> bool:
    try:
        model.get_parameter(name)
        return True
    except AttributeError:
        return False


def _first_module(model, rec_ref, rec, comm, entries, tol) -> str | None:
    """The first module (in the converted model's order) whose output differs from the plain model's."""
    for name, out in rec.items():
        want = rec_ref.get(name)
        if want is None or not out.is_floating_point():
            continue
        parts = (getattr(model.get_submodule(name), "tp_dims", None) or {}).get("weight", (0, 1))[1]
        mine = shard(want, -1, comm, parts) if name in entries and parts > 1 else _local(want, out.shape, comm)
        if mine is None or tuple(mine.shape) != tuple(out.shape):
            continue   # a split region's shape: compared where it is whole again
        d = _differs(out, mine, tol)
        if d is not None:
            parent = name.rpartition(".")[0]
            near = sorted(f"{n!r} ({s})" for n, (_, s) in entries.items()
                          if n.rpartition(".")[0] in (parent, name) or n.startswith(name + "."))
            return (f"the output of {name!r} differs from the plain model's by {d:.3g} ({_plan_of(name, entries)}"
                    f"{'; converted there: ' + ', '.join(near) if near else ''})")
    return None
