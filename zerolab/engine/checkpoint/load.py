"""``engine.load_checkpoint``: read a zerolab checkpoint into this engine, any world size or stage (chapter 8).

Every rank reads the manifest, checks it against the model, and fills each of
its units from the saved shards (``reshard.fill_owned``: one unit's state at a
time, from memory-mapped files). The 16-bit parameters are the fp32 values
cast, exactly what the step writes after each update, so a resume at the same
world size and stage continues bit for bit. The ranks agree that every read
succeeded before the one collective that follows (stages 1-2 all-gather the
parameters; stage 3 its persistent unit).
"""
from __future__ import annotations

import os
import time
import warnings

import torch

from zerolab.engine.checkpoint.save import agree
from zerolab.engine.bigmodel.load import load_frozen_shards
from zerolab.engine.checkpoint.ds_universal import open_deepspeed, universal_tag
from zerolab.engine.checkpoint.files import CheckpointError, check_tag_dir, optim_file, read_manifest, resolve_tag
from zerolab.engine.checkpoint.reshard import SavedCheckpoint, check_compatible, fill_owned
from zerolab.engine.checkpoint.state import ShiftedSchedule, layout, owned_start, state_keys, write_owned


def load_checkpoint(engine, load_dir, tag=None, load_optimizer_states=True, load_lr_scheduler_states=True):
    """Collective: load ``load_dir/<tag>`` (default: the tag in ``latest``); returns ``(tag path, client_state)``,
    or ``(None, None)`` with a warning when ``load_dir`` holds no checkpoint. ``engine.checkpoint_stats``
    then says how many bytes this rank copied out of the files and how many it had mapped."""
    load_dir = os.fspath(load_dir)
    tag = universal_tag(load_dir, resolve_tag(load_dir, tag))   # DeepSpeed's universal: latest_universal
    if tag is None:
        warnings.warn(f"load_checkpoint: {load_dir!r} has no 'latest' file, so no checkpoint to load; the "
                      f"engine keeps its current state (returning (None, None))", stacklevel=3)
        return None, None
    tag_dir = check_tag_dir(load_dir, tag)
    saved = open_deepspeed(tag_dir) or SavedCheckpoint(tag_dir, read_manifest(tag_dir))   # DeepSpeed's files too
    error, client_state, t0 = None, None, time.perf_counter()
    try:
        check_compatible(saved, layout(engine))
        client_state = _load_state(engine, saved, load_optimizer_states, load_lr_scheduler_states)
    except Exception as e:  # noqa: BLE001 - every rank must hear of it before the collective below
        error = e
    finally:
        engine.checkpoint_stats = {"load_bytes_read": saved.bytes_read, "load_bytes_mapped": saved.mapped_bytes}
        saved.close()
    agree(engine, error, "load_checkpoint")
    engine.after_update()    # stages 1-2: all-gather the loaded parameters; stage 3: its persistent unit
    param_file = getattr(engine, "param_file", None)
    if param_file is not None:   # stage 3's parameter shard on NVMe: written, back to disk
        param_file.release()
    engine.checkpoint_stats["load_seconds"] = time.perf_counter() - t0
    return tag_dir, client_state


@torch.no_grad()
def _load_state(engine, saved: SavedCheckpoint, with_optimizer: bool, with_schedule: bool) -> dict:
    rec, keys = saved.engine, state_keys(engine)
    opt = engine.optimizer
    if with_optimizer:
        saved_moments = [k for k in saved.manifest["state_keys"] if k != "fp32"]
        if saved_moments != keys[1:]:
            raise CheckpointError(f"{saved.dir}/manifest.json: optimizer {rec['optimizer']['type']!r} saved "
                                  f"state {saved_moments}, this engine's optimizer {opt.kind!r} needs "
                                  f"{keys[1:]}; load with load_optimizer_states=False to keep only the weights")
    read = keys if with_optimizer else ["fp32"]
    lay = layout(engine)
    # the loader's one temporary: a unit's state (fp32, keys x the rank's largest owned unit), reused
    scratch = torch.empty(len(keys), max(t.numel() for t in engine.targets), dtype=torch.float32)
    for i, u in enumerate(engine.flat.units):
        n = engine.targets[i].numel()
        values = fill_owned(saved, lay["units"][i], owned_start(engine, u), n, read, scratch)
        for k, row in zip(keys, scratch):
            if k not in values:   # moments not loaded: zero, as a fresh optimizer's
                values[k] = row[:n].zero_()
        write_owned(engine, i, values)
        if engine.precision.has_master:   # the 16-bit parameters: the fp32 values cast, as after a step
            engine.own(engine.flat.flat, u).copy_(values["fp32"])
    del scratch, values
    _load_module_extras(engine, saved)
    # saved at a window's end: the optimizer steps are what is kept; the micro-steps are counted in this
    # engine's window (its accumulation steps may differ: a pipeline needs gas >= pp, so a mesh changes it)
    engine.global_steps = rec["global_steps"]
    engine.micro_steps = rec["global_steps"] * engine.gas
    engine.skipped_steps = rec["skipped_steps"]
    opt.step_count = rec["optimizer"]["step_count"] if with_optimizer else 0
    # steps each parameter sat out (no gradient on any rank, engine/unused.py): its own Adam t
    getattr(opt, "math", opt).skipped = dict(rec["optimizer"].get("skipped", {})) if with_optimizer else {}
    if engine.scaler is not None and with_optimizer and rec["loss_scaler"] is not None:
        engine.scaler.load_state_dict(rec["loss_scaler"])
    if engine.scheduler is not None:
        position = rec["scheduler"]["position"] if with_schedule and rec["scheduler"] else 0
        shift = position - opt.step_count
        engine.scheduler = ShiftedSchedule(engine.scheduler, shift) if shift else \
            getattr(engine.scheduler, "schedule", engine.scheduler)
    return dict(saved.model_states().get("client_state", {}))


def _load_module_extras(engine, saved: SavedCheckpoint) -> None:
    """Frozen parameters (rank 0's, unless the save excluded them) and buffers (this rank's own at
    the same world size, where they may differ between ranks, else rank 0's)."""
    lay = saved.layout
    module = saved.model_states().get("module", {})
    same = saved.world_size == engine.world_size
    buffers = saved.file(optim_file(engine.rank if same else 0)).get("buffers", {})
    state = engine.module.state_dict(keep_vars=True)
    shapes, shards = engine.flat.shapes, {}
    partitioned = {id(p) for u in engine.frozen_flat.units for _, p in u.params} if engine.frozen_flat else set()
    for name in lay["frozen"]:
        if name in module and name in state:
            if id(state[name]) in partitioned:   # stage 3: this rank's shard of it
                _check_shape(shapes[id(state[name])], module[name], saved, name)
                shards[name] = module[name]
            else:
                _copy(state[name], module[name], saved, name)
    load_frozen_shards(engine, shards)
    for name, b in engine.module.named_buffers():
        if name in buffers:
            _copy(b, buffers[name], saved, name)


def _check_shape(shape, src, saved, name) -> None:
    if tuple(shape) != tuple(src.shape):
        raise CheckpointError(f"{saved.dir}: {name!r} has shape {list(src.shape)} in the checkpoint, expected "
                              f"{list(shape)} (the model's)")


def _copy(dst, src, saved, name) -> None:
    _check_shape(dst.shape, src, saved, name)
    dst.data.copy_(src)

