"""Merge DeepSpeed's ZeRO-1/2/3 fp32 partitions into whole weights, without DeepSpeed (chapter 8).

``deepspeed_fp32_state_dict(dir, tag)`` gives the same tensors as DeepSpeed's
``deepspeed.utils.zero_to_fp32.get_fp32_state_dict_from_zero_checkpoint``
(0.19.x, checkpoints saved on CPU), element for element and in the same key
order: buffers, then frozen parameters, then trainable ones, then tied names.

The fp32 weights live only in the optimizer files: each rank's flat fp32
partition of every parameter group (stages 1-2: ``single_partition_of_fp32_groups``,
one contiguous slice of the group's flat buffer per rank; stage 3:
``fp32_flat_groups``, where *every parameter* is split into N pieces of
ceil(numel / N) elements, padded at its end). Rebuilding a weight is the
arithmetic of chapter 8: which rank holds which elements of the flat buffer.
Each piece is copied straight from the (memory-mapped) shard into the output
tensor, so no full flat buffer is built on the way. Reading the files safely
is ``ds_files.py``'s job.
"""
from __future__ import annotations

import math
from pathlib import Path

import torch

from zerolab.engine.checkpoint.ds_files import (checkpoint_files, load_restricted, plain, read_model_states,
                                               resolve_tag_dir)

def read_fp32_partitions(files: list[Path], tag_dir: Path) -> tuple[int, int, list, list | None]:
    """(stage, world size, per rank the list of fp32 flat partitions per group, alignment paddings)."""
    states = []
    for f in files:
        sd = load_restricted(f)
        osd = sd.get("optimizer_state_dict")
        if not isinstance(osd, dict) or "zero_stage" not in osd:
            raise ValueError(f"{f}: not a ZeRO optimizer-state file (no optimizer_state_dict.zero_stage)")
        osd.pop("optimizer_state_dict", None)     # the Adam moments: not needed for the weights
        states.append(osd)
    first = states[0]
    stage, world = int(first["zero_stage"]), first["partition_count"]
    world = max(world) if isinstance(world, list) else int(world)
    if world != len(files):
        raise ValueError(f"{tag_dir}: the checkpoint was saved by {world} ranks but {len(files)} "
                         f"'*_optim_states.pt' files are there (a rank's file is missing or left from another save)")
    if stage not in (1, 2, 3):
        raise ValueError(f"{files[0]}: zero_stage {stage}, expected 1, 2 or 3")
    key = "single_partition_of_fp32_groups" if stage <= 2 else "fp32_flat_groups"
    for f, osd in zip(files, states):
        if key not in osd:
            raise ValueError(f"{f}: no {key!r} in optimizer_state_dict (stage {stage} file expected)")
    return stage, world, [osd[key] for osd in states], first.get("param_alignment_paddings")


def merge_stage12(out: dict, parts: list, shapes: list, paddings, world: int) -> None:
    """Stages 1-2: group g's flat buffer is the ranks' partitions end to end; a parameter is a range of it,
    possibly crossing rank boundaries."""
    for g, group_shapes in enumerate(shapes):
        pieces = [rank_parts[g] for rank_parts in parts]          # (partition numel,) per rank
        bounds = [0]
        for p in pieces:
            bounds.append(bounds[-1] + p.numel())
        pads = paddings[g] if paddings is not None else [0] * len(group_shapes)
        if len(pads) != len(group_shapes):
            raise ValueError(f"group {g}: the model-state file lists {len(group_shapes)} parameters, the optimizer "
                             f"file {len(pads)} alignment paddings: the model-state and optimizer files do not match")
        offset = 0
        for (name, shape), pad in zip(group_shapes.items(), pads):
            numel = math.prod(shape)
            t = torch.empty(numel, dtype=pieces[0].dtype)
            for r, p in enumerate(pieces):                        # overlap of [offset, +numel) with rank r
                lo, hi = max(offset, bounds[r]), min(offset + numel, bounds[r + 1])
                if lo < hi:
                    t[lo - offset: hi - offset] = p[lo - bounds[r]: hi - bounds[r]]
            out[name] = t.view(shape)
            offset += numel + pad
        align = 2 * world                                          # DeepSpeed pads a group to 2N
        if -(-offset // align) * align != -(-bounds[-1] // align) * align:
            raise ValueError(f"group {g}: the parameter shapes account for {offset} elements but the ranks' "
                             f"partitions hold {bounds[-1]}: the model-state and optimizer files do not match")


def stage3_piece(numel: int, world: int) -> int:
    """Elements of one parameter each rank holds at stage 3: ceil(numel / N) (the last piece ends in padding)."""
    return -(-numel // world)


def merge_stage3(out: dict, parts: list, shapes: list, world: int) -> None:
    """Stage 3: each parameter is split into N pieces of ceil(numel / N); rank r's piece of every parameter
    sits at the same offset in its concatenated groups."""
    flats = [torch.cat([g.reshape(-1) for g in rank_parts]) if len(rank_parts) > 1 else rank_parts[0]
             for rank_parts in parts]
    offset = 0
    for group_shapes in shapes:
        for name, shape in group_shapes.items():
            numel = math.prod(shape)
            piece = stage3_piece(numel, world)
            full = torch.cat([f[offset: offset + piece] for f in flats])
            if full.numel() < numel:
                raise ValueError(f"{name}: {numel} elements expected, the ranks' partitions hold {full.numel()} "
                                 f"from offset {offset}: the model-state and optimizer files do not match")
            out[name] = full[:numel].view(shape).clone()
            offset += piece
    if offset != flats[0].numel():
        raise ValueError(f"the parameter shapes account for {offset} elements per rank but each rank's "
                         f"fp32 partition holds {flats[0].numel()}: the model-state and optimizer files do not match")


def deepspeed_fp32_state_dict(checkpoint_dir, tag=None, exclude_frozen_parameters: bool = False) -> dict:
    """{name: fp32 tensor} of a DeepSpeed ZeRO-1/2/3 checkpoint, as DeepSpeed's ``zero_to_fp32`` gives it."""
    tag_dir = resolve_tag_dir(checkpoint_dir, tag)
    model_files, optim_files = checkpoint_files(tag_dir)
    if not model_files or not optim_files:
        raise FileNotFoundError(f"{tag_dir}: not a DeepSpeed ZeRO checkpoint (expected *_model_states.pt and "
                                f"*_optim_states.pt files, found {sorted(p.name for p in tag_dir.iterdir())})")
    models = read_model_states(model_files)
    stage, world, parts, paddings = read_fp32_partitions(optim_files, tag_dir)
    if stage == 3 and len(models) != world:
        raise ValueError(f"{tag_dir}: stage 3 keeps one model-state file per rank: {world} expected, "
                         f"{len(models)} found")
    out = dict(models[0]["buffers"])
    if not exclude_frozen_parameters:
        for name, shape in models[0]["frozen_shapes"].items():
            numel = math.prod(shape)
            if stage <= 2:
                out[name] = models[0]["frozen_fragments"][name]
            else:
                out[name] = torch.cat([m["frozen_fragments"][name] for m in models])[:numel].view(shape)
    if stage <= 2:
        merge_stage12(out, parts, models[0]["param_shapes"], paddings, world)
    else:
        merge_stage3(out, parts, models[0]["param_shapes"], world)
    for alias, source in models[0]["shared"]:
        if source in out:
            out[alias] = out[source]
    return {k: v.contiguous() for k, v in out.items()}
