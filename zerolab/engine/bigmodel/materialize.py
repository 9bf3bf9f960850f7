"""Filling the flat buffer unit by unit; models built on the meta device (chapter 6).

``zl.initialize`` accepts a model built under ``with torch.device("meta"):`` —
parameters with a shape and no storage, the role of DeepSpeed's
``zero.Init`` and FSDP2's meta-device initialisation. ``materialize`` walks
the units in order and, for each one:

    1. gives the unit its full (padded,) buffer (stage 3: allocated now, one unit)
    2. points each parameter at its slice; a built parameter's values are copied in,
       a meta one's module runs ``reset_parameters()`` (rank 0; every direct parameter
       of the module must be in this unit), else the parameter is marked uninitialised
    3. broadcasts the buffer from rank 0 (stage 3; stages 0-2 broadcast the flat
       buffer once, at the end), keeps this rank's shard, frees the buffer (stage 3)

so a rank never holds more than its shard plus one unit, whatever the model's
size. On the CPU a freed unit buffer is handed back to the OS at once
(``malloc_trim``): glibc otherwise keeps such multi-MB blocks resident in its
heap (it raises its mmap threshold after the first one is freed), and the
resident memory of ``initialize`` grew by the whole model although every buffer
was freed. Stage 3's partitioned frozen parameters (``frozen_flat``, a unit's frozen
twin) are placed and shared together with their unit, or after the trainable
units when their unit has no trainable parameters (a frozen embedding); the
frozen parameters kept whole and buffers on the meta device are materialised
whole by their module the same way. An uninitialised tensor must come from
``engine.load_state_dict`` before the first forward (``check_initialised``).
"""
from __future__ import annotations

import warnings

import torch
from torch import nn

from zerolab.runtime.measure import trim_heap
from zerolab.engine.bigmodel.zero_init import gather_piece
from zerolab.engine.flat import released


def direct_owners(model: nn.Module) -> dict:
    """id(param) -> the modules that own it directly (a tied parameter has several)."""
    out: dict = {}
    for m in model.modules():
        for p in m.parameters(recurse=False):
            out.setdefault(id(p), []).append(m)
    return out


@torch.no_grad()
def materialize(flat, model: nn.Module, communicator, keep=(), frozen_flat=None, master_range=None) -> set:
    """Fill ``flat`` (and stage 3's ``frozen_flat``) from the model (copy, or build meta
    parameters); return the names of tensors left uninitialised (meta, and no
    ``reset_parameters`` could build them). ``keep``: unit indices whose full buffer stays
    allocated (stage 3's persistent unit). ``master_range(u)``: the elements of unit ``u`` this
    rank's fp32 master holds (None: no master); where the model's values come in fp32, they are
    kept there (``flat.exact[i]``, rank 0's) for the master to start from, not their rounding."""
    rank, world = communicator.rank, communicator.world_size
    main, exact = flat, {}   # unit index -> its (padded,) fp32 values while it is placed (rank 0's once shared)
    rounded = [n for u in flat.units for n, p in u.params if master_range is not None and not p.is_meta
               and p.dtype == flat.dtype != torch.float32]
    if rounded:
        warnings.warn(f"zl.initialize: {len(rounded)} parameter(s) ({rounded[0]}, ...) arrived in {flat.dtype}: "
                      f"the fp32 master starts from these rounded values, the model's fp32 values are gone. Build "
                      f"it in fp32 (or on the meta device and load an fp32 checkpoint) for an exact master",
                      stacklevel=3)
    names = {}
    for n, p in model.named_parameters():
        names.setdefault(id(p), n)
    owners = direct_owners(model)
    hf = hf_model(model)   # a Hugging Face model initialises its modules its own way (_init_weights)
    # meta parameters to build here; under zl.zero_init a HF model's too (its post_init ran on partitioned modules)
    # — but not one a GatheredParameters(modifier_rank=r) block gave values (from_pretrained's weights: _zl_set)
    pending = {id(p) for _, p in model.named_parameters() if p.is_meta and (
        (hf is not None and not getattr(p, "_zl_set", False)) or not hasattr(p, "_zl_piece"))}
    frozen = {id(p) for _, p in flat.frozen}
    meta_buffers = set()   # (module id, buffer name): no values unless a BatchNorm's reset fills them
    where, written = {id(m): n for n, m in model.named_modules()}, set()   # meta buffers rank 0's build set
    uninit: set = set()
    for mname, m in model.named_modules():
        for k, b in m._buffers.items():
            if b is not None and b.is_meta:
                m._buffers[k] = torch.zeros(b.shape, dtype=b.dtype, device=flat.device)
                meta_buffers.add((id(m), k))
                uninit.add(f"{mname}.{k}" if mname else k)
    norm_stats = {}   # BatchNorm-like modules: reset_parameters() resets the running statistics too
    for mname, m in model.named_modules():
        if isinstance(m, nn.modules.batchnorm._NormBase):
            norm_stats[id(m)] = [f"{mname}.{k}" if mname else k for k in m._buffers if (id(m), k) in meta_buffers]

    lora = {id(m): part for n, m in model.named_modules() for part in ("lora_A", "lora_B") if f".{part}." in f".{n}."}

    def build(members: set, modules) -> None:
        """Initialise the modules whose direct parameters are all among ``members`` (rank 0) as their
        own construction would: ``reset_parameters()``, then a Hugging Face model's ``_init_weights``."""
        for m in modules:
            own = list(m.parameters(recurse=False))
            if not any(id(p) in pending for p in own) or not all(id(p) in members for p in own):
                continue
            for p in own:
                if p.is_meta:   # a frozen parameter of this module: whole, on the flat buffer's device
                    set_data(p, torch.zeros(p.shape, dtype=flat.dtype, device=flat.device))
            if hasattr(m, "reset_parameters") or hf is not None:
                if rank == 0:
                    before = {k: (b, b._version) for k, b in m._buffers.items() if (id(m), k) in meta_buffers}
                    construct(m, hf, lora.get(id(m)))   # may compute a buffer too (Gemma's embed_scale)
                    for p in own:   # a parameter given its values keeps them: back to its piece
                        if getattr(p, "_zl_set", False) and hasattr(p, "_zl_piece"):
                            set_data(p, torch.empty(p.shape, dtype=p.dtype, device="meta"))
                    written.update(f"{where[id(m)]}.{k}".lstrip(".") for k, (b, v) in before.items()
                                   if m._buffers[k] is not b or b._version != v)
                pending.difference_update(id(p) for p in own)
                uninit.difference_update(norm_stats.get(id(m), ()))

    def place(i: int, flat=flat) -> None:
        """Give unit i its full buffer and point its parameters at their slices of it."""
        if flat.sharded:
            buf = flat.full[i]
            buf.untyped_storage().resize_(flat.units[i].padded * buf.element_size())   # (padded_u,): one unit
            buf.zero_()
        flat.unit_views[i] = flat.views(i)   # made while the buffer has storage (stage 3 reuses them)
        u, ex, filled = flat.units[i], None, set()
        if flat is main and master_range is not None and flat.dtype != torch.float32 and any(
                (p.is_meta and hasattr(p, "_zl_piece")) or p.dtype == torch.float32 for _, p in u.params):
            ex = torch.zeros(u.padded, dtype=torch.float32, device=flat.device)
            exact[i] = (ex, filled)
        for (_, p), view, off in zip(u.params, flat.unit_views[i], u.offsets):
            value = p.data if not p.is_meta else None
            if p.is_meta and hasattr(p, "_zl_piece"):   # built under zl.zero_init: every rank's piece (zero_init.py)
                value = gather_piece(p, communicator).view(view.shape)
                del p._zl_piece
            if value is not None:
                view.copy_(value)
                if ex is not None and value.dtype == torch.float32:
                    ex[off: off + p.numel()].copy_(value.reshape(-1))
                    filled.add(off)
            set_data(p, view)

    def share(i: int, flat=flat) -> None:
        """Rank 0's values to every rank: stage 3 here, unit by unit (then this rank keeps its shard
        and frees the buffer), stages 0-2 at the end, the whole flat buffer; a unit with fp32 values
        here too, in fp32 (the 16-bit buffer is their rounding, the master range is kept in fp32)."""
        u, buf = flat.units[i], flat.full[i]
        ex, filled = exact.pop(i, (None, ())) if flat is main else (None, ())
        if ex is not None:
            for (_, p), off in zip(u.params, u.offsets):   # what is not fp32 (built here, or 16-bit)
                if off not in filled:
                    ex[off: off + p.numel()].copy_(buf[off: off + p.numel()])
            if world > 1:
                communicator.broadcast(ex, src=0, tag="init-params")
            buf.copy_(ex)
            lo, hi = master_range(u)
            flat.exact[i] = ex[lo:hi].clone()
        elif flat.sharded and world > 1:
            communicator.broadcast(buf, src=0, tag="init-params")
        if flat.sharded:
            flat.shard_view(flat.flat, u).copy_(buf[rank * u.shard: (rank + 1) * u.shard])
            if i not in keep:
                released(buf)
                if buf.device.type == "cpu":
                    trim_heap()

    # kept units (stage 3's persistent small params: a Linear's bias, its weight elsewhere) are
    # placed first and shared last, so a module's reset_parameters can write into both
    kept = {id(p) for i in keep for _, p in flat.units[i].params}
    fz = frozen_flat
    twin = {u.name: j for j, u in enumerate(fz.units)} if fz is not None else {}
    for i in sorted(keep):
        place(i)
    for i, u in enumerate(flat.units):
        if i in keep:
            continue
        place(i)
        j = twin.pop(u.name, None)
        params = u.params + (fz.units[j].params if j is not None else [])
        if j is not None:
            place(j, fz)
        build({id(p) for _, p in params} | frozen | kept, {id(m): m for _, p in params for m in owners[id(p)]}.values())
        share(i)
        if j is not None:
            share(j, fz)
    for j in sorted(twin.values()):   # units with frozen parameters only (a frozen embedding)
        params = fz.units[j].params
        place(j, fz)
        build({id(p) for _, p in params} | frozen | kept, {id(m): m for _, p in params for m in owners[id(p)]}.values())
        share(j, fz)
    for i in sorted(keep):
        build(kept | frozen, {id(m): m for _, p in flat.units[i].params for m in owners[id(p)]}.values())
        share(i)
    if not flat.sharded and world > 1:
        communicator.broadcast(flat.flat, src=0, tag="init-params")

    for _, p in flat.frozen:   # frozen parameters whose modules hold no trainable ones (a LoRA base layer)
        if p.is_meta and hasattr(p, "_zl_piece"):
            full = gather_piece(p, communicator).view(p.shape).to(device=flat.device, dtype=flat.dtype)
            del p._zl_piece
            set_data(p, full)
        elif p.is_meta:
            build(frozen, owners[id(p)])
    for n, p in flat.frozen:
        if p.is_meta:
            set_data(p, torch.zeros(p.shape, dtype=flat.dtype, device=flat.device))
        elif p.device != flat.device or p.dtype != flat.dtype:
            p.data = p.data.to(device=flat.device, dtype=flat.dtype)
    if hf is not None:   # buffers computed in __init__ (RoPE's inv_freq): the model's own init recomputes them
        for mname, m in model.named_modules():
            ks = [k for k in m._buffers if (id(m), k) in meta_buffers]
            if ks and not list(m.parameters(recurse=False)):
                before = {k: m._buffers[k]._version for k in ks}
                hf._init_weights(m)
                uninit.difference_update(f"{mname}.{k}" if mname else k for k in ks
                                         if m._buffers[k]._version != before[k])
    agree_written(sorted(f"{where[i]}.{k}".lstrip(".") for i, k in meta_buffers), written, uninit, communicator)
    uninit.update(names[i] for i in pending)
    return uninit


def agree_written(meta_names: list, written: set, uninit: set, communicator) -> None:
    """The meta buffers rank 0's build computed (it alone builds) count as set on every rank (their
    values reach the others with the buffers' broadcast)."""
    if not meta_names:
        return
    flags = torch.tensor([n in written for n in meta_names], dtype=torch.int32)
    if communicator.world_size > 1:
        communicator.all_reduce(flags, op="max", tag="init-buffers-built", control=True)
    uninit.difference_update(n for n, f in zip(meta_names, flags.tolist()) if f)


def hf_model(model: nn.Module):
    """The Hugging Face ``PreTrainedModel`` in ``model`` (the model itself, or the base of a PEFT
    wrapper), or None."""
    for m in model.modules():
        if callable(getattr(m, "_init_weights", None)) and hasattr(m, "config"):
            return m
    return None


def construct(m: nn.Module, hf, lora: str | None = None) -> None:
    """Module ``m``'s values as its construction gives them: its constructor's ``reset_parameters()``,
    then, in a Hugging Face model, what ``post_init`` does to it (``_init_weights``). A PEFT LoRA
    adapter is PEFT's, added after ``post_init``: A as ``nn.Linear`` builds it, B zeros (PEFT's default
    ``init_lora_weights=True``), so the adapted model starts as its base model."""
    if hasattr(m, "reset_parameters"):
        m.reset_parameters()
    if lora == "lora_B":
        for p in m.parameters(recurse=False):
            p.zero_()
    elif hf is not None and lora is None:
        hf._init_weights(m)


def set_data(p: nn.Parameter, t: torch.Tensor) -> None:
    """``p.data = t``; a meta parameter cannot take real data that way, so the tensors are
    swapped in place (``torch.utils.swap_tensors``): ``p`` stays the same Python object,
    so parameter groups and optimizers built on the meta model still refer to it."""
    if p.is_meta:   # a placeholder first: p must not share t's version counter (autograd checks it)
        torch.utils.swap_tensors(p, nn.Parameter(t.new_empty(0), requires_grad=p.requires_grad))
    p.data = t


def buffer_marks(model: nn.Module, uninit: set) -> dict:
    """name -> (module, key, placeholder, its version) for the uninitialised buffers, so a buffer the user
    sets after ``initialize`` — by assignment or in place — counts as set (``check_initialised``)."""
    out = {}
    for mname, m in model.named_modules():
        for k, b in m._buffers.items():
            name = f"{mname}.{k}" if mname else k
            if name in uninit and b is not None:
                out[name] = (m, k, b, b._version)
    return out


def check_initialised(uninit: set, marks: dict | None = None) -> None:
    """Raise if tensors of a meta-device model never got values (a buffer replaced or written since
    ``initialize`` has them)."""
    for name, (m, k, b, version) in (marks or {}).items():
        if name in uninit and (m._buffers.get(k) is not b or b._version != version):
            uninit.discard(name)
    if uninit:
        names = sorted(uninit)
        raise RuntimeError(
            f"the model was built on the meta device and {len(names)} tensor(s) have no values: "
            f"{names[:5]}{' ...' if len(names) > 5 else ''}. A parameter: its module has no reset_parameters() "
            f"(or shares a parameter with another unit); a buffer: its module computed it in __init__, which on "
            f"the meta device keeps no value, and neither reset_parameters() nor the model's _init_weights sets it "
            f"again. Load them with engine.load_state_dict(state_dict_or_path) before the first forward (a buffer "
            f"that is not in the state dict, registered with persistent=False, can also be set on the module after "
            f"zl.initialize, in place or by assignment)")
