"""``engine.save_checkpoint`` / ``engine.load_checkpoint``: sharded, atomic, reshardable (chapter 8).

DeepSpeed's names and, nearly, its layout (``files.py`` lists the
files). What is saved, per rank: its slice ``[r*S, (r+1)*S)`` of every
unit's fp32 values (the master copy, or the fp32 parameters) and optimizer
moments, and its buffers; rank 0 adds the 16-bit module state, the
``client_state`` and the manifest: engine (stage, world size, precision, step
counters, loss scaler, schedule position), the unit layout (names, shapes,
offsets) and every file's size and sha256. Stage 0 holds everything on every
rank, yet rank r still writes only slice r, so the files look the same at every stage.

A save is atomic. Every rank writes into ``save_dir/.<tag>.tmp``; the ranks
then agree (one all-gather of a status per rank: an error or the sizes and
checksums); only if every rank succeeded does rank 0 write the manifest,
rename the folder to ``save_dir/<tag>`` and, last, rewrite ``latest``. A rank
that dies leaves a ``.tmp`` folder nobody reads; a full disk (ENOSPC) raises
the same ``CheckpointError`` on every rank and removes the partial folder.
Saving between micro-batches of an accumulation window is refused: the
accumulated gradients are not part of a checkpoint.

Loading checks the manifest against the model (names, shapes), then fills
each unit of *this* engine's layout from the saved shards (``reshard.py``),
whatever the saved world size or stage; the ranks agree that every file
read cleanly before any collective, so a bad file is an error, never a hang.
"""
from __future__ import annotations

import errno
import os
import shutil
import time

import torch

from zerolab.engine.checkpoint.ds_save import optimizer_record
from zerolab.engine.checkpoint.files import (FORMAT, LATEST, MODEL_STATES, VERSION, CheckpointError, dumps, fsync_dir,
                                          model_file, optim_file, raise_agreed, replace_dir, resolve_tag, save_paths,
                                          write_checked, write_text_atomic)
from zerolab.engine.checkpoint.state import frozen_ids, frozen_pieces, gather_state_dict, layout, owned_start, read_owned, schedule_position, state_keys

MESSAGE_BYTES = 480   # an error message travels to every rank in a fixed-size tensor


def agree(engine, error: BaseException | None, what: str) -> None:
    """Collective: raise on every rank if any rank failed, with the first failing rank's message."""
    msg = torch.zeros(MESSAGE_BYTES + 1, dtype=torch.uint8)
    if error is not None:
        text = f"{type(error).__name__}: {error}".encode()[:MESSAGE_BYTES]
        msg[0] = 1
        msg[1: 1 + len(text)] = torch.frombuffer(bytearray(text), dtype=torch.uint8)
    dev = engine.flat.device
    everyone = torch.zeros(engine.world_size * msg.numel(), dtype=torch.uint8, device=dev)
    engine.communicator.all_gather(everyone, msg.to(dev), tag="checkpoint")
    rows = everyone.cpu().view(engine.world_size, -1)
    failed = [r for r in range(engine.world_size) if rows[r, 0]]
    text = bytes(rows[failed[0], 1:].tolist()).rstrip(b"\0").decode(errors="replace") if failed else ""
    raise_agreed(error, what, f"rank {engine.rank}", failed, text, note="; nothing was changed")


def _check_boundary(engine) -> None:
    if engine.micro_steps % engine.gas or engine._reduced_unstepped:
        raise RuntimeError(f"save_checkpoint at micro-step {engine.micro_steps}, inside an accumulation window of "
                           f"{engine.gas} micro-batches: the accumulated gradients are not saved. Save right after "
                           f"the engine.step() that ends a window (micro_steps % gradient_accumulation_steps == 0)")


def _check_plain(value, path="client_state") -> None:
    """client_state must load under torch.load(weights_only=True): tensors, numbers, strings, containers."""
    if isinstance(value, dict):
        for k, v in value.items():
            if not isinstance(k, (str, int)):
                raise ValueError(f"{path}: key {k!r} must be a str or int")
            _check_plain(v, f"{path}[{k!r}]")
    elif isinstance(value, (list, tuple)):
        for i, v in enumerate(value):
            _check_plain(v, f"{path}[{i}]")
    elif not isinstance(value, (torch.Tensor, str, int, float, bool, type(None))):
        raise ValueError(f"{path}: a {type(value).__name__} cannot be read back with torch.load(weights_only="
                         f"True); store tensors, numbers, strings, lists and dicts (e.g. state_dict() of it)")


def engine_record(engine) -> dict:
    opt, sched = engine.optimizer, engine.scheduler
    return {"stage": engine.stage, "world_size": engine.world_size, "precision": engine.precision.name,
            "compute_dtype": str(engine.precision.compute_dtype).replace("torch.", ""),
            "gradient_accumulation_steps": engine.gas, "global_steps": engine.global_steps,
            "micro_steps": engine.micro_steps, "skipped_steps": engine.skipped_steps,
            "optimizer": {"type": opt.kind, "step_count": opt.step_count,
                          "skipped": dict(getattr(opt, "math", opt).skipped),   # steps a parameter sat out
                          "hyper": optimizer_record(engine)},   # what DeepSpeed's files need (ds_save.py)
            "offload_optimizer": engine.config.zero.offload_optimizer.device,
            "scheduler": None if sched is None else {"type": type(getattr(sched, "schedule", sched)).__name__,
                                                     "position": schedule_position(engine)},
            "loss_scaler": engine.scaler.state_dict() if engine.scaler is not None else None}


def _flat_slices(engine) -> dict:
    """This rank's saved slice of every unit, per state key, concatenated (shard space)."""
    keys, parts = state_keys(engine), {}
    for i, u in enumerate(engine.flat.units):
        owned, off = read_owned(engine, i), engine.rank * u.shard - owned_start(engine, u)
        for k in keys:
            parts.setdefault(k, []).append(owned[k][off: off + u.shard])
    return {k: _joined(v).float().cpu() for k, v in parts.items()}


def _joined(pieces: list) -> torch.Tensor:
    """The pieces as one tensor: their own buffer when they tile it exactly (a device optimizer's
    shard-space state at stages 1-3: saved without a copy), else a concatenated copy."""
    first, n = pieces[0], sum(p.numel() for p in pieces)
    es = first.element_size()
    tiles = (first.storage_offset() == 0 and first.untyped_storage().nbytes() == n * es
             and all(p.is_contiguous() for p in pieces)
             and all(b.data_ptr() == a.data_ptr() + a.numel() * es for a, b in zip(pieces, pieces[1:])))
    return first.as_strided((n,), (1,), 0) if tiles else torch.cat(pieces)


def _parts(engine, client_state, exclude_frozen):
    """(file name, object) for the files this rank writes, built one at a time."""
    r, stage, flat = engine.rank, engine.stage, engine.flat
    head = {"format": FORMAT, "version": VERSION, "rank": r, "world_size": engine.world_size}
    yield optim_file(r), {**head, "state": _flat_slices(engine),
                          "buffers": {k: b.detach().cpu() for k, b in engine.module.named_buffers()}}
    frozen = frozen_ids(engine)
    trainable = {id(p) for p in flat.params()}
    # stage 3's partitioned frozen weights are saved whole by rank 0, gathered one unit at a time
    whole = {} if exclude_frozen else frozen_pieces(engine, keep=r == 0)
    module = {k: whole.get(id(t), t).detach() for k, t in engine.module.state_dict(keep_vars=True).items()
              if not (exclude_frozen and id(t) in frozen) and not (stage == 3 and id(t) in trainable)}
    top = {"module": module, "client_state": client_state or {}, "engine": engine_record(engine)}
    if stage == 3:
        yield model_file(r, 3), {**head, "param_shard": engine.param_shard.detach(), **(top if r == 0 else {})}
    elif r == 0:
        yield MODEL_STATES, {**head, **top}


def save_checkpoint(engine, save_dir, tag=None, client_state=None, exclude_frozen_parameters=False) -> str:
    """Collective: write the engine's state to ``save_dir/<tag>`` (default ``global_step{N}``); returns the path."""
    _check_boundary(engine)
    _check_plain(client_state or {})
    t0 = time.perf_counter()
    save_dir, tag, final, tmp = save_paths(save_dir, tag, engine.global_steps)
    error = None
    if engine.rank == 0:
        try:
            os.makedirs(save_dir, exist_ok=True)
            shutil.rmtree(tmp, ignore_errors=True)   # a save of this tag that died earlier
            os.makedirs(tmp)
        except OSError as e:
            error = CheckpointError(f"{save_dir}: cannot create the checkpoint folder ({e.strerror})")
    agree(engine, error, "save_checkpoint")
    files, error, name = {}, None, "(preparing its state)"
    try:
        for name, obj in _parts(engine, client_state, exclude_frozen_parameters):
            files[name] = {**write_checked(obj, os.path.join(tmp, name)), "rank": engine.rank}
            del obj
    except OSError as e:
        why = "the disk is full" if e.errno == errno.ENOSPC else e.strerror
        error = CheckpointError(f"save_checkpoint: rank {engine.rank} could not write {tmp}/{name} ({why}); "
                                f"the save of {tag!r} was abandoned, {_previous(save_dir)}")
    except Exception as e:  # noqa: BLE001 - every rank must hear of it, or the others would hang
        error = e
    try:
        agree(engine, error, "save_checkpoint")
    except CheckpointError:
        if engine.rank == 0:
            shutil.rmtree(tmp, ignore_errors=True)
        raise
    everyone = _gather_records(engine, files)
    error = None
    if engine.rank == 0:
        try:
            manifest = {"format": FORMAT, "version": VERSION, "tag": tag, "engine": engine_record(engine),
                        "layout": layout(engine), "state_keys": state_keys(engine),
                        "exclude_frozen_parameters": bool(exclude_frozen_parameters), "files": everyone}
            write_text_atomic(os.path.join(tmp, "manifest.json"), dumps(manifest))
            replace_dir(tmp, final)   # the same tag saved again: exchanged with the old in one rename
            fsync_dir(save_dir)
            write_text_atomic(os.path.join(save_dir, LATEST), tag + "\n")
        except OSError as e:
            shutil.rmtree(tmp, ignore_errors=True)
            error = CheckpointError(f"save_checkpoint: rank 0 could not finish {final} ({e.strerror}); "
                                    f"{_previous(save_dir)}")
    agree(engine, error, "save_checkpoint")
    engine.checkpoint_stats = {"save_seconds": time.perf_counter() - t0,
                               "save_bytes": sum(f["bytes"] for f in files.values())}
    return final


def _previous(save_dir) -> str:
    tag = resolve_tag(save_dir, None) if os.path.exists(os.path.join(save_dir, LATEST)) else None
    return f"'latest' still names {tag!r}" if tag else "no earlier checkpoint is affected"


def _gather_records(engine, files: dict) -> dict:
    """Every rank's {file: bytes, sha256} on rank 0, through one all-gather of fixed-size rows."""
    names = sorted(files)
    row = torch.zeros(2 * 41, dtype=torch.int64)   # per file (at most 2): bytes, 32 digest bytes, kind, 7 spare
    for j, n in enumerate(names[:2]):
        row[41 * j] = files[n]["bytes"]
        row[41 * j + 1: 41 * j + 33] = torch.tensor(list(bytes.fromhex(files[n]["sha256"])))
        row[41 * j + 33] = 1 if n == optim_file(engine.rank) else 2 if n == MODEL_STATES else 3
    out = torch.zeros(engine.world_size * row.numel(), dtype=torch.int64, device=engine.flat.device)
    engine.communicator.all_gather(out, row.to(engine.flat.device), tag="checkpoint")
    result = {}
    for r, rr in enumerate(out.cpu().view(engine.world_size, -1)):
        for j in range(2):
            kind = int(rr[41 * j + 33])
            if kind:
                name = {1: optim_file(r), 2: MODEL_STATES, 3: model_file(r, 3)}[kind]
                result[name] = {"bytes": int(rr[41 * j]), "rank": r,
                                "sha256": bytes(rr[41 * j + 1: 41 * j + 33].tolist()).hex()}
    return result


def save_16bit_model(engine, save_dir, filename="pytorch_model.bin", exclude_frozen_parameters=False) -> str:
    """Collective: rank 0 writes ``{name: tensor}`` in the compute dtype, gathered one unit at a time
    (DeepSpeed's ``stage3_gather_16bit_weights_on_model_save``); other ranks never hold the whole model."""
    sd = gather_state_dict(engine, rank0_only=True, sixteen_bit=True, exclude_frozen=exclude_frozen_parameters)
    path, error = os.path.join(os.fspath(save_dir), filename), None
    if engine.rank == 0:
        try:
            os.makedirs(os.fspath(save_dir), exist_ok=True)
            write_checked(sd, path + ".tmp")
            os.replace(path + ".tmp", path)
        except OSError as e:
            error = CheckpointError(f"save_16bit_model: cannot write {path} ({e.strerror})")
    agree(engine, error, "save_16bit_model")
    return path
