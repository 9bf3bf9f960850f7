"""DeepSpeed's *universal* checkpoint read as a zerolab one (``ds_to_universal.py``'s layout; chapter 8).

DeepSpeed's ``ds_to_universal.py`` rewrites a ZeRO checkpoint parameter by parameter, whole, so that any
world size can load it::

    <dir>/latest_universal                 names the tag
    <dir>/<tag>/zero/<name>/fp32.pt        {"param": the whole fp32 tensor, ...} (or a bare tensor)
    <dir>/<tag>/zero/<name>/exp_avg.pt     the Adam moments (trainable parameters only), step.pt Adam's step
    <dir>/<tag>/zero/optimizer_state.pt    param_groups (lr, betas, ...), the loss scaler
    <dir>/<tag>/*_model_states.pt          counters, scheduler, buffers, tied names (as in the ZeRO checkpoint)

``DeepSpeedUniversal`` describes it as a zerolab checkpoint saved by *one* rank with one unit per
parameter, so the loader reshards it to any world size and stage like any other.
"""
from __future__ import annotations

import math
import os
from pathlib import Path

import torch

from zerolab.engine.checkpoint.ds_files import is_deepspeed_checkpoint, load_restricted, natural_key
from zerolab.engine.checkpoint.ds_load import DS_MODEL_KEYS, DeepSpeedSaved
from zerolab.engine.checkpoint.files import CheckpointError, model_file, optim_file

LATEST_UNIVERSAL = "latest_universal"


def universal_tag(load_dir, tag=None) -> str | None:
    """The tag in ``latest_universal`` (when there is no ``latest``)."""
    path = os.path.join(os.fspath(load_dir), LATEST_UNIVERSAL)
    if tag is not None or not os.path.isfile(path):
        return tag
    with open(path) as f:
        return f.read().strip() or None


def _saved_step(opt: dict) -> int:
    """Adam's step where a stage-3 universal checkpoint keeps it (no step.pt): optimizer_state.pt's torch state."""
    inner = opt.get("optimizer_state_dict") or opt.get("base_optimizer_state")
    for st in (inner.get("state", {}).values() if isinstance(inner, dict) else []):
        if "step" in st:
            return int(st["step"].item() if torch.is_tensor(st["step"]) else st["step"])
    raise CheckpointError("universal checkpoint: Adam's step is neither in zero/<param>/step.pt nor in "
                          "zero/optimizer_state.pt")


def is_universal(tag_dir) -> bool:
    zero = Path(tag_dir) / "zero"
    return zero.is_dir() and any(zero.glob("*/fp32.pt"))


def _tensor(path: Path) -> torch.Tensor:
    obj = load_restricted(path)
    t = obj.get("param") if isinstance(obj, dict) else obj
    if not torch.is_tensor(t):
        raise CheckpointError(f"{path}: no tensor (found {type(obj).__name__})")
    return t


def _step(path: Path) -> int:
    """step.pt: a tensor (torch's Adam) or a plain int (DeepSpeed's FusedAdam, its default optimizer)."""
    obj = load_restricted(path)
    obj = obj.get("param") if isinstance(obj, dict) else obj
    if isinstance(obj, int) and not isinstance(obj, bool):
        return obj
    return int(_tensor(path).item())


class DeepSpeedUniversal(DeepSpeedSaved):
    """A universal checkpoint's tag folder, seen through zerolab's manifest and one saved rank's files."""

    def __init__(self, tag_dir, verify: bool = True):   # noqa: D107 - SavedCheckpoint's attributes, computed
        tag_dir = Path(tag_dir)
        models = sorted(tag_dir.glob("*_model_states.pt"))
        if not models:
            raise CheckpointError(f"{tag_dir}: a universal checkpoint without a *_model_states.pt file")
        self.zero, self.model_sd = tag_dir / "zero", load_restricted(models[0])
        self.optim_paths, self.frozen_fragments = [], []
        opt = load_restricted(self.zero / "optimizer_state.pt") if (self.zero / "optimizer_state.pt").exists() else {}
        self.param_group = dict((opt.get("param_groups") or [{}])[0])
        self.ds_config = self.model_sd.get("ds_config") or {}
        self.ds_stage = 1
        names = [n for g in self.model_sd["param_shapes"] for n in g]
        missing = [n for n in names if not (self.zero / n / "fp32.pt").exists()]
        if missing:
            raise CheckpointError(f"{self.zero}: no fp32.pt for {missing[:3]} ({len(missing)} parameters)")
        keys = ["fp32"] + [k for k in ("exp_avg", "exp_avg_sq") if (self.zero / names[0] / f"{k}.pt").exists()]
        step_file = self.zero / names[0] / "step.pt"
        step = _step(step_file) if step_file.exists() else _saved_step(opt)
        units, off = [], 0
        for g in self.model_sd["param_shapes"]:
            for name, shape in g.items():
                n = math.prod(shape)
                units.append({"name": name, "numel": n, "padded": n, "shard": n, "shard_offset": off,
                              "params": [[name, list(shape), 0]]})
                off += n
        self.names, self.group_sizes = names, [off]
        module, buffers = self.model_sd["module"], list(self.model_sd.get("buffer_names") or [])
        aliases = dict(self.model_sd.get("shared_params") or {})
        frozen = [k for k in module if k not in names and k not in buffers and k not in aliases]
        layout = {"world_size": 1, "numel": off, "padded": off, "units": units, "keys": list(module),
                  "aliases": aliases, "frozen": frozen, "buffers": buffers}
        engine = self._engine(1, 1, step)
        engine["source"] = "deepspeed-universal"
        super(DeepSpeedSaved, self).__init__(str(tag_dir), {"format": "zerolab-checkpoint", "version": 1,
                                                            "tag": tag_dir.name, "engine": engine, "layout": layout,
                                                            "state_keys": keys, "files": {}}, verify)

    def _make(self, name: str) -> dict:
        head = {"format": "zerolab-checkpoint", "version": 1, "world_size": 1}
        module = self.model_sd["module"]
        if name == optim_file(0):
            state = {k: torch.cat([_tensor(self.zero / n / f"{k}.pt").reshape(-1).float() for n in self.names])
                     for k in self.manifest["state_keys"]}
            return {**head, "rank": 0, "state": state,
                    "buffers": {k: v for k, v in module.items() if k in self.layout["buffers"]}}
        if name == model_file(0, self.engine["stage"]):
            frozen = {k: self._frozen(k) for k in self.layout["frozen"]}
            client = {k: v for k, v in self.model_sd.items() if k not in DS_MODEL_KEYS}
            return {**head, "rank": 0, "module": frozen, "client_state": client, "engine": self.engine}
        raise CheckpointError(f"{self.dir}: no file {name!r} in a universal checkpoint read as zerolab's")

    def _frozen(self, name: str) -> torch.Tensor:
        """A frozen weight: its zero/<name>/fp32.pt, or (stage 3 writes none) the ranks' fragments in the
        copied model-state files, or (stages 1-2) the module."""
        if (self.zero / name / "fp32.pt").exists():
            return _tensor(self.zero / name / "fp32.pt")
        shape = (self.model_sd.get("frozen_param_shapes") or {}).get(name)
        if shape is None:
            return self.model_sd["module"][name]
        files = sorted(Path(self.dir).glob("zero_pp_rank_*_model_states.pt"), key=natural_key)
        pieces = [load_restricted(f)["frozen_param_fragments"][name].reshape(-1) for f in files]
        return torch.cat(pieces)[: math.prod(shape)].view(shape)


def open_deepspeed(tag_dir) -> DeepSpeedSaved | None:
    """The tag folder read as zerolab's when DeepSpeed wrote it (a ZeRO or a universal checkpoint, no
    manifest), else None (``load.py`` then reads zerolab's manifest)."""
    if (Path(tag_dir) / "manifest.json").exists():
        return None
    if is_universal(tag_dir):
        return DeepSpeedUniversal(tag_dir)
    return DeepSpeedSaved(tag_dir) if is_deepspeed_checkpoint(tag_dir) else None
