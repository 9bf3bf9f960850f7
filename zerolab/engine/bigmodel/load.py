"""``engine.load_state_dict(state_dict_or_path)``: pretrained weights, shard by shard (chapter 6).

The source is a dict of tensors, a ``torch.save`` file (``.pt``/``.pth``/``.bin``),
a ``.safetensors`` file, a Hugging Face sharded checkpoint's ``*.index.json``
(every shard it names) or a ``save_pretrained`` folder. A tied parameter is one
parameter under several names: any of them in the file loads it (HF's files
leave the aliases out); a PEFT adapter file's names load into the model's
``...default...`` adapter; a Hugging Face file's per-expert names load into the model's fused
experts (``hf_names.py``: transformers' own conversion mapping). Files are memory-mapped, never read whole: each
rank copies, parameter by parameter, only the elements of its own shard
(stage 3; stages 0-2 keep every parameter, so they copy all of them), and the
pages it never touches are never read. The 16-bit parameters take the cast
values and the fp32 master the exact ones, so ``full_state_dict()`` equals the
file bit for bit in fp32. Frozen parameters are copied the same way (stage 3
keeps only its shard of them too); buffers are copied whole.

Every rank calls it (each fills its own shard; no communication). Keys are
checked first, as ``nn.Module.load_state_dict(strict=True)`` does: missing,
unexpected and mis-shaped entries raise one error naming them, before any
value is written.

The ``.safetensors`` reader and writer here are the format's few lines
(8-byte header length, JSON header, raw little-endian data), so no extra
package is needed.
"""
from __future__ import annotations

import json
import mmap
import os
import struct

import torch

from zerolab.engine.bigmodel.hf_names import hf_names

SAFETENSORS_DTYPES = {"F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
                      "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8,
                      "U8": torch.uint8, "BOOL": torch.bool}


class Mapped(dict):
    """name -> tensor, and ``maps``: the memory maps the tensors view (``release_pages`` unmaps their pages)."""
    maps: list = []


def release_pages(sd) -> None:
    """Drop every page of ``sd``'s memory maps from this process (the page cache keeps them; the next
    touch maps them again). The kernel maps whole page-cache folios — megabytes on ext4 — so without
    this a rank reading half of each tensor holds the whole file resident."""
    for mm in getattr(sd, "maps", ()):
        mm.madvise(mmap.MADV_DONTNEED)   # a private, never-written file map: nothing is lost


def read_safetensors(path) -> Mapped:
    """name -> tensor over a private memory map of ``path`` (pages are read when touched)."""
    with open(path, "rb") as f:
        mm = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_COPY)   # private: writes never reach the file
    n = struct.unpack("<Q", mm[:8])[0]
    try:
        header = json.loads(mm[8: 8 + n])
    except ValueError as e:
        raise ValueError(f"{path}: not a safetensors file (its header is not JSON: {e})") from None
    out = Mapped()
    out.maps = [mm]
    for name, info in header.items():
        if name == "__metadata__":
            continue
        dtype = SAFETENSORS_DTYPES.get(info["dtype"])
        if dtype is None:
            raise ValueError(f"{path}: tensor {name!r} has dtype {info['dtype']}, which zerolab does not read")
        start, end = info["data_offsets"]
        count = (end - start) // torch.empty((), dtype=dtype).element_size()
        t = torch.frombuffer(mm, dtype=dtype, count=count, offset=8 + n + start) if count else \
            torch.empty(0, dtype=dtype)
        out[name] = t.view(info["shape"])
    return out


def save_safetensors(tensors: dict, path) -> None:
    """Write ``tensors`` (name -> tensor) as a ``.safetensors`` file."""
    rev = {v: k for k, v in SAFETENSORS_DTYPES.items()}
    header, off, blobs = {}, 0, []
    for name, t in tensors.items():
        b = t.detach().contiguous().cpu().reshape(-1).view(torch.uint8).numpy().tobytes()
        header[name] = {"dtype": rev[t.dtype], "shape": list(t.shape), "data_offsets": [off, off + len(b)]}
        blobs.append(b)
        off += len(b)
    h = json.dumps(header).encode()
    h += b" " * (-len(h) % 8)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(h)) + h)
        for b in blobs:
            f.write(b)


# what a Hugging Face save_pretrained folder holds, in the order its own loader looks for them
HF_FILES = ("model.safetensors", "model.safetensors.index.json", "pytorch_model.bin", "pytorch_model.bin.index.json",
            "adapter_model.safetensors", "adapter_model.bin")


def with_aliases(sd: dict, current: dict) -> dict:
    """``sd`` with every name of a tied parameter filled from whichever of its names the file has (HF's
    ``save_pretrained`` leaves the aliases out), and a PEFT adapter file's names (``...lora_A.weight``)
    under the model's (``...lora_A.default.weight``, the adapter PEFT calls "default"). Views only."""
    out = dict(sd)
    names: dict = {}
    for k, t in current.items():
        names.setdefault(id(t), []).append(k)
    for group in names.values():
        have = next((k for k in group if k in sd), None)
        for k in group if have is not None else ():
            out.setdefault(k, sd[have])
    for k in current:
        if k not in out and ".default." in k:
            bare = k.replace(".default.", ".", 1)
            for cand in (bare, "base_model.model." + bare):
                if cand in sd:
                    out[k] = sd[cand]
                    break
    return out


def open_state_dict(src) -> tuple[dict, str]:
    """``(name -> tensor, description)`` for a dict, a .safetensors file or a torch.save file."""
    if isinstance(src, dict):
        return src, "the state dict"
    if not isinstance(src, (str, os.PathLike)):
        raise TypeError(f"load_state_dict takes a dict or a path, got {type(src).__name__}")
    path = os.fspath(src)
    if os.path.isdir(path):   # a save_pretrained folder: its single file, or its index of shards
        found = [n for n in HF_FILES if os.path.isfile(os.path.join(path, n))]
        if not found:
            raise FileNotFoundError(f"load_state_dict: no {' / '.join(HF_FILES)} in the folder {path!r}")
        path = os.path.join(path, found[0])
    if not os.path.isfile(path):
        raise FileNotFoundError(f"load_state_dict: no file {path!r}")
    if path.endswith(".index.json"):   # Hugging Face's sharded checkpoint: every shard, memory-mapped
        with open(path) as f:
            weight_map = json.load(f).get("weight_map")
        if not isinstance(weight_map, dict):
            raise ValueError(f"load_state_dict: {path!r} has no 'weight_map' (not a sharded checkpoint's index)")
        sd = Mapped()
        sd.maps = []
        for shard in dict.fromkeys(weight_map.values()):
            part, _ = open_state_dict(os.path.join(os.path.dirname(path), shard))
            sd.update({k: v for k, v in part.items() if weight_map.get(k) == shard})
            sd.maps += getattr(part, "maps", [])
        return sd, path
    if path.endswith(".safetensors"):
        return read_safetensors(path), path
    try:
        sd = torch.load(path, map_location="cpu", mmap=True, weights_only=True)
    except Exception as e:
        raise ValueError(f"load_state_dict: {path!r} is neither a .safetensors file nor a torch.save file "
                         f"of tensors ({type(e).__name__}: {e})") from None
    if not isinstance(sd, dict):
        raise ValueError(f"load_state_dict: {path!r} holds a {type(sd).__name__}, not a dict of tensors")
    return sd, path


def check_keys(expected: dict, sd: dict, where: str, strict: bool) -> tuple[list, list]:
    """Missing / unexpected keys (raised when ``strict``) and shape mismatches (always raised)."""
    missing = [k for k in expected if k not in sd]
    unexpected = [k for k in sd if k not in expected]
    bad = [f"{k!r}: {tuple(sd[k].shape)} in {where}, the model expects {tuple(shape)}"
           for k, shape in expected.items() if k in sd and tuple(sd[k].shape) != tuple(shape)]
    problems = []
    if strict and missing:
        problems.append(f"missing from {where}: {missing[:8]}{' ...' if len(missing) > 8 else ''}")
    if strict and unexpected:
        problems.append(f"unexpected in {where} (not in the model): {unexpected[:8]}"
                        f"{' ...' if len(unexpected) > 8 else ''}")
    if bad:
        problems.append("shape mismatch: " + "; ".join(bad[:8]))
    if problems:
        raise ValueError("load_state_dict: " + ". ".join(problems))
    return missing, unexpected


@torch.no_grad()
def load_state_dict(engine, src, strict: bool = True) -> tuple[list, list]:
    """Load ``src`` into ``engine`` (see the module docstring); returns (missing, unexpected)."""
    raw, where = open_state_dict(src)
    opened = raw   # its memory maps
    flat, model = engine.flat, engine.module
    current = model.state_dict(keep_vars=True)
    raw = hf_names(model, raw, current)   # a HF file's per-expert names: the model's fused experts
    sd = with_aliases(raw, current)   # tied names are one parameter; PEFT's adapter names
    used = {id(v) for k, v in sd.items() if k in current}
    sd = {k: v for k, v in sd.items() if k in current or id(v) not in used}   # aliases consumed: not unexpected
    expected = {k: flat.shapes.get(id(t), t.shape) for k, t in current.items()}
    missing, unexpected = check_keys(expected, sd, where, strict)
    if hasattr(engine, "release_all"):
        engine.release_all()   # stage 3: nothing gathered may hold stale values
    offload_master = engine.master is None and engine.precision.has_master   # an offloaded fp32 master
    for i, u in enumerate(flat.units):
        plo, phi = flat.own_range(u, flat.sharded)            # the parameter elements this rank keeps
        mlo, mhi = flat.own_range(u, engine.shards_optimizer)  # the fp32 elements it updates
        pdst = flat.shard_view(flat.flat, u) if flat.sharded else flat.full[i]
        mdst = None
        if engine.master is not None:
            mdst = engine.targets[i]
        elif offload_master:
            mdst = torch.zeros(mhi - mlo, dtype=torch.float32)
        full = flat.full[i] if flat.sharded and flat.full[i].untyped_storage().nbytes() else None
        for (name, p), off in zip(u.params, u.offsets):
            if name not in sd:
                continue
            src_flat = sd[name].reshape(-1)   # a view of the (mapped) tensor: nothing is read yet
            numel = flat.shapes[id(p)].numel()  # (a released stage-3 parameter is empty)
            for dst, lo, hi in ((pdst, plo, phi), (mdst, mlo, mhi)):
                a, b = max(off, lo), min(off + numel, hi)
                if dst is not None and a < b:
                    dst[a - lo: b - lo].copy_(src_flat[a - off: b - off])   # only these pages are read
            if full is not None:   # stage 3's persistent unit is kept whole
                full[off: off + numel].copy_(src_flat)
        if offload_master:
            engine.optimizer.edit_master(i, torch.ones(mdst.numel(), dtype=torch.bool), mdst)
        release_pages(opened)   # this unit's file pages leave the rank's resident set
    load_frozen_shards(engine, sd)
    whole = {id(t) for _, t in flat.frozen} | {id(b) for b in model.buffers()}
    for name, t in current.items():
        if name in sd and id(t) in whole:
            t.data.copy_(sd[name])   # frozen parameters kept whole, and buffers
    engine.uninitialised.difference_update(k for k in current if k in sd)   # only what was copied
    return missing, unexpected


@torch.no_grad()
def load_frozen_shards(engine, sd: dict) -> None:
    """Stage 3's partitioned frozen parameters: copy this rank's shard of each one in ``sd``
    (a whole tensor, possibly memory-mapped: only the shard's pages are read)."""
    fz = engine.frozen_flat
    for u in fz.units if fz is not None else []:
        lo, hi = fz.own_range(u, True)
        dst = fz.shard_view(fz.flat, u)
        for (name, p), off in zip(u.params, u.offsets):
            if name in sd:
                a, b = max(off, lo), min(off + fz.shapes[id(p)].numel(), hi)
                if a < b:
                    dst[a - lo: b - lo].copy_(sd[name].reshape(-1)[a - off: b - off])
