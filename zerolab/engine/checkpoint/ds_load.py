"""DeepSpeed's ZeRO-1/2/3 checkpoint read as a zerolab one: what ``engine.load_checkpoint`` resumes from (chapter 8).

``DeepSpeedSaved(tag_dir)`` is a ``SavedCheckpoint`` whose manifest and files
are computed from DeepSpeed's files instead of read from zerolab's, so the
loader and its resharding (``reshard.py``) run unchanged, at any world size
and stage. The translation is a *layout*: zerolab describes a checkpoint as
units, each a flat buffer cut into equal slices, one per saved rank.

* Stages 1-2: a parameter group is one unit. DeepSpeed flattens the group's
  parameters end to end (plus alignment paddings), pads the buffer to a
  multiple of 2N and gives rank r the slice ``[r*S, (r+1)*S)``: exactly a
  zerolab unit (the last rank's saved slice lacks its padding; it is padded back).
* Stage 3: *every parameter* is cut into N pieces of ceil(numel / N), so each
  parameter is one unit of N*ceil(numel / N) elements; rank r's flat
  partition is its pieces end to end (``shard_offset`` says where each starts).

The fp32 values come from the fp32 partitions, the Adam moments and the step
from the torch optimizer state inside each rank's file, the counters and the
scheduler's step from the model-state file (``lr_scheduler.last_batch_iteration``
+ 1 is zerolab's schedule position), frozen weights and buffers from the module
(stage 3: the frozen fragments). Not carried: the fp16 loss scale (zerolab keeps
its own), DeepSpeed's data sampler and random-LTD state.
"""
from __future__ import annotations

import math
from pathlib import Path

import torch

from zerolab.engine.checkpoint.ds_files import checkpoint_files, load_restricted, natural_key
from zerolab.engine.checkpoint.files import FORMAT, VERSION, CheckpointError, model_file, optim_file
from zerolab.engine.checkpoint.reshard import SavedCheckpoint

# what DeepSpeed itself keeps in a model-state file; anything else there is the caller's client_state
DS_MODEL_KEYS = {"module", "buffer_names", "optimizer", "param_shapes", "frozen_param_shapes", "shared_params",
                 "frozen_param_fragments", "lr_scheduler", "data_sampler", "random_ltd", "sparse_tensor_module_names",
                 "skipped_steps", "global_steps", "global_samples", "dp_world_size", "mp_world_size", "ds_config",
                 "ds_version", "checkpoint_parallel_dimensions", "num_experts"}


def _moments(osd: dict, stage: int) -> tuple[list, int]:
    """(per fp32 partition {exp_avg, exp_avg_sq} flat tensors, the optimizer step) of one rank's optimizer
    state. A partition is a parameter group at stages 1-2 and a *sub-group* at stage 3 (DeepSpeed cuts a
    group into sub-groups of ``sub_group_size`` elements per rank, 1e9 by default): each is one entry of
    the torch optimizer's ``state``, listed in ``param_groups[g]["params"]``, in partition order."""
    base = osd.get("base_optimizer_state") if stage <= 2 else osd.get("optimizer_state_dict")
    if isinstance(base, dict):          # torch's optimizer.state_dict(): {"state": {i: {...}}, "param_groups"}
        groups = [base["state"].get(i, {}) for g in base["param_groups"] for i in g["params"]]
    elif isinstance(base, list):        # DeepSpeed's elastic form: one state dict per group
        groups = base
    else:
        raise CheckpointError(f"no optimizer state in the ZeRO file (base_optimizer_state is {type(base).__name__})")
    step = osd.get("base_optimizer_state_step")
    for g in groups:
        if "step" in g:
            step = g["step"]
    step = 0 if step is None else int(step.item() if torch.is_tensor(step) else step)
    return groups, step


class DeepSpeedSaved(SavedCheckpoint):
    """One tag of a DeepSpeed ZeRO checkpoint, seen through zerolab's manifest and per-rank state files."""

    def __init__(self, tag_dir, verify: bool = True):
        tag_dir = Path(tag_dir)
        models, optims = checkpoint_files(tag_dir)
        if not models or not optims:
            raise CheckpointError(f"{tag_dir}: not a DeepSpeed ZeRO checkpoint (no *_model_states.pt and "
                                  f"*_optim_states.pt files)")
        self.optim_paths = sorted(optims, key=natural_key)
        self.model_sd = load_restricted(models[0])
        first = load_restricted(self.optim_paths[0])["optimizer_state_dict"]
        stage = int(first["zero_stage"])
        world = first["partition_count"]
        world = max(world) if isinstance(world, list) else int(world)
        if world != len(self.optim_paths):
            raise CheckpointError(f"{tag_dir}: saved by {world} ranks but {len(self.optim_paths)} optimizer files "
                                  f"are there")
        self.ds_stage, self.ds_config = stage, self.model_sd.get("ds_config") or {}
        self.frozen_fragments = [load_restricted(m).get("frozen_param_fragments") or {} for m in models] \
            if stage == 3 else []
        groups, step = _moments(first, stage)
        inner = first.get("base_optimizer_state" if stage <= 2 else "optimizer_state_dict")
        self.param_group = dict(inner["param_groups"][0]) if isinstance(inner, dict) else {}
        keys = ["fp32"] + [k for k in ("exp_avg", "exp_avg_sq") if k in groups[0]]
        self.group_sizes = [t.numel() for t in first["single_partition_of_fp32_groups" if stage <= 2
                                                     else "fp32_flat_groups"]]
        if len(groups) != len(self.group_sizes):
            raise CheckpointError(f"{self.optim_paths[0]}: {len(self.group_sizes)} fp32 partitions (parameter "
                                  f"groups or stage-3 sub-groups) but {len(groups)} optimizer state entries")
        super().__init__(str(tag_dir), {"format": FORMAT, "version": VERSION, "tag": tag_dir.name,
                                        "engine": self._engine(stage, world, step), "layout": self._layout(
                                            first, stage, world), "state_keys": keys, "files": {}}, verify)

    # ---------------------------------------------------------------- the manifest, computed
    def _layout(self, osd: dict, stage: int, world: int) -> dict:
        sd = self.model_sd
        shapes = sd["param_shapes"]
        units, shard_offset = [], 0
        if stage <= 2:
            pads = osd.get("param_alignment_paddings") or [[0] * len(g) for g in shapes]
            for g, (group, size) in enumerate(zip(shapes, self.group_sizes)):
                params, off = [], 0
                for (name, shape), pad in zip(group.items(), pads[g]):
                    params.append([name, list(shape), off])
                    off += math.prod(shape) + pad
                units.append({"name": f"group{g}", "numel": off, "padded": size * world, "shard": size,
                              "shard_offset": shard_offset, "params": params})
                shard_offset += size
        else:
            for group in shapes:
                for name, shape in group.items():
                    piece = -(-math.prod(shape) // world)
                    units.append({"name": name, "numel": math.prod(shape), "padded": piece * world, "shard": piece,
                                  "shard_offset": shard_offset, "params": [[name, list(shape), 0]]})
                    shard_offset += piece
            if shard_offset != sum(self.group_sizes):
                raise CheckpointError(f"{self.optim_paths[0]}: the parameter shapes account for {shard_offset} "
                                      f"elements per rank, the fp32 partition holds {sum(self.group_sizes)}")
        module, buffers = sd["module"], list(sd.get("buffer_names") or [])
        aliases = dict(sd.get("shared_params") or {})
        trainable = {n for u in units for n, _, _ in u["params"]}
        frozen = [k for k in module if k not in trainable and k not in buffers and k not in aliases]
        return {"world_size": world, "numel": sum(u["numel"] for u in units),
                "padded": sum(u["padded"] for u in units), "units": units, "keys": list(module),
                "aliases": aliases, "frozen": frozen, "buffers": buffers}

    def _engine(self, stage: int, world: int, step: int) -> dict:
        sd, cfg = self.model_sd, self.model_sd.get("ds_config") or {}
        enabled = lambda k: bool((cfg.get(k) or {}).get("enabled"))   # noqa: E731
        precision = "mixed" if enabled("bf16") or enabled("fp16") or any("bf16_" in p.name for p in self.optim_paths[:1]) \
            else "fp32"
        gas = int(cfg.get("gradient_accumulation_steps") or 1)
        sched = sd.get("lr_scheduler")
        position = None
        if isinstance(sched, dict) and "last_batch_iteration" in sched:
            position = int(sched["last_batch_iteration"]) + 1
        pg = self.param_group
        opt = (cfg.get("optimizer") or {}).get("type") or ("AdamW" if pg.get("decoupled_weight_decay", True)
                                                           else "Adam")
        opt = opt.lower()
        hyper = {"lr": float(pg["lr"]), "weight_decay": float(pg.get("weight_decay", 0.0)),
                 "betas": [float(b) for b in pg.get("betas", (0.9, 0.999))], "eps": float(pg.get("eps", 1e-8)),
            "sub_group_size": int((cfg.get("zero_optimization") or {}).get("sub_group_size") or 10**9)} \
            if "lr" in pg else None   # torch's param_groups: the next step's lr; what ds_save writes back
        return {"stage": stage, "world_size": world, "precision": precision,
                "compute_dtype": "bfloat16" if enabled("bf16") else "float16" if enabled("fp16") else "float32",
                "gradient_accumulation_steps": gas, "global_steps": int(sd["global_steps"]),
                "micro_steps": int(sd["global_steps"]) * gas, "skipped_steps": int(sd.get("skipped_steps") or 0),
                "optimizer": {"type": opt, "step_count": step, "skipped": {}, "hyper": hyper},
                "scheduler": None if position is None else {"type": "deepspeed", "position": position},
                "loss_scaler": None, "source": "deepspeed", "ds_version": sd.get("ds_version")}

    # ---------------------------------------------------------------- the files, computed
    def file(self, name: str) -> dict:
        if name not in self._files:
            self._files[name] = self._make(name)
        return self._files[name]

    def _make(self, name: str) -> dict:
        head = {"format": FORMAT, "version": VERSION, "world_size": self.world_size}
        buffers = {k: v for k, v in self.model_sd["module"].items() if k in self.layout["buffers"]}
        for r in range(self.world_size):
            if name == optim_file(r):
                return {**head, "rank": r, "state": self._state(r), "buffers": buffers}
        if name == model_file(0, self.engine["stage"]):
            module = {k: v for k, v in self.model_sd["module"].items() if k in self.layout["frozen"]}
            if self.ds_stage == 3:   # stage 3 keeps frozen weights as per-rank fragments
                for k in self.layout["frozen"]:
                    shape = self.model_sd["frozen_param_shapes"][k]
                    whole = torch.cat([f[k].reshape(-1) for f in self.frozen_fragments])
                    module[k] = whole[:math.prod(shape)].view(shape).clone()
            client = {k: v for k, v in self.model_sd.items() if k not in DS_MODEL_KEYS}
            return {**head, "rank": 0, "module": module, "client_state": client, "engine": self.engine}
        raise CheckpointError(f"{self.dir}: no file {name!r} in a DeepSpeed checkpoint read as zerolab's")

    def _state(self, r: int) -> dict:
        """Rank r's fp32 partition and moments, each group padded back to its slice length, end to end."""
        path = self.optim_paths[r]
        osd = load_restricted(path)["optimizer_state_dict"]
        fp32 = osd["single_partition_of_fp32_groups" if self.ds_stage <= 2 else "fp32_flat_groups"]
        groups, _ = _moments(osd, self.ds_stage)
        out = {}
        for key in self.manifest["state_keys"]:
            parts = []
            for g, size in enumerate(self.group_sizes):
                t = (fp32[g] if key == "fp32" else groups[g][key]).reshape(-1).float()
                if t.numel() > size:
                    raise CheckpointError(f"{path}: group {g}'s {key} holds {t.numel()} elements, its partition "
                                          f"{size}: files from different checkpoints?")
                parts.append(torch.cat([t, t.new_zeros(size - t.numel())]) if t.numel() < size else t)
            out[key] = torch.cat(parts) if len(parts) > 1 else parts[0].clone()
        return out

