"""Offline consolidation: a sharded checkpoint -> one fp32 state dict, without torch.distributed (chapter 8).

    python -m zerolab consolidate CHECKPOINT_DIR OUTPUT [--tag TAG]

``consolidate_fp32(checkpoint_dir, tag)`` is the one entry point, whatever
wrote the checkpoint: a zerolab checkpoint (a ``<tag>/manifest.json``) is read
here (``reshard.consolidate``: one saved rank's file at a time, memory-mapped,
so the peak is about the output plus one shard); a DeepSpeed one goes to
``ds_files`` / ``ds_merge`` (``is_deepspeed_checkpoint`` /
``deepspeed_fp32_state_dict``), which reads DeepSpeed's files without
DeepSpeed. ``write_state_dict`` writes ``.safetensors`` when the output's
extension asks for it (and the package is installed), else ``torch.save``.
"""
from __future__ import annotations

import argparse
import os
import sys

import torch

from zerolab.engine.checkpoint import ds_files, ds_merge
from zerolab.engine.checkpoint.files import MANIFEST, CheckpointError, check_tag_dir, read_manifest, resolve_tag
from zerolab.engine.checkpoint.reshard import SavedCheckpoint, consolidate


def zerolab_tag_dir(checkpoint_dir, tag=None) -> str | None:
    """The tag folder of a zerolab checkpoint (``checkpoint_dir`` may be the tag folder itself), or None."""
    checkpoint_dir = os.fspath(checkpoint_dir)
    if tag is None and os.path.exists(os.path.join(checkpoint_dir, MANIFEST)):
        return checkpoint_dir
    tag = resolve_tag(checkpoint_dir, tag)
    if tag is None or not os.path.exists(os.path.join(checkpoint_dir, tag, MANIFEST)):
        return None
    return os.path.join(checkpoint_dir, tag)


def zerolab_fp32_state_dict(checkpoint_dir, tag=None) -> dict:
    tag_dir = zerolab_tag_dir(checkpoint_dir, tag)
    if tag_dir is None:   # say precisely what is missing
        name = resolve_tag(os.fspath(checkpoint_dir), tag)
        if name is None:
            raise CheckpointError(f"{checkpoint_dir}: no 'latest' file; give the tag to read")
        tag_dir = check_tag_dir(os.fspath(checkpoint_dir), name)
    saved = SavedCheckpoint(tag_dir, read_manifest(tag_dir))
    try:
        return consolidate(saved)
    finally:
        saved.close()


def consolidate_fp32(checkpoint_dir, tag=None) -> dict:
    """``{name: fp32 tensor}`` of the model in a zerolab or DeepSpeed checkpoint (``tag``: default ``latest``)."""
    checkpoint_dir = os.fspath(checkpoint_dir)
    if not os.path.isdir(checkpoint_dir):
        raise CheckpointError(f"{checkpoint_dir}: not a directory")
    if zerolab_tag_dir(checkpoint_dir, tag) is not None:
        return zerolab_fp32_state_dict(checkpoint_dir, tag)
    if ds_files.is_deepspeed_checkpoint(checkpoint_dir, tag):   # the dispatch point for other formats
        return ds_merge.deepspeed_fp32_state_dict(checkpoint_dir, tag)
    where = os.path.join(checkpoint_dir, tag or "<latest>")
    raise CheckpointError(f"{checkpoint_dir}: no checkpoint found (zerolab: no {where}/{MANIFEST}"
                          + "; DeepSpeed: no 'latest' or *_model_states.pt files)")


def write_state_dict(state_dict: dict, output) -> str:
    """Write ``state_dict`` to ``output``: safetensors for a ``.safetensors`` name, else torch.save."""
    output = os.fspath(output)
    os.makedirs(os.path.dirname(os.path.abspath(output)), exist_ok=True)
    if output.endswith(".safetensors"):
        try:
            from safetensors.torch import save_file
        except ImportError:
            raise CheckpointError(f"{output}: writing .safetensors needs the 'safetensors' package (pip install "
                                  f"safetensors), or choose a .pt/.bin output for torch.save") from None
        seen, plain = set(), {}
        for k, t in state_dict.items():   # safetensors refuses shared storage: a tied name gets its own copy
            ptr = t.untyped_storage().data_ptr()
            plain[k] = t.clone() if ptr in seen else t.contiguous()
            seen.add(ptr)
        save_file(plain, output)
    else:
        torch.save(state_dict, output)
    return output


def add_consolidate_args(p: argparse.ArgumentParser) -> None:
    p.description = ("Read a sharded checkpoint -- zerolab's (engine.save_checkpoint: <tag>/manifest.json, "
                     "zerolab_rank_*_optim.pt) or DeepSpeed's (ZeRO-1/2/3 *_optim_states.pt, read without "
                     "DeepSpeed) -- and write the model's full fp32 state dict {name: tensor}. No torch.distributed, "
                     "one process; memory is about the output plus one rank's shard.")
    p.add_argument("checkpoint_dir", help="the folder save_checkpoint wrote into (with 'latest'), or one tag folder")
    p.add_argument("output", help="output file: .safetensors (needs the safetensors package) or anything else "
                                  "for torch.save")
    p.add_argument("--tag", default=None, help="the tag to read (default: the one named in 'latest')")


def cmd_consolidate(args) -> int:
    try:
        sd = consolidate_fp32(args.checkpoint_dir, args.tag)
        write_state_dict(sd, args.output)
    except (CheckpointError, OSError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    unique = {t.untyped_storage().data_ptr(): t.numel() for t in sd.values() if t.is_floating_point()}
    print(f"wrote {args.output}: {len(sd)} entries, {sum(unique.values()):,} fp32 elements")
    return 0
