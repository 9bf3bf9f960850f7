"""Sequence parallelism wired into a tensor-parallel model (Korthikanti et al. 2022; chapter 10).

``tensor_parallel(model, mesh, plan, sequence_parallel=True)`` calls
``wire(...)`` after converting the layers. Between the TP regions every
activation then holds T/tp of the sequence (dimension -2) on each TP rank:

* the vocabulary-parallel embedding and every row-parallel layer
  reduce-scatter their sum along the sequence (g becomes half an all-reduce);
* a column-parallel layer all-gathers its input along the sequence (f's
  place; backward: a reduce-scatter). An attention module whose q, k, v were
  split (it has ``n_head``) gathers once, at its own input (a forward
  pre-hook): it reads the sequence length from its input, so it must see the
  whole sequence, and its q, k, v read the gathered input as it is;
* a module of style ``"sequence"`` (TinyGPT's position embedding ``wpe``)
  keeps its output's rows of this rank (a forward hook): backward all-gathers
  its gradient, so its parameters' gradients are whole.

LayerNorm (and dropout) in between run on T/tp tokens: their saved activations
shrink by tp. Their parameters, and the row-parallel biases added after the
reduce-scatter, are kept whole on every TP rank but each rank's gradient is
the part from its T/tp tokens: every such parameter (each trainable parameter
that is neither split by TP nor inside a ``"sequence"`` module) is marked
``sequence_parallel = True`` and a gradient hook on it all-reduces its
gradient over the TP group in every backward, before it is accumulated into
``.grad``. So plain autograd and every engine stage (whose hooks read
``.grad`` after accumulation) see the whole gradient, equal on every TP rank —
which is what ``engine/mesh_norm.py`` counts once. The cost: one all-reduce of
those parameters per backward (booked under "tp", tag ``sp-grad``).
"""
from __future__ import annotations

from zerolab.parallel.layers import ColumnParallelLinear, RowParallelLinear, VocabParallelEmbedding
from zerolab.parallel.ops import gather_from_sequence, scatter_to_sequence


def _gather_input(comm, where):
    def hook(module, args):
        return (gather_from_sequence(args[0], comm, where),) + tuple(args[1:])
    return hook


def _scatter_output(comm, where):
    def hook(module, args, output):
        return scatter_to_sequence(output, comm, where)
    return hook


def all_reduce_grad(comm, tag="sp-grad"):
    """A gradient hook: the gradient summed over the TP group (a parameter each TP rank keeps whole)."""
    def hook(grad):
        grad = grad.contiguous().clone()
        comm.all_reduce(grad, tag=tag)
        return grad
    return hook


def wire(model, comm, heads: dict, sequence_modules: list) -> list:
    """Set every converted layer of ``model`` to its sequence-parallel form, hook the attention
    modules in ``heads`` ({name: (module, attrs)}: their q, k, v were split) and the modules named in
    ``sequence_modules``; returns the names of the parameters whose gradients are all-reduced over TP."""
    gathering = {n: m for n, (m, _) in heads.items()}
    for name, m in model.named_modules():
        parent = name.rpartition(".")[0]
        if isinstance(m, ColumnParallelLinear):
            m.sequence_parallel = "gathered" if parent in gathering else "gather"
        elif isinstance(m, (RowParallelLinear, VocabParallelEmbedding)):
            m.sequence_parallel = True
    for name, m in gathering.items():
        m.register_forward_pre_hook(_gather_input(comm, name))
    whole = set()
    for name in sequence_modules:
        m = model.get_submodule(name)
        m.register_forward_hook(_scatter_output(comm, name))
        whole |= {id(p) for p in m.parameters()}
    marked, seen = [], set()
    for name, p in model.named_parameters():
        if id(p) in seen or id(p) in whole or getattr(p, "tensor_parallel", False) or not p.requires_grad or \
                getattr(p, "replicated_in_split", False):   # already all-reduced over TP (regions.py)
            continue
        seen.add(id(p))
        p.sequence_parallel = True
        p.register_hook(all_reduce_grad(comm))
        marked.append(name)
    return marked


def sequence_parallel_params(model) -> list:
    """Names of the parameters whose gradient sequence parallelism all-reduces over TP."""
    return [n for n, p in model.named_parameters() if getattr(p, "sequence_parallel", False)]
