"""The files of a zerolab checkpoint: names, the manifest, checked writes and reads (chapter 8).

A checkpoint directory (``save_dir``) holds one folder per tag and a ``latest`` file::

    save_dir/
      latest                                        the newest complete tag (written last)
      global_step6/
        manifest.json                               written last, by rank 0: engine, layout, files
        zerolab_model.pt                            stages 0-2, rank 0: the 16-bit module state dict
        zerolab_rank_{r}_model.pt                   stage 3, every rank: its 16-bit parameter shard
        zerolab_rank_{r}_optim.pt                   every rank: its fp32 shard and optimizer moments

Not DeepSpeed's file names (``mp_rank_00_model_states.pt``,
``zero_pp_rank_{r}_mp_rank_00_optim_states.pt``): under those, DeepSpeed's own
``load_checkpoint`` went deep into files it cannot read (``KeyError:
'dp_world_size'``); now it stops at the first file it looks for. Checkpoints
written under the old names still load: a name the manifest does not list is
looked up under its old name (``legacy_name``). ``python -m zerolab convert
CKPT OUT --to deepspeed`` writes DeepSpeed's files.

Every ``.pt`` file is written through ``write_checked`` (sha256 and size taken
while writing, then fsync) and read back only through ``read_checked``, which
compares size and checksum with the manifest and loads with
``torch.load(weights_only=True, mmap=True)``: a truncated, corrupted or
missing file is a ``CheckpointError`` naming the file and what was expected;
nothing is ever unpickled with ``weights_only=False``. ``mmap=True`` means a
reader's resident memory holds only the pages it touches (resharding reads
one unit at a time; ``reshard.py``).
"""
from __future__ import annotations

import hashlib
import json
import os
import shutil

import torch

FORMAT, VERSION = "zerolab-checkpoint", 1
MANIFEST, LATEST = "manifest.json", "latest"
MODEL_STATES = "zerolab_model.pt"


class CheckpointError(RuntimeError):
    """A checkpoint cannot be written or read; the message names the file and the problem."""


def optim_file(rank: int) -> str:
    return f"zerolab_rank_{rank}_optim.pt"


def model_file(rank: int, stage: int) -> str:
    """Stage 3 keeps a model-states file per rank (its parameter shard), as DeepSpeed does."""
    return f"zerolab_rank_{rank}_model.pt" if stage == 3 else MODEL_STATES


def legacy_name(name: str) -> str:
    """The name zerolab gave file ``name`` before it stopped using DeepSpeed's names (read only)."""
    if name == MODEL_STATES:
        return "mp_rank_00_model_states.pt"
    parts = name.split("_")   # zerolab_rank_{r}_{model|optim}.pt
    if len(parts) == 4 and parts[:2] == ["zerolab", "rank"] and parts[3] in ("model.pt", "optim.pt"):
        return f"zero_pp_rank_{parts[2]}_mp_rank_00_{parts[3][:-3]}_states.pt"
    return name


class HashingWriter:
    """A binary file that hashes (sha256) and counts what is written through it."""

    def __init__(self, f):
        self.f, self.sha, self.size = f, hashlib.sha256(), 0

    def write(self, data) -> int:
        mv = memoryview(data).cast("B")
        n = self.f.write(mv)
        n = len(mv) if n is None else n
        self.sha.update(mv[:n])
        self.size += n
        return n

    def flush(self) -> None:
        self.f.flush()


def open_for_write(path: str):
    """The file a checkpoint part is written into (tests replace this to simulate a full disk)."""
    return open(path, "wb")


def write_checked(obj, path: str) -> dict:
    """``torch.save(obj)`` into ``path``, fsync'd; returns ``{"bytes": n, "sha256": hex}``."""
    with open_for_write(path) as f:
        w = HashingWriter(f)
        torch.save(obj, w)
        f.flush()
        os.fsync(f.fileno())
    return {"bytes": w.size, "sha256": w.sha.hexdigest()}


def fsync_dir(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _exchange(a: str, b: str) -> bool:
    """Swap two directories in one step (Linux ``renameat2(RENAME_EXCHANGE)``); False where unsupported."""
    try:
        import ctypes
        libc = ctypes.CDLL(None, use_errno=True)
        fn = libc.renameat2
    except (OSError, AttributeError):
        return False
    at_fdcwd, rename_exchange = -100, 2
    return fn(at_fdcwd, os.fsencode(a), at_fdcwd, os.fsencode(b), rename_exchange) == 0


def replace_dir(new: str, final: str) -> None:
    """Make the folder ``new`` the folder ``final``; an existing ``final`` is never missing meanwhile:
    the two are exchanged in one rename and the old contents removed after (where the kernel or file
    system cannot exchange, two renames leave a moment without ``final``)."""
    if not os.path.exists(final):
        os.rename(new, final)
    elif _exchange(new, final):
        shutil.rmtree(new, ignore_errors=True)   # now the old contents
    else:
        old = f"{new}.old"
        shutil.rmtree(old, ignore_errors=True)
        os.rename(final, old)
        os.rename(new, final)
        shutil.rmtree(old, ignore_errors=True)


def raise_agreed(error, what: str, here: str, failed: list, first_message: str, note: str = "") -> None:
    """After the ranks exchanged their errors (``failed``: the ranks that had one): nothing if none did;
    else this rank's own error (``here``: where it ran), or the first failing rank's ``first_message``."""
    if not failed:
        return
    if error is not None:
        if isinstance(error, CheckpointError):
            raise error
        raise CheckpointError(f"{what} failed on {here}: {error}") from error
    raise CheckpointError(f"{what} failed on rank {failed[0]} ({len(failed)} rank(s) failed{note}): {first_message}")


def save_paths(save_dir, tag, global_steps: int) -> tuple[str, str, str, str]:
    """``(save_dir, tag, final folder, temporary folder)`` of a save; ``tag`` None: ``global_step{N}``.
    A tag that is not a plain folder name is an error naming it."""
    tag = f"global_step{global_steps}" if tag is None else str(tag)
    if not tag or "/" in tag or tag.startswith(".") or tag == LATEST:
        raise ValueError(f"checkpoint tag {tag!r}: use a plain folder name (no '/', not starting with '.', "
                         f"not {LATEST!r})")
    save_dir = os.fspath(save_dir)
    return save_dir, tag, os.path.join(save_dir, tag), os.path.join(save_dir, f".{tag}.tmp")


def write_text_atomic(path: str, text: str) -> None:
    """Write ``text`` to ``path`` through a temporary file and a rename: old or new, never half."""
    tmp = f"{path}.tmp"
    with open(tmp, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    fsync_dir(os.path.dirname(os.path.abspath(path)))


def sha256_of(path: str, block: int = 1 << 20) -> str:
    """The file's sha256, read through one reused 1 MiB buffer."""
    sha, buf = hashlib.sha256(), bytearray(block)
    view = memoryview(buf)
    with open(path, "rb", buffering=0) as f:
        while n := f.readinto(buf):
            sha.update(view[:n])
    return sha.hexdigest()


def read_manifest(tag_dir: str) -> dict:
    path = os.path.join(tag_dir, MANIFEST)
    if not os.path.exists(path):
        if any(n.endswith("_optim_states.pt") or n.endswith("_model_states.pt") for n in os.listdir(tag_dir)):
            raise CheckpointError(f"{tag_dir!r} holds files named as DeepSpeed's but not a set engine.load_checkpoint "
                                  f"can resume from (it resumes DeepSpeed's stage 1-3 folders whose model states "
                                  f"it can read); `python -m zerolab consolidate` reads their fp32 weights")
        raise CheckpointError(f"{path}: missing; {tag_dir!r} is not a complete zerolab checkpoint (a save "
                              f"that did not finish leaves no manifest)")
    try:
        with open(path) as f:
            m = json.load(f)
    except (OSError, ValueError) as e:
        raise CheckpointError(f"{path}: cannot be read as JSON ({e})") from None
    if not isinstance(m, dict) or m.get("format") != FORMAT:
        raise CheckpointError(f"{path}: format {m.get('format') if isinstance(m, dict) else None!r}, "
                              f"expected {FORMAT!r}")
    if m.get("version") != VERSION:
        raise CheckpointError(f"{path}: version {m.get('version')!r}; this zerolab reads version {VERSION}")
    return m


def read_checked(tag_dir: str, name: str, manifest: dict, verify: bool = True) -> dict:
    """Load one part of the checkpoint after checking it against the manifest."""
    if name not in manifest["files"] and legacy_name(name) in manifest["files"]:
        name = legacy_name(name)   # written before zerolab stopped using DeepSpeed's file names
    path = os.path.join(tag_dir, name)
    entry = manifest["files"].get(name)
    if entry is None:
        raise CheckpointError(f"{path}: not listed in {MANIFEST} (files: {sorted(manifest['files'])})")
    if not os.path.exists(path):
        raise CheckpointError(f"{path}: missing (the manifest lists it, {entry['bytes']} bytes); the "
                              f"checkpoint is incomplete")
    size = os.path.getsize(path)
    if size != entry["bytes"]:
        raise CheckpointError(f"{path}: {size} bytes, expected {entry['bytes']} (manifest): the file is "
                              f"truncated or was replaced")
    if verify:
        found = sha256_of(path)
        if found != entry["sha256"]:
            raise CheckpointError(f"{path}: sha256 {found[:16]}..., expected {entry['sha256'][:16]}... "
                                  f"(manifest): the file is corrupted")
    try:
        return torch.load(path, map_location="cpu", weights_only=True, mmap=True)
    except Exception as e:  # noqa: BLE001 - any unpickling failure becomes one clear error
        raise CheckpointError(f"{path}: cannot be loaded ({type(e).__name__}: {str(e)[:200]})") from None


def resolve_tag(load_dir: str, tag: str | None) -> str | None:
    """The tag to load: ``tag``, or what ``latest`` names; None when the directory has no checkpoint."""
    if tag is not None:
        return str(tag)
    latest = os.path.join(load_dir, LATEST)
    if not os.path.exists(latest):
        return None
    with open(latest) as f:
        text = f.read().strip()
    if not text:
        raise CheckpointError(f"{latest}: empty; it should name the newest complete tag")
    return text


def check_tag_dir(load_dir: str, tag: str) -> str:
    tag_dir = os.path.join(load_dir, tag)
    if not os.path.isdir(tag_dir):
        partial = [d for d in os.listdir(load_dir) if d.startswith(f".{tag}.tmp")] if os.path.isdir(load_dir) else []
        why = (f"; {partial[0]!r} is a save of that tag that did not finish (ignored)" if partial else "")
        tags = sorted(d for d in os.listdir(load_dir) if os.path.isdir(os.path.join(load_dir, d))
                      and not d.startswith(".")) if os.path.isdir(load_dir) else []
        raise CheckpointError(f"{tag_dir}: no checkpoint with tag {tag!r} (tags here: {tags}){why}")
    return tag_dir


def describe_manifest(manifest: dict) -> str:
    e = manifest["engine"]
    return (f"stage {e['stage']}, {e['world_size']} ranks, precision {e['precision']}, "
            f"{manifest['layout']['numel']:,} trainable parameters, step {e['global_steps']}")


def dumps(manifest: dict) -> str:
    return json.dumps(manifest, indent=1) + "\n"
