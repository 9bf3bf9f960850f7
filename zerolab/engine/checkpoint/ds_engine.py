"""``engine.save_checkpoint(dir, tag, format="deepspeed")``: DeepSpeed's ZeRO files written by a running engine (chapter 8).

A zerolab save (atomic, checked) into the hidden folder ``dir/.<tag>.zerolab``;
then every rank builds *its own* DeepSpeed files from it (``ds_save.py``:
its partition of DeepSpeed's layout, read from the shards it needs); the
ranks agree that all succeeded; rank 0 removes the hidden folder and writes
``latest``. A keyword rather than a config key: the format is chosen per
save (one run can write both), and a DeepSpeed JSON stays the same for both.
"""
from __future__ import annotations

import os
import shutil

from zerolab.engine.checkpoint.ds_save import optimizer_record, write_deepspeed
from zerolab.engine.checkpoint.files import LATEST, read_manifest, write_text_atomic
from zerolab.engine.checkpoint.reshard import SavedCheckpoint
from zerolab.engine.checkpoint.save import agree, save_checkpoint


def save_deepspeed(engine, save_dir, tag=None, client_state=None, exclude_frozen_parameters=False,
                   format="deepspeed") -> str:
    """Collective: ``engine.save_checkpoint(save_dir, tag, format="deepspeed")``: DeepSpeed's files and ``latest``."""
    if format != "deepspeed":
        raise ValueError(f"save_checkpoint(format={format!r}): use 'zerolab' (the default) or 'deepspeed'")
    tag = f"global_step{engine.global_steps}" if tag is None else str(tag)
    hidden = os.path.join(os.fspath(save_dir), f".{tag}.zerolab")
    path = save_checkpoint(engine, hidden, tag, client_state, exclude_frozen_parameters)
    error = None
    try:
        saved = SavedCheckpoint(path, read_manifest(path))
        out = write_deepspeed(saved, save_dir, tag, ranks=[engine.rank], hyper=optimizer_record(engine))
        saved.close()
    except Exception as e:  # noqa: BLE001 - every rank must hear of it
        error = e
    agree(engine, error, "save_checkpoint(format='deepspeed')")
    if engine.rank == 0:
        shutil.rmtree(hidden, ignore_errors=True)
        write_text_atomic(os.path.join(os.fspath(save_dir), LATEST), tag + "\n")
    agree(engine, None, "save_checkpoint(format='deepspeed')")
    return out
