"""Checkpoints under a 3D mesh, read back into any other mesh (chapter 10; the format: docs/CHECKPOINTS.md).

**Save.** Every (tp, pp) coordinate's DP group writes today's checkpoint
(``save.py``: ZeRO shards over DP, atomic, checksummed) into its own folder
``<tag>/tp{t}_pp{p}/`` (a complete plain checkpoint directory: its ``latest``
names ``shards``), all inside ``save_dir/.<tag>.tmp``. When every rank of the
world has succeeded (one all-gather of a status per rank), global rank 0 writes
``mesh.json`` — the mesh's shape, the folders, and every parameter's full
shape, TP split ``[dim, parts]`` (or null) and PP stage — renames the folder to
``save_dir/<tag>`` and rewrites ``save_dir/latest``.

**Load** (any mesh, or none; also a plain checkpoint into a mesh). Every rank
checks the model against ``mesh.json`` — the names and full shapes of the
whole model, gathered from every rank — and raises the same named
``CheckpointError`` on every rank when they differ. Then each rank fills its
own parameters through the plain loader (``load.py``'s ``_load_state``: its
ZeRO shard of every unit, any stage): for each parameter it holds, the full
tensor of each state key (fp32 values, Adam's moments) is read from the saved
TP pieces of its stage (memory-mapped, one parameter at a time), joined along
its TP dimension and cut again for this rank's TP coordinate.
"""
from __future__ import annotations

import os
import shutil

from zerolab.engine.checkpoint import mesh_state as ms
from zerolab.engine.checkpoint.files import (LATEST, CheckpointError, check_tag_dir, dumps, fsync_dir, raise_agreed,
                                          read_manifest, replace_dir, resolve_tag, save_paths,
                                          write_text_atomic)
from zerolab.engine.checkpoint.mesh_source import MeshSource, read_mesh_manifest
from zerolab.engine.checkpoint.save import _check_boundary, _check_plain, save_checkpoint

MESH_MANIFEST, MESH_FORMAT, MESH_VERSION, SUB_TAG = "mesh.json", "zerolab-mesh-checkpoint", 1, "shards"


def folder(tp_rank: int, pp_rank: int) -> str:
    return f"tp{tp_rank}_pp{pp_rank}"


def agree_world(error: BaseException | None, what: str) -> None:
    """Collective over the whole world: raise on every rank if any rank failed (the first one's message)."""
    msgs = ms.world_all_gather(None if error is None else f"{type(error).__name__}: {error}")
    failed = [r for r, m in enumerate(msgs) if m]
    raise_agreed(error, what, "this rank", failed, msgs[failed[0]] if failed else "")


def save_mesh_checkpoint(engine, save_dir, tag=None, client_state=None, exclude_frozen_parameters=False) -> str:
    """Collective over the mesh: write ``save_dir/<tag>`` (default ``global_step{N}``); returns the path."""
    _check_boundary(engine)   # the plain save's own checks, first, on every rank alike
    _check_plain(client_state or {})
    m = ms.mesh_sizes(engine)
    save_dir, tag, final, tmp = save_paths(save_dir, tag, engine.global_steps)
    error = None
    if m["rank"] == 0:
        try:
            os.makedirs(save_dir, exist_ok=True)
            shutil.rmtree(tmp, ignore_errors=True)
            os.makedirs(tmp)
        except OSError as e:
            error = CheckpointError(f"{save_dir}: cannot create the checkpoint folder ({e.strerror})")
    agree_world(error, "save_checkpoint")
    descriptions = ms.world_all_gather(ms.describe(engine))
    model = ms.merge(descriptions)
    error = None
    try:   # this coordinate's DP group: today's format (its own collectives over DP, its own agreement)
        save_checkpoint(engine, os.path.join(tmp, folder(m["tp_rank"], m["pp_rank"])), SUB_TAG, client_state,
                        exclude_frozen_parameters)
    except Exception as e:  # noqa: BLE001 - the other groups must hear of it, or they would hang
        error = CheckpointError(f"global rank {m['rank']} (dp {m['dp_rank']}, tp {m['tp_rank']}, pp {m['pp_rank']}; "
                                f"'rank' below is the DP rank in its group): {e}")
        error.__cause__ = e
    try:
        agree_world(error, "save_checkpoint")
    except CheckpointError:
        if m["rank"] == 0:
            shutil.rmtree(tmp, ignore_errors=True)
        raise
    error = None
    if m["rank"] == 0:
        try:
            manifest = {"format": MESH_FORMAT, "version": MESH_VERSION, "tag": tag,
                        "mesh": {"dp": m["dp"], "tp": m["tp"], "pp": m["pp"],
                                 **({"cp": m["cp"]} if m["cp"] > 1 else {})},   # a folder's DP group: dp·cp ranks
                        "folders": {folder(t, p): {"tp": t, "pp": p, "tag": SUB_TAG}
                                    for p in range(m["pp"]) for t in range(m["tp"])},
                        "global_steps": engine.global_steps, "params": model,
                        "aliases": ms.merge_aliases(descriptions, model)}
            write_text_atomic(os.path.join(tmp, MESH_MANIFEST), dumps(manifest))
            replace_dir(tmp, final)   # the same tag saved again: exchanged with the old in one rename
            fsync_dir(save_dir)
            write_text_atomic(os.path.join(save_dir, LATEST), tag + "\n")
        except OSError as e:
            shutil.rmtree(tmp, ignore_errors=True)
            error = CheckpointError(f"save_checkpoint: rank 0 could not finish {final} ({e.strerror})")
    agree_world(error, "save_checkpoint")
    return final


def is_mesh_checkpoint(load_dir, tag=None) -> bool:
    """Whether ``load_dir/<tag>`` (default: ``latest``) holds a mesh checkpoint."""
    tag = resolve_tag(os.fspath(load_dir), tag)
    return tag is not None and os.path.exists(os.path.join(os.fspath(load_dir), tag, MESH_MANIFEST))


def check_model(manifest: dict, params: dict, aliases: dict, where: str) -> None:
    """The whole model (names, tied names too, and full shapes) against the manifest's: a named
    ``CheckpointError``."""
    saved = ms.named_shapes(manifest["params"], manifest.get("aliases", {}))
    model = ms.named_shapes(params, aliases)
    missing, extra = sorted(set(model) - set(saved)), sorted(set(saved) - set(model))
    if missing:
        raise CheckpointError(f"{where}: parameter {missing[0]!r} of the model is not in the checkpoint "
                              f"({len(missing)} missing; saved from another model?)")
    if extra:
        raise CheckpointError(f"{where}: parameter {extra[0]!r} of the checkpoint is not a trainable parameter of "
                              f"the model ({len(extra)} such; saved from another model?)")
    for name, shape in model.items():
        if saved[name] != shape:
            raise CheckpointError(f"{where}: parameter {name!r} has full shape {saved[name]} in the "
                                  f"checkpoint, the model's is {shape} (before tensor parallelism)")


def load_mesh_checkpoint(engine, load_dir, tag=None, load_optimizer_states=True, load_lr_scheduler_states=True):
    """Collective over the mesh: load a mesh (or plain) checkpoint into this engine, any mesh; returns
    ``(tag path, client_state)``, or ``(None, None)`` when ``load_dir`` has no ``latest``."""
    import warnings
    from zerolab.engine.checkpoint.load import _load_state
    load_dir = os.fspath(load_dir)
    tag = resolve_tag(load_dir, tag)
    if tag is None:
        warnings.warn(f"load_checkpoint: {load_dir!r} has no 'latest' file, so no checkpoint to load; the "
                      f"engine keeps its current state (returning (None, None))", stacklevel=3)
        return None, None
    descriptions = ms.world_all_gather(ms.describe(engine))   # before anything that may fail on one rank
    model = ms.merge(descriptions)
    error, client_state, source = None, None, None
    try:
        tag_dir = check_tag_dir(load_dir, tag)
        manifest = read_mesh_manifest(tag_dir, MESH_MANIFEST, MESH_FORMAT, MESH_VERSION, read_manifest)
        check_model(manifest, model, ms.merge_aliases(descriptions, model), os.path.join(tag_dir, MESH_MANIFEST if manifest["mesh_file"] else
                                                  "manifest.json"))
        source = MeshSource(tag_dir, manifest, engine, ms.describe(engine))
        client_state = _load_state(engine, source, load_optimizer_states, load_lr_scheduler_states)
    except Exception as e:  # noqa: BLE001 - every rank must hear of it before the collective below
        error = e
    finally:
        if source is not None:
            engine.checkpoint_stats = {"load_bytes_read": source.bytes_read}
            source.close()
    agree_world(error, "load_checkpoint")
    engine.after_update()
    return os.path.join(load_dir, tag), client_state


def save_16bit_mesh(engine, save_dir, filename="pytorch_model.bin") -> str:
    """Collective over the mesh: global rank 0 writes the whole model (original names, full shapes) in
    the compute dtype — the fp32 values cast, which is what the step writes into the 16-bit parameters."""
    import torch
    from zerolab.engine.checkpoint.files import write_checked
    sd = ms.full_state_dict(engine, rank0_only=True)
    path, error = os.path.join(os.fspath(save_dir), filename), None
    if sd is not None:
        dtype = engine.precision.compute_dtype
        sd = {k: v.to(dtype) if torch.is_floating_point(v) else v for k, v in sd.items()}
        try:
            os.makedirs(os.fspath(save_dir), exist_ok=True)
            write_checked(sd, path + ".tmp")
            os.replace(path + ".tmp", path)
        except OSError as e:
            error = CheckpointError(f"save_16bit_model: cannot write {path} ({e.strerror})")
    agree_world(error, "save_16bit_model")
    return path
