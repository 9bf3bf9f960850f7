"""``python -m zerolab convert SRC DST --to deepspeed|zerolab``: a checkpoint folder rewritten in the other format (chapter 8).

No torch.distributed, no engine, one process: every rank's files are built in
turn from the source's shards (``ds_save.py`` one way, ``ds_load.py`` the
other), so memory stays near one rank's state. ``--to deepspeed`` takes a
zerolab checkpoint (``<tag>/manifest.json``) and may change the ZeRO stage
(1-3) and the number of ranks (``--stage``, ``--world``); ``--to zerolab``
takes DeepSpeed's ZeRO-1/2/3 files and writes zerolab's, with a manifest and
checksums, which ``engine.load_checkpoint`` reads at any world size.
"""
from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

from zerolab.engine.checkpoint.ds_files import is_deepspeed_checkpoint
from zerolab.engine.checkpoint.files import (FORMAT, LATEST, MANIFEST, VERSION, CheckpointError, dumps, model_file,
                                             optim_file, read_manifest, resolve_tag, write_checked, write_text_atomic)


def _source(src, tag):
    """(kind, tag folder): kind "zerolab" or "deepspeed"; a clear error for anything else."""
    src = os.fspath(src)
    if not os.path.isdir(src):
        raise CheckpointError(f"{src}: no such folder")
    if os.path.exists(os.path.join(src, MANIFEST)) or any(Path(src).glob("*_optim_states.pt")):
        tag_dir = src                                   # the tag folder itself
    else:
        tag = resolve_tag(src, tag)
        if tag is None:
            raise CheckpointError(f"{src}: neither a zerolab nor a DeepSpeed checkpoint: no 'latest' file and no "
                                  f"checkpoint files (found {sorted(os.listdir(src))[:8]}); pass the tag folder or --tag")
        tag_dir = os.path.join(src, tag)
        if not os.path.isdir(tag_dir):
            raise CheckpointError(f"{src}: 'latest' names tag {tag!r}, but {tag_dir} does not exist")
    if os.path.exists(os.path.join(tag_dir, MANIFEST)):
        return "zerolab", tag_dir
    if is_deepspeed_checkpoint(tag_dir):
        return "deepspeed", tag_dir
    raise CheckpointError(f"{tag_dir}: neither a zerolab checkpoint (no {MANIFEST}) nor DeepSpeed's (no "
                          f"*_model_states.pt with DeepSpeed's ds_version next to *_optim_states.pt); found "
                          f"{sorted(os.listdir(tag_dir))[:8]}")


def to_zerolab(tag_dir, dst, tag: str) -> str:
    """DeepSpeed's tag folder -> ``dst/tag`` in zerolab's format (manifest last), then ``dst/latest``."""
    from zerolab.engine.checkpoint.ds_load import DeepSpeedSaved
    saved = DeepSpeedSaved(tag_dir)
    out = os.path.join(os.fspath(dst), tag)
    os.makedirs(out, exist_ok=True)
    files = {}
    names = [(optim_file(r), r) for r in range(saved.world_size)] + [(model_file(0, saved.engine["stage"]), 0)]
    for name, r in names:
        files[name] = {**write_checked(saved.file(name), os.path.join(out, name)), "rank": r}
        saved.close_file(name)
    manifest = {"format": FORMAT, "version": VERSION, "tag": tag, "engine": saved.engine, "layout": saved.layout,
                "state_keys": saved.manifest["state_keys"], "exclude_frozen_parameters": False, "files": files,
                "converted_from": {"format": "deepspeed", "dir": os.path.abspath(tag_dir)}}
    write_text_atomic(os.path.join(out, MANIFEST), dumps(manifest))
    write_text_atomic(os.path.join(os.fspath(dst), LATEST), tag + "\n")
    return out


def to_deepspeed(tag_dir, dst, tag: str, stage=None, world=None, sub_group_size=None) -> str:
    """zerolab's tag folder -> ``dst/tag`` in DeepSpeed's format (every rank's files), then ``dst/latest``."""
    from zerolab.engine.checkpoint.ds_save import write_deepspeed
    from zerolab.engine.checkpoint.reshard import SavedCheckpoint
    saved = SavedCheckpoint(tag_dir, read_manifest(tag_dir))
    try:
        out = write_deepspeed(saved, dst, tag, stage=stage, world=world, sub_group_size=sub_group_size)
    finally:
        saved.close()
    write_text_atomic(os.path.join(os.fspath(dst), LATEST), tag + "\n")
    return out


def convert(src, dst, to: str, tag=None, stage=None, world=None, sub_group_size=None) -> str:
    if to not in ("deepspeed", "zerolab"):
        raise CheckpointError(f"--to {to!r}: choose 'deepspeed' or 'zerolab'")
    kind, tag_dir = _source(src, tag)
    if kind == to:
        raise CheckpointError(f"{tag_dir} is already a {kind} checkpoint (--to {to}): nothing to convert")
    if to == "zerolab" and (stage is not None or world is not None or sub_group_size is not None):
        raise CheckpointError("--stage/--world/--sub-group-size apply to --to deepspeed; a zerolab checkpoint "
                              "loads at any stage and world size as it is")
    if sub_group_size is not None and int(sub_group_size) < 1:
        raise CheckpointError(f"--sub-group-size {sub_group_size}: must be at least 1 (DeepSpeed's default 1e9)")
    name = os.path.basename(os.path.normpath(tag_dir))
    return to_deepspeed(tag_dir, dst, name, stage, world, sub_group_size) if to == "deepspeed" else \
        to_zerolab(tag_dir, dst, name)


def add_convert_args(p: argparse.ArgumentParser) -> None:
    p.description = ("Rewrite a checkpoint in the other format: zerolab's (engine.save_checkpoint) as DeepSpeed "
                     "0.19's ZeRO files, which DeepSpeed's engine.load_checkpoint resumes from, or DeepSpeed's as "
                     "zerolab's. Weights, fp32 master partitions, Adam moments, step counts and the scheduler's "
                     "step carry over. One process, no torch.distributed.")
    p.add_argument("src", help="the checkpoint folder (with 'latest') or one tag folder")
    p.add_argument("dst", help="the folder to write <tag>/ and 'latest' into")
    p.add_argument("--to", required=True, choices=["deepspeed", "zerolab"], help="the format to write")
    p.add_argument("--tag", default=None, help="the tag to read (default: the one named in 'latest')")
    p.add_argument("--stage", type=int, default=None, choices=[1, 2, 3],
                   help="--to deepspeed: the ZeRO stage of the files (default: the saved stage)")
    p.add_argument("--world", type=int, default=None, help="--to deepspeed: the number of ranks (default: saved)")
    p.add_argument("--sub-group-size", type=int, default=None,
                   help="--to deepspeed, stage 3: DeepSpeed's zero_optimization.sub_group_size of the run that will "
                        "load the files (default: the saved run's, else DeepSpeed's 1e9)")


def cmd_convert(args) -> int:
    try:
        out = convert(args.src, args.dst, args.to, args.tag, args.stage, args.world, args.sub_group_size)
    except (CheckpointError, OSError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(f"wrote {out} ({args.to}'s format)")
    return 0
