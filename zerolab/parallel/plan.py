"""``zl.tensor_parallel(model, mesh, plan)``: convert a model's layers to tensor-parallel ones (chapter 10).

A *plan* maps ``fnmatch`` globs over dotted module names (``"*.fc"``,
``"blocks.*.attn.q"``), as torch's ``parallelize_module`` takes them, to a
style:

* ``"colwise"`` — an ``nn.Linear`` split by output features (its output is
  this rank's slice); ``"colwise_gather"``: the same, output all-gathered whole;
  ``"colwise_qkv"``: a fused q|k|v, each of the three split (this rank's heads);
  ``"colwise_gate_up"``: a fused gate|up (Phi-3's MLP), each half split;
* ``"rowwise"`` — an ``nn.Linear`` split by input features (its input must be
  a column-parallel layer's slice), output summed over the TP group;
* ``"vocab"`` — an ``nn.Embedding`` split by vocabulary rows;
* ``"sequence"`` (only with ``sequence_parallel=True``) — any module, kept
  whole; its output keeps this rank's rows of the sequence (a position
  embedding: ``parallel/sequence.py``); ``"replicated_in_split"`` — kept whole
  inside a split region, its gradients all-reduced over TP (``regions.py``).

``sequence_parallel=True`` adds Megatron-LM's sequence parallelism
(``parallel/sequence.py``); with the default plan it adds ``GPT_SP_PLAN``
(TinyGPT's ``wpe`` as ``"sequence"``). Every conversion is checked against the
plain model (``check.py``) and gets the dropout RNG tracker (``rng.py``).

``GPT_PLAN`` (the default) converts ``zerolab.book.models.TinyGPT``: q, k, v
and the MLP's ``fc`` column-wise, the attention's ``proj`` and the MLP's
``out`` row-wise, the token embedding and the tied head by vocabulary — the
logits come out split along the vocabulary: take the loss with
``vocab_parallel_cross_entropy``. LayerNorms, the position embedding and the
row-parallel biases stay whole on every TP rank (their gradients are equal on
every TP rank). A module with an ``n_head`` attribute whose children were
split column-wise keeps ``n_head/tp`` heads.

``HF_GPT2_PLAN`` does the same for Hugging Face's ``GPT2LMHeadModel`` (its
``Conv1D`` layers hold the weight transposed; they become ``nn.Linear``-shaped).
``HF_LLAMA_PLAN`` converts the Llama family (``LlamaForCausalLM``, Mistral,
Qwen2: the same module names): q, k, v, and the SwiGLU MLP's gate and up
column-wise, o and down row-wise, the embedding and the head (tied or not) by
vocabulary. Grouped-query attention splits its key/value heads like its query
heads: a rank keeps ``num_attention_heads/tp`` query and ``num_key_value_heads/tp``
key/value heads, so ``num_key_value_groups`` (their ratio) is unchanged; the
attention reshapes by ``head_dim`` (-1 heads), RoPE and RMSNorm stay whole (Qwen3's per-head
q_norm/k_norm too, their gradients summed over TP); Gemma 2's scaled embedding is split. Take
the loss with ``vocab_parallel_cross_entropy`` (not the model's ``labels=``).

``tp_dims(model)`` lists each split parameter's dimension by name;
``gather_tp(state, dims, mesh)`` puts a state dict's slices back together
(the full names and shapes of the model before the conversion).
"""
from __future__ import annotations

import copy
from fnmatch import fnmatchcase

import torch
import torch.distributed as dist
from torch import nn

from zerolab.parallel.layers import ColumnParallelLinear, RowParallelLinear, VocabParallelEmbedding, as_linear, unshard
from zerolab.parallel.check import check as check_conversion
from zerolab.parallel.regions import found_in_split, mark_replicated_in_split
from zerolab.parallel.rng import track_rng
from zerolab.parallel.sequence import wire

GPT_PLAN = {
    "wte": "vocab",
    "blocks.*.attn.q": "colwise", "blocks.*.attn.k": "colwise", "blocks.*.attn.v": "colwise",
    "blocks.*.attn.proj": "rowwise",
    "blocks.*.fc": "colwise", "blocks.*.out": "rowwise",
    "head": "colwise",
}
# Hugging Face's GPT2LMHeadModel: the fused q|k|v split by heads, the head tied to the embedding
HF_GPT2_PLAN = {
    "transformer.wte": "vocab",
    "transformer.h.*.attn.c_attn": "colwise_qkv", "transformer.h.*.attn.c_proj": "rowwise",
    "transformer.h.*.mlp.c_fc": "colwise", "transformer.h.*.mlp.c_proj": "rowwise",
    "lm_head": "colwise",
}
# Hugging Face's Llama family (Llama, Mistral, Qwen2): Megatron's scheme; lm_head by vocabulary, tied or not
HF_LLAMA_PLAN = {
    "model.embed_tokens": "vocab",
    "model.layers.*.self_attn.q_proj": "colwise", "model.layers.*.self_attn.k_proj": "colwise",
    "model.layers.*.self_attn.v_proj": "colwise", "model.layers.*.self_attn.o_proj": "rowwise",
    "model.layers.*.mlp.gate_proj": "colwise", "model.layers.*.mlp.up_proj": "colwise",
    "model.layers.*.mlp.down_proj": "rowwise",
    "lm_head": "colwise",
}
GPT_SP_PLAN = {"wpe": "sequence"}   # added to GPT_PLAN under sequence_parallel=True
STYLES = {"colwise": "Linear", "colwise_gather": "Linear", "colwise_qkv": "Linear", "colwise_gate_up": "Linear",
          "rowwise": "Linear",
          "vocab": "Embedding", "sequence": None, "replicated_in_split": None}
PARTS = {"colwise_qkv": 3, "colwise_gate_up": 2}   # fused layers: each block split
STYLES_KEPT = ("sequence", "replicated_in_split")   # modules kept whole (wired by sequence.py / regions.py)
HEAD_ATTRS = ("n_head", "num_heads", "split_size",   # divided by tp where a child is split column-wise
              "num_key_value_heads")
# checked (tp must divide them) where a child is split column-wise, never changed: an MLP's width, and
# a Hugging Face attention's (a module with ``head_dim``) head counts in its config, shared by every layer
CHECKED_ATTRS, CONFIG_HEADS = ("intermediate_size",), ("num_attention_heads", "num_key_value_heads")


def _check_sizes(name: str, module, tp: int) -> None:
    """A ``ValueError`` naming the size ``tp`` does not divide: whole heads and MLP columns per rank."""
    sizes = [(a, getattr(module, a, None)) for a in HEAD_ATTRS + CHECKED_ATTRS]
    if isinstance(getattr(module, "head_dim", None), int):
        sizes += [(f"config.{a}", getattr(getattr(module, "config", None), a, None)) for a in CONFIG_HEADS]
    for attr, value in sizes:
        if isinstance(value, int) and not isinstance(value, bool) and value % tp:
            raise ValueError(f"tensor_parallel: tp={tp} does not divide {attr}={value} of {name!r}")


def _style_of(name: str, plan: dict, used: set):
    hits = [g for g in plan if fnmatchcase(name, g)]
    styles = {plan[g] for g in hits}
    if len(styles) > 1:
        raise ValueError(f"tensor_parallel: module {name!r} matches globs with different styles: "
                         f"{ {g: plan[g] for g in hits} }")
    used.update(hits)
    return styles.pop() if styles else None


def _kind(module) -> str | None:
    if type(module) in (nn.Linear, nn.Embedding):
        return type(module).__name__
    if isinstance(module, nn.Embedding) and torch.is_tensor(getattr(module, "embed_scale", None)) and \
            type(module).forward.__qualname__.endswith("ScaledWordEmbedding.forward"):
        return "Embedding"   # Gemma's: the lookup times embed_scale (layers.py)
    if type(module).__name__ == "Conv1D" and hasattr(module, "nf"):   # Hugging Face GPT-2's transposed Linear
        return "Linear"
    return None


def _convert(module, style, comm, memo, name):
    want = STYLES[style]
    if _kind(module) != want:
        raise ValueError(f"tensor_parallel: {style!r} applies to an nn.{want}; {name!r} is a "
                         f"{type(module).__name__}")
    if style == "vocab":
        return VocabParallelEmbedding(module, comm, memo, name)
    if style == "rowwise":
        layer = RowParallelLinear(as_linear(module), comm, memo, name)
    else:
        layer = ColumnParallelLinear(as_linear(module), comm, gather_output=style == "colwise_gather", memo=memo,
                                     name=name, parts=PARTS.get(style, 1))
    layer.tp_transposed = not isinstance(module, nn.Linear)   # GPT-2's Conv1D: the original holds the weight in x out
    return layer


def tensor_parallel(model: nn.Module, mesh, plan: dict | None = None, sequence_parallel: bool = False,
                    check: bool = True, example=None) -> nn.Module:
    """Replace, in place, each module of ``model`` whose dotted name matches a glob of ``plan``
    (default ``GPT_PLAN``) by its tensor-parallel form over ``mesh``'s TP group; returns ``model``.
    Every rank must call it with the same model (the values are sliced, not communicated).
    ``sequence_parallel``: activations between the TP regions split along the sequence (module docstring).
    ``check`` (with tp > 1): before returning, the converted model's outputs, gradients and ties are compared
    with a copy of the plain model's on a tiny batch (``example=``: the caller's) — ``check.py``; a difference
    raises ``TensorParallelCheckError`` naming it (the model is then left converted: build a fresh one)."""
    if plan is None:
        plan = {**GPT_PLAN, **GPT_SP_PLAN} if sequence_parallel else GPT_PLAN
    bad = {g: s for g, s in plan.items() if s not in STYLES}
    if bad:
        raise ValueError(f"tensor_parallel: unknown style(s) {bad}; choose from {sorted(STYLES)}")
    if not sequence_parallel and "sequence" in plan.values():
        raise ValueError(f"tensor_parallel: style 'sequence' ({[g for g, s in plan.items() if s == 'sequence']}) "
                         f"needs sequence_parallel=True")
    comm = mesh.communicator("tp")
    tp, used, memo = comm.world_size, set(), {}
    targets = [(n, m, s) for n, m in model.named_modules() if n and (s := _style_of(n, plan, used))]
    unused = [g for g in plan if g not in used]
    if unused:
        names = [n for n, _ in model.named_modules() if n][:12]
        raise ValueError(f"tensor_parallel: glob(s) {unused} match no module; module names look like {names}")
    # check every head count before changing anything
    heads, ungathered = {}, []
    for n, m in model.named_modules():
        split = [c for c, _ in m.named_children() if f"{n}.{c}".lstrip(".") in
                 {t[0] for t in targets if t[2].startswith("colwise")}]
        if split:
            qkv = [c for c in split if f"{n}.{c}".lstrip(".") in {t[0] for t in targets if t[2] == "colwise_qkv"}]
            if qkv and isinstance(getattr(m, "head_dim", None), int) and not hasattr(m, "split_size"):
                cfg = getattr(m, "config", None)   # Phi-3: q|k|v sliced at config.num_attention_heads * head_dim
                raise ValueError(f"tensor_parallel: 'colwise_qkv' on {n + '.' + qkv[0]!r} is not supported: {n!r} "
                                 f"({type(m).__name__}) slices its fused q|k|v by the model config's head counts "
                                 f"(num_attention_heads={getattr(cfg, 'num_attention_heads', None)}, "
                                 f"num_key_value_heads={getattr(cfg, 'num_key_value_heads', None)}), which a split "
                                 f"cannot change; leave its attention whole (split the MLP: 'colwise_gate_up')")
            _check_sizes(n, m, tp)
            if isinstance(getattr(m, "head_dim", None), int) and not any(
                    isinstance(getattr(m, a, None), int) for a in HEAD_ATTRS):
                ungathered.append(f"{n} ({type(m).__name__})")
        for attr in HEAD_ATTRS if split else ():
            if isinstance(getattr(m, attr, None), int):
                heads.setdefault(n, (m, []))[1].append(attr)
    if sequence_parallel and ungathered:   # Llama: its mask and RoPE positions come from the embedding's output
        raise ValueError(f"tensor_parallel: sequence_parallel=True does not support the attention {ungathered[0]!r} "
                         f"(no n_head/num_heads: it reads the sequence length of its split input); "
                         f"use sequence_parallel=False")
    if sequence_parallel and isinstance(getattr(getattr(model, "config", None), "model_type", None), str):
        raise ValueError(f"tensor_parallel: sequence_parallel=True does not support Hugging Face's "
                         f"{type(model).__name__}: it builds its attention mask and position ids from the "
                         f"embedding's sequence length, which sequence parallelism splits; use sequence_parallel=False")
    seq = [n for n, _, s in targets if s == "sequence"]
    ref = copy.deepcopy(model) if check and tp > 1 and not any(p.is_meta for p in model.parameters()) else None
    new = [(n, _convert(m, s, comm, memo, n)) for n, m, s in targets if s not in STYLES_KEPT]   # all built first
    for n, layer in new:
        parent, _, attr = n.rpartition(".")
        setattr(model.get_submodule(parent), attr, layer)
    for m, attrs in heads.values():
        for attr in attrs:
            setattr(m, attr, getattr(m, attr) // tp)
    converted = {n: s for n, _, s in targets}
    mark_replicated_in_split(model, [n for n, s in converted.items() if s == "replicated_in_split"] +
                             found_in_split(model, converted), comm)
    if sequence_parallel:
        wire(model, comm, heads, seq)
    if ref is not None:
        check_conversion(ref, model, comm, {n: (_glob_of(n, plan), s) for n, s in converted.items()}, example)
    if tp > 1:
        track_rng(model, comm)   # dropout: the same numbers in replicated regions, different in split ones
    return model


def _glob_of(name: str, plan: dict) -> str:
    return next(g for g in plan if fnmatchcase(name, g))


class TPDims(dict):
    """``tp_dims``'s answer: ``{name: (dim, parts)}``, plus ``local_shapes`` (this TP rank's shape of each,
    where the parameter holds its values) and ``tp`` — so ``gather_tp`` can tell a slice from a tensor
    already whole (``engine.full_state_dict()`` under a mesh gathers over TP itself) and pass it through."""
    local_shapes: dict
    tp: int
    transposed: set   # weights held out x in whose original (GPT-2's Conv1D) is in x out


def tp_dims(model: nn.Module) -> dict:
    """``{parameter name: (split dimension, parts)}`` for every tensor-parallel parameter of
    ``model`` (names as ``model.named_parameters(remove_duplicate=False)`` gives them; parts > 1:
    a fused q|k|v, each block split)."""
    out, shapes, tp, flip = TPDims(), {}, 1, set()
    for mname, m in model.named_modules(remove_duplicate=False):
        if getattr(m, "tp_transposed", False) and getattr(m, "weight", None) is not None:
            flip.add(f"{mname}.weight".lstrip("."))
        for pname, dim in getattr(m, "tp_dims", {}).items():
            p = getattr(m, pname, None)
            if p is not None:
                name = f"{mname}.{pname}".lstrip(".")
                out[name] = dim
                local = m.tp_shapes().get(pname) if hasattr(m, "tp_shapes") else None   # ZeRO-3 may have
                shapes[name] = tuple(local) if local is not None else tuple(p.shape)   # released the values
                tp = getattr(getattr(m, "comm", None), "world_size", tp)
    out.local_shapes, out.tp, out.transposed = shapes, tp, flip
    return out


def _already_whole(name, t, dims) -> bool:
    local = getattr(dims, "local_shapes", {}).get(name)
    if local is None or tuple(t.shape) == local:
        return False
    full = list(local)
    full[dims[name][0]] *= dims.tp
    return tuple(t.shape) == tuple(full) or (name in getattr(dims, "transposed", ()) and tuple(t.shape) ==
                                             tuple(full[::-1]))


def gather_tp(state: dict, dims: dict, mesh) -> dict:
    """``state`` (name -> tensor, this TP rank's slices) with every name in ``dims`` all-gathered
    over the TP group along its dimension: full shapes, as before ``tensor_parallel``. A collective
    over the TP group, in ``state``'s order: every rank passes the same names. A tensor already whole
    (``engine.full_state_dict()`` under a mesh: its full shape, per ``tp_dims``) is passed through."""
    comm, flip = mesh.communicator("tp"), getattr(dims, "transposed", set())
    out = {}
    for name, t in state.items():
        if name not in dims or comm.world_size == 1 or _already_whole(name, t, dims):
            # tp=1: this rank's tensor is whole, in the converted layout (GPT-2's Conv1D back to in x out); a
            # tensor already whole (engine.full_state_dict() under a mesh) is already in the original layout
            out[name] = t.t() if name in flip and t.dim() == 2 and comm.world_size == 1 else t
            continue
        t = t.detach().contiguous()
        full = torch.empty(comm.world_size * t.numel(), dtype=t.dtype, device=t.device)
        comm.all_gather(full, t.view(-1), tag="tp-state")
        dim, parts = dims[name]
        out[name] = unshard(list(full.view(comm.world_size, *t.shape).unbind(0)), dim, parts)
        if name in flip and out[name].dim() == 2:
            out[name] = out[name].t()
    return out



def gather_3d(state: dict, dims: dict, mesh) -> dict:
    """The whole model's state on every rank, as before ``tensor_parallel`` and ``pipeline_stage``:
    this stage's ``state`` (a plain stage's ``state_dict()``; ``engine.full_state_dict()`` under a mesh is
    already whole over DP, TP and PP, and passes through unchanged) with its TP
    slices joined (``gather_tp``), then every PP stage's names merged (an all-gather of the stages'
    dicts over the PP group; a collective on every rank, not booked in the ledger)."""
    state = gather_tp(state, dims, mesh)
    if mesh.pp == 1:
        return state
    parts = [None] * mesh.pp
    dist.all_gather_object(parts, state, group=mesh.group("pp"))
    return {k: v for part in parts for k, v in part.items()}
