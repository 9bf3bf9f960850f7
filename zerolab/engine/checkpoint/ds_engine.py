"""``engine.save_checkpoint(dir, tag, format="deepspeed")``: DeepSpeed's ZeRO files written by a running engine (chapter 8).

A zerolab save (atomic, checked) into the hidden folder ``dir/.<tag>.zerolab``;
then every rank builds *its own* DeepSpeed files from it (``ds_save.py``:
its partition of DeepSpeed's layout, read from the shards it needs) into
``dir/.<tag>.ds.tmp``; the ranks agree that all succeeded; rank 0 removes the
hidden folder, puts the tag folder in place in one rename and writes ``latest``
(a failed save leaves an earlier checkpoint of that tag, and ``latest``, as they were). A keyword rather than a config key: the format is chosen per
save (one run can write both), and a DeepSpeed JSON stays the same for both.
"""
from __future__ import annotations

import os
import shutil

from zerolab.engine.checkpoint.ds_save import optimizer_record, write_deepspeed
from zerolab.engine.checkpoint.files import LATEST, read_manifest, replace_dir, write_text_atomic
from zerolab.engine.checkpoint.reshard import SavedCheckpoint
from zerolab.engine.checkpoint.save import agree, save_checkpoint


def save_deepspeed(engine, save_dir, tag=None, client_state=None, exclude_frozen_parameters=False,
                   format="deepspeed") -> str:
    """Collective: ``engine.save_checkpoint(save_dir, tag, format="deepspeed")``: DeepSpeed's files and ``latest``."""
    if format != "deepspeed":
        raise ValueError(f"save_checkpoint(format={format!r}): use 'zerolab' (the default) or 'deepspeed'")
    tag = f"global_step{engine.global_steps}" if tag is None else str(tag)
    root = os.fspath(save_dir)
    hidden, tmp = os.path.join(root, f".{tag}.zerolab"), f".{tag}.ds.tmp"
    if engine.rank == 0:   # a save of this tag that died earlier (the zerolab save below is collective)
        shutil.rmtree(os.path.join(root, tmp), ignore_errors=True)
    path = save_checkpoint(engine, hidden, tag, client_state, exclude_frozen_parameters)
    error = None
    try:
        saved = SavedCheckpoint(path, read_manifest(path))
        write_deepspeed(saved, root, tmp, ranks=[engine.rank], hyper=optimizer_record(engine))
        saved.close()
    except Exception as e:  # noqa: BLE001 - every rank must hear of it
        error = e
    try:
        agree(engine, error, "save_checkpoint(format='deepspeed')")
    finally:
        if engine.rank == 0:
            shutil.rmtree(hidden, ignore_errors=True)
    error, final = None, os.path.join(root, tag)
    if engine.rank == 0:   # the whole tag folder appears at once, then `latest` names it
        try:
            replace_dir(os.path.join(root, tmp), final)
            write_text_atomic(os.path.join(root, LATEST), tag + "\n")
        except OSError as e:
            error = e
    agree(engine, error, "save_checkpoint(format='deepspeed')")
    return final
