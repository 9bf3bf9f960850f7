"""A mesh checkpoint seen as one plain checkpoint of *this* rank's parameters (chapter 10; mesh.py).

``MeshSource`` answers what the plain loader (``load.py``'s ``_load_state``,
``reshard.fill_owned``) asks a ``SavedCheckpoint``: ``index`` (this rank's
parameters, with the shapes this rank holds), ``copy_range`` (elements of one
parameter's state key), ``engine`` (the counters, the optimizer's step and
schedule position), ``model_states()`` (the client state) and the buffers. A
parameter's elements come from the saved folders of its PP stage: each saved
TP piece read memory-mapped (``SavedCheckpoint.param``), joined along the
saved TP dimension, then cut for this rank's TP coordinate — one parameter's
full tensor at a time. ``read_mesh_manifest`` reads ``mesh.json``, or a plain
checkpoint's manifest as a mesh of one folder (tp = pp = 1), so a plain
checkpoint loads into a mesh too.
"""
from __future__ import annotations

import json
import math
import os

from zerolab.engine.checkpoint import mesh_state as ms
from zerolab.engine.checkpoint.files import CheckpointError, optim_file
from zerolab.engine.checkpoint.reshard import SavedCheckpoint


def read_mesh_manifest(tag_dir: str, name: str, fmt: str, version: int, read_plain) -> dict:
    """``mesh.json`` (checked: format, version), or the plain manifest as a one-folder mesh."""
    path = os.path.join(tag_dir, name)
    if not os.path.exists(path):
        plain = read_plain(tag_dir)
        params = {n: {"shape": list(shape), "tp_split": None, "pp_stage": 0}
                  for u in plain["layout"]["units"] for n, shape, _ in u["params"]}
        aliases = {a: n for a, n in plain["layout"].get("aliases", {}).items() if n in params}
        return {"mesh": {"dp": plain["engine"]["world_size"], "tp": 1, "pp": 1}, "params": params, "aliases": aliases,
                "folders": {"": {"tp": 0, "pp": 0, "tag": ""}}, "mesh_file": False}
    try:
        with open(path) as f:
            m = json.load(f)
    except (OSError, ValueError) as e:
        raise CheckpointError(f"{path}: cannot be read as JSON ({e})") from None
    if not isinstance(m, dict) or m.get("format") != fmt or m.get("version") != version:
        raise CheckpointError(f"{path}: format {m.get('format') if isinstance(m, dict) else None!r} version "
                              f"{m.get('version') if isinstance(m, dict) else None!r}, expected {fmt!r} {version}")
    return {**m, "mesh_file": True}


class MeshSource:
    """The saved state of this rank's parameters, re-sliced for its TP coordinate (module docstring)."""

    def __init__(self, tag_dir: str, manifest: dict, engine, description: dict):
        self.dir, self.mesh_manifest = tag_dir, manifest
        self.tp, self.tp_rank = description["tp"], description["tp_rank"]
        self.mine = description["params"]   # name -> [local shape, split | None]
        self.index = {n: (n, 0, math.prod(shape), tuple(shape)) for n, (shape, _) in self.mine.items()}
        self.world_size = -1   # never "the same world": buffers come from the saved rank 0s
        self._where = {(f["tp"], f["pp"]): (os.path.join(tag_dir, name, f["tag"]) if name else tag_dir)
                       for name, f in manifest["folders"].items()}
        self._subs, self._cache = {}, (None, {})
        canon = {n: n if n in manifest["params"] else manifest.get("aliases", {}).get(n, n) for n in self.mine}
        stages = sorted({manifest["params"][c]["pp_stage"] for c in canon.values()}) or [0]
        first = self.sub(0, stages[0])
        self.manifest, self.layout = first.manifest, {"frozen": []}
        self.engine = json.loads(json.dumps(first.engine))   # a copy: the skipped counts merged below
        # the counters as saved: the loader counts the micro-steps in this engine's window (load.py)
        skipped = self.engine["optimizer"].setdefault("skipped", {})
        for p in stages:
            skipped.update(self.sub(0, p).engine["optimizer"].get("skipped", {}))
        frozen = [n for p in stages for n in self.sub(0, p).layout["frozen"]]
        if frozen or engine.flat.frozen or getattr(engine, "frozen_flat", None):
            raise CheckpointError(f"{tag_dir}: frozen parameters ({frozen[:3] or 'in the model'}) are not carried "
                                  f"by a mesh checkpoint yet")
        self._has_buffers = any(True for _ in engine.module.named_buffers())

    def sub(self, t: int, p: int) -> SavedCheckpoint:
        """The plain checkpoint saved by coordinate (tp ``t``, pp ``p``), opened on first use."""
        if (t, p) not in self._subs:
            from zerolab.engine.checkpoint.files import read_manifest
            if (t, p) not in self._where:
                raise CheckpointError(f"{self.dir}: no folder for tp {t}, pp {p} (folders: {sorted(self._where)})")
            where = self._where[(t, p)]
            self._subs[(t, p)] = SavedCheckpoint(where, read_manifest(where))
        return self._subs[(t, p)]

    @property
    def bytes_read(self) -> int:
        return sum(s.bytes_read for s in self._subs.values())

    def _full(self, name: str, key: str):
        if name not in self.mesh_manifest["params"]:   # tied: saved under the parameter's other name
            name = self.mesh_manifest.get("aliases", {})[name]
        info = self.mesh_manifest["params"][name]
        p, split = info["pp_stage"], info["tp_split"]
        pieces = []
        for t in range(self.mesh_manifest["mesh"]["tp"] if split else 1):
            sub = self.sub(t, p)
            pieces.append(sub.param(name, key).view(sub.index[name][3]))
        return ms.unshard(pieces, *split) if split else pieces[0]

    def local(self, name: str, key: str):
        """This rank's piece of parameter ``name``'s state ``key``, flat (cached: one parameter at a time)."""
        if self._cache[0] != name:
            self._cache = (name, {})
        values = self._cache[1]
        if key not in values:
            full, split = self._full(name, key), self.mine[name][1]
            values[key] = (ms.shard(full, split[0], split[1], self.tp, self.tp_rank) if split else full).reshape(-1)
        return values[key]

    def copy_range(self, key: str, unit, start: int, end: int, out) -> None:
        out.copy_(self.local(unit, key)[start:end])

    def model_states(self) -> dict:
        return self.sub(0, 0).model_states()

    def file(self, name: str) -> dict:
        """Only the buffers are asked for (``_load_module_extras``): every saved stage's rank 0's, merged."""
        buffers = {}
        if self._has_buffers:
            for (t, p), sub in sorted(((k, self.sub(*k)) for k in self._where)):
                for k, v in sub.file(optim_file(0)).get("buffers", {}).items():
                    buffers.setdefault(k, v)
        return {"buffers": buffers}

    def close(self) -> None:
        for s in self._subs.values():
            s.close()
