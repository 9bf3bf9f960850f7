"""The whole model's state under a 3D mesh: every (tp, pp) coordinate's slice put back together (chapter 10).

Under ``zl.initialize(model, cfg, mesh=mesh)`` an engine holds one pipeline
stage of a tensor-parallel model, sharded by ZeRO over its DP group. Its
parameter names are the original dotted names (``pipeline_stage`` keeps them;
whoever cut the model); a tensor-parallel layer says which dimension of which
parameter it split in its ``tp_dims`` attribute (``{"weight": (dim, parts)}``,
parts > 1: a fused q|k|v with each block split) — read here by duck typing, so
the engine never imports ``zerolab.parallel``.

``describe(engine)``: this rank's parameters (local shape, TP split) and
coordinates; ``merge(descriptions, tp)``: the whole model, ``{name: {"shape":
full shape, "tp_split": [dim, parts] | None, "pp_stage": s}}``.
``full_state_dict(engine)``: the DP gather (``state.py``), then each split
tensor all-gathered over the TP group and joined along its dimension (a
weight converted from GPT-2's ``Conv1D`` transposed back: ``transposed``), then
the PP stages' dicts merged (an all-gather of objects over the PP group, not
booked in the ledger): the original names and full shapes, as before
``tensor_parallel`` and ``pipeline_stage``.
"""
from __future__ import annotations

import torch
import torch.distributed as dist

from zerolab.engine.checkpoint.state import consolidated_state_dict, layout


def mesh_sizes(engine) -> dict:
    """{"dp", "tp", "pp", "cp", "dp_rank", "tp_rank", "pp_rank", "rank"} of the engine (no mesh: 1s and 0s; a
    coordinate's DP group, which writes its folder, is dp·cp ranks with cp > 1)."""
    mesh = getattr(engine, "mesh", None)
    if mesh is None:
        rank = dist.get_rank() if dist.is_initialized() else 0
        return {"dp": engine.world_size, "tp": 1, "pp": 1, "cp": 1, "dp_rank": engine.rank, "tp_rank": 0,
                "pp_rank": 0, "rank": rank}
    return {"dp": mesh.dp, "tp": mesh.tp, "pp": mesh.pp, "cp": mesh.cp, "dp_rank": mesh.dp_rank,
            "tp_rank": mesh.tp_rank, "pp_rank": mesh.pp_rank, "rank": mesh.rank}


def is_3d(engine) -> bool:
    mesh = getattr(engine, "mesh", None)
    return mesh is not None and mesh.tp * mesh.pp > 1


def split_dims(module) -> dict:
    """``{parameter name: (dim, parts)}`` of every tensor-parallel parameter (the layers' ``tp_dims``)."""
    out = {}
    for mname, m in module.named_modules(remove_duplicate=False):
        for pname, dim in (getattr(m, "tp_dims", None) or {}).items():
            if getattr(m, pname, None) is not None:
                out[f"{mname}.{pname}".lstrip(".")] = tuple(dim)
    return out


def transposed(module) -> set:
    """Names of the weights a tensor-parallel layer holds transposed from the original model's layout (a
    layer's ``tp_transposed``: Hugging Face GPT-2's ``Conv1D``, in x out, held as an ``nn.Linear``'s out x in)."""
    return {f"{mname}.weight".lstrip(".") for mname, m in module.named_modules(remove_duplicate=False)
            if getattr(m, "tp_transposed", False) and getattr(m, "weight", None) is not None}


def unshard(pieces: list, dim: int, parts: int = 1) -> torch.Tensor:
    """Every TP rank's piece, in rank order, back into the full tensor (each of ``parts`` blocks)."""
    blocks = [p.chunk(parts, dim=dim) for p in pieces]
    return torch.cat([torch.cat([b[j] for b in blocks], dim=dim) for j in range(parts)], dim=dim)


def shard(full: torch.Tensor, dim: int, parts: int, n: int, r: int) -> torch.Tensor:
    """TP rank ``r`` of ``n``'s piece of ``full`` (its slice of each of ``parts`` blocks), contiguous."""
    return torch.cat([b.chunk(n, dim=dim)[r] for b in full.chunk(parts, dim=dim)], dim=dim).contiguous()


def describe(engine) -> dict:
    """This rank's coordinates, trainable parameters ({name: [local shape, [dim, parts] | None]}), the
    other names of a tied parameter ({alias: name}) and buffers."""
    dims, m, lay = split_dims(engine.module), mesh_sizes(engine), layout(engine)
    params = {name: [shape, list(dims[name]) if name in dims and m["tp"] > 1 else None]
              for u in lay["units"] for name, shape, _ in u["params"]}
    aliases = {a: n for a, n in lay["aliases"].items() if n in params}
    return {**m, "params": params, "aliases": aliases, "buffers": [k for k, _ in engine.module.named_buffers()]}


def merge(descriptions: list) -> dict:
    """The whole model from every rank's ``describe``: {name: {"shape", "tp_split", "pp_stage"}}, in
    stage order (the original model's order for a pipeline cut in order)."""
    out = {}
    for d in sorted(descriptions, key=lambda d: (d["pp_rank"], d["tp_rank"], d["dp_rank"])):
        for name, (shape, split) in d["params"].items():
            full = list(shape)
            if split is not None:
                full[split[0]] *= d["tp"]
            out.setdefault(name, {"shape": full, "tp_split": split, "pp_stage": d["pp_rank"]})
    return out


def merge_aliases(descriptions: list, params: dict) -> dict:
    """{alias: parameter name} of every rank's tied names that are not parameters of another stage (a
    weight tied across pipeline stages is a parameter on each; inside one stage, one parameter)."""
    return {a: n for d in descriptions for a, n in d.get("aliases", {}).items() if a not in params}


def named_shapes(params: dict, aliases: dict) -> dict:
    """Every name of the model, aliases too, with its full shape: what two models are compared by."""
    return {**{n: list(p["shape"]) for n, p in params.items()},
            **{a: list(params[n]["shape"]) for a, n in aliases.items() if n in params}}


def world_all_gather(obj) -> list:
    """Every rank's ``obj`` (pickled; a collective over the whole world, not booked in the ledger)."""
    if not dist.is_initialized():
        return [obj]
    out = [None] * dist.get_world_size()
    dist.all_gather_object(out, obj)
    return out


def original_layout(module, sd: dict | None) -> dict | None:
    """``sd`` with the weights a conversion holds transposed (GPT-2's ``Conv1D``) back in the original
    model's layout: what ``full_state_dict`` returns at tp 1, as at tp > 1."""
    for name in transposed(module) if sd is not None else ():
        if name in sd and sd[name].dim() == 2:
            sd[name] = sd[name].t().contiguous()
    return sd


@torch.no_grad()
def full_state_dict(engine, rank0_only: bool = False) -> dict | None:
    """Collective over the whole mesh: the model's fp32 state dict with original names and full shapes,
    on every rank (``rank0_only``: global rank 0; the others get None)."""
    mesh = engine.mesh
    sd = consolidated_state_dict(engine, rank0_only)   # whole over DP; None off DP rank 0 with rank0_only
    if sd is not None:   # with rank0_only: the DP-rank-0 ranks, whose TP and PP groups are all DP rank 0
        dims, comm, flip = split_dims(engine.module), mesh.communicator("tp"), transposed(engine.module)
        for name, t in sd.items():
            if name in dims and mesh.tp > 1:
                t = t.contiguous()
                full = torch.empty(mesh.tp * t.numel(), dtype=t.dtype, device=t.device)
                comm.all_gather(full, t.view(-1), tag="tp-state")
                sd[name] = unshard(list(full.view(mesh.tp, *t.shape).unbind(0)), *dims[name])
            if name in flip and sd[name].dim() == 2:   # back to the original layout (GPT-2's Conv1D), at tp 1 too
                sd[name] = sd[name].t().contiguous()
        if mesh.pp > 1:
            parts = [None] * mesh.pp
            dist.all_gather_object(parts, sd, group=mesh.group("pp"))
            sd = {k: v for part in parts for k, v in part.items()}
    return None if rank0_only and mesh.rank != 0 else sd
