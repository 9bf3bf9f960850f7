"""The model's consolidated state: one full fp32 state dict from the ranks' shards (chapters 4-6).

``consolidated_state_dict(engine)`` all-gathers every unit's fp32 update targets
(the fp32 master at mixed precision, the parameters themselves in fp32) into a
(padded Ψ,) fp32 buffer and cuts it into the model's named tensors; buffers and
frozen parameters are taken as they are. It is a collective: every rank calls it.
"""
from __future__ import annotations

import torch


@torch.no_grad()
def consolidated_state_dict(engine) -> dict:
    """The model's state dict with consolidated fp32 parameters, on every rank (collective)."""
    flat = engine.flat
    full = torch.zeros(flat.padded, dtype=torch.float32, device=flat.device)  # fp32: padded Ψ
    for u, t in zip(flat.units, engine.targets):
        if engine.shards_optimizer:
            engine.communicator.all_gather(flat.unit_view(full, u), t.contiguous(), tag="state-dict")
        else:
            flat.unit_view(full, u).copy_(t)
    where = {id(p): (u.offset + off, p.shape) for u in flat.units for (_, p), off in zip(u.params, u.offsets)}
    out = {}
    for name, t in engine.module.state_dict(keep_vars=True).items():
        if id(t) in where:
            start, shape = where[id(t)]
            out[name] = full[start: start + shape.numel()].view(shape).clone()
        else:
            out[name] = t.detach().float().clone() if t.is_floating_point() else t.detach().clone()
    return out
