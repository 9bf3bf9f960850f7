"""A zerolab checkpoint written as DeepSpeed's ZeRO-1/2/3 files, which DeepSpeed 0.19's ``load_checkpoint`` resumes from (chapter 8).

``deepspeed_parts(saved, rank, ...)`` yields the files DeepSpeed rank ``rank``
would have written, built from a zerolab checkpoint (``SavedCheckpoint``) by
the resharding arithmetic: each rank's slice of DeepSpeed's flat layout is
read, parameter by parameter, with ``saved.param(name, key, lo, hi)``, so no
rank holds more than its own partition. DeepSpeed's layout for one parameter
group (the model's trainable parameters in ``named_parameters`` order):

* stages 1-2: the parameters end to end, padded to a multiple of 2N; rank r
  keeps ``[r*S, (r+1)*S)`` (S = padded / N). Its fp32 slice is saved without
  the group's end padding (``group_paddings``), the Adam moments with it.
* stage 3: each parameter cut into N pieces of ceil(numel / N); rank r keeps
  its piece of every parameter, end to end, cut into *sub-groups* as DeepSpeed
  cuts them: parameters are added to a sub-group until its pieces reach
  ``sub_group_size`` elements (DeepSpeed's default 1e9; the engine's config
  value, or ``convert --sub-group-size``): one ``fp32_flat_groups`` entry, one
  optimizer state entry and one ``param_shapes`` dict per sub-group.

The Adam state is the ``optimizer.state_dict()`` of the flat fp32 partitions
(``step``, ``exp_avg``, ``exp_avg_sq``; ``param_groups`` with the
hyper-parameters and the learning rate of the next step, which DeepSpeed's
loader installs over its own optimizer's group — so the group carries the keys
of *every* optimizer DeepSpeed may build for Adam/AdamW: its FusedAdam's
``bias_correction`` (its default, read by its step) and torch's own keys; the
step is a plain int, which FusedAdam's kernel takes and torch's loader turns
into its tensor); the scheduler's step becomes ``lr_scheduler.last_batch_iteration``
(position - 1). What is not written: an fp16 loss scale (fp16 is refused),
several parameter groups, pipeline/tensor-parallel ranks.
``engine.save_checkpoint(..., format="deepspeed")`` (``ds_engine.py``) is a zerolab save
into a hidden folder, then each rank's DeepSpeed files from it.
"""
from __future__ import annotations

import math
import os
import sys
import types
from collections import OrderedDict
from contextlib import contextmanager

import torch

from zerolab.engine.checkpoint.files import CheckpointError, optim_file, write_checked

DS_VERSION = "0.19.8"        # the DeepSpeed whose layout these files follow (its loader checks the version)
LOSS_SCALER = "deepspeed.runtime.fp16.loss_scaler.LossScaler"
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def optimizer_record(engine) -> dict:
    """What DeepSpeed's torch optimizer keeps in ``param_groups``: the config's hyper-parameters and the lr
    of the next step (the schedule's, where there is one). Saved in zerolab's manifest for the converter."""
    opt = engine.optimizer
    h = getattr(opt, "math", opt)
    lr = engine.get_lr() if engine.scheduler is not None else h.lr
    rec = {"lr": float(lr), "weight_decay": float(h.weight_decay),
           "sub_group_size": int(engine.config.zero.sub_group_size)}
    if opt.kind in ("adam", "adamw"):
        rec.update(betas=list(h.betas), eps=float(h.eps))
    if len(getattr(h, "hypers", [None])) > 1:
        rec["groups"] = len(h.hypers)
    return rec


# DeepSpeed's FusedAdam (what its "Adam"/"AdamW" config builds): the keys its step reads from the group
# besides lr, betas, eps and weight_decay ("step": the group's, which it sets to 0 and never advances)
FUSED_ADAM_KEYS = {"bias_correction": True, "step": 0}
# torch.optim.Adam/AdamW (a client optimizer, or "torch_adam": true): the rest of the keys its step reads
TORCH_ADAM_KEYS = {"amsgrad": False, "maximize": False, "foreach": None, "capturable": False,
                   "differentiable": False, "fused": None}


def ds_param_group(kind: str, hyper: dict, n_params: int = 1) -> dict:
    """The param_groups entry DeepSpeed's loader installs over its own optimizer's: every key FusedAdam's
    step reads and every key torch's Adam/AdamW's step reads, whichever of them DeepSpeed built."""
    if kind not in ("adam", "adamw"):
        raise CheckpointError(f"writing DeepSpeed's files: optimizer {kind!r}; only Adam and AdamW are supported")
    if hyper.get("groups", 1) > 1:
        raise CheckpointError(f"writing DeepSpeed's files: {hyper['groups']} parameter groups; only one is supported")
    return {"lr": hyper["lr"], "betas": tuple(hyper["betas"]), "eps": hyper["eps"],
            "weight_decay": hyper["weight_decay"], **FUSED_ADAM_KEYS, **TORCH_ADAM_KEYS,
            "decoupled_weight_decay": kind == "adamw", "params": list(range(n_params))}


def sub_groups(piece_numels: list, sub_group_size: int) -> list:
    """DeepSpeed's stage-3 sub-groups: [(first, last + 1)] parameter ranges, a parameter added to the open
    sub-group until its pieces (per rank) reach ``sub_group_size`` elements; one group if all fit."""
    if sub_group_size >= sum(piece_numels):
        return [(0, len(piece_numels))]
    out, start, size = [], 0, 0
    for i, n in enumerate(piece_numels):
        size += n
        if size >= sub_group_size or i == len(piece_numels) - 1:
            out.append((start, i + 1))
            start, size = i + 1, 0
    return out


class DeepSpeedLayout:
    """Where DeepSpeed rank r's partition lies in each trainable parameter, for N ranks at ``stage``."""

    def __init__(self, saved, stage: int, world: int, sub_group_size: int = 10**9):
        lay = saved.layout
        self.saved, self.stage, self.world = saved, stage, world
        self.names = [k for k in lay["keys"] if k in saved.index and k not in lay["aliases"]]
        self.numels = [saved.index[n][2] for n in self.names]
        self.pieces = [-(-n // world) for n in self.numels]   # stage 3: each rank's piece of each parameter
        self.sub_group_size = sub_group_size
        self.groups = sub_groups(self.pieces, sub_group_size) if stage == 3 else [(0, len(self.names))]
        total = sum(self.numels)
        align = 2 * world
        self.padded = -(-total // align) * align
        self.size = self.padded // world               # stages 1-2: each rank's slice
        self.pad = self.padded - total                 # at the end of the last rank's slice
        if stage <= 2 and self.pad > self.size:
            raise CheckpointError(f"{total} parameters over {world} ranks: the padding ({self.pad}) is longer "
                                  f"than one rank's slice ({self.size}); DeepSpeed would not write this layout")

    def slice(self, key: str, r: int) -> torch.Tensor:
        """Rank r's fp32 partition of state ``key`` (padding zero)."""
        if self.stage == 3:
            parts = []
            for name, n in zip(self.names, self.numels):
                piece = -(-n // self.world)
                t = torch.zeros(piece)
                lo, hi = min(n, r * piece), min(n, (r + 1) * piece)
                if lo < hi:
                    t[: hi - lo] = self.saved.param(name, key, lo, hi)
                parts.append(t)
            return torch.cat(parts)
        out, a, b, off = torch.zeros(self.size), r * self.size, (r + 1) * self.size, 0
        for name, n in zip(self.names, self.numels):
            lo, hi = max(a, off), min(b, off + n)
            if lo < hi:
                out[lo - a: hi - a] = self.saved.param(name, key, lo - off, hi - off)
            off += n
        return out

    def split(self, flat: torch.Tensor) -> list:
        """A rank's partition cut into its sub-groups (stages 1-2: the one group)."""
        if self.stage != 3:
            return [flat]
        return list(flat.split([sum(self.pieces[a:b]) for a, b in self.groups]))


@contextmanager
def _loss_scaler_class(needed: bool = True):
    """DeepSpeed's ``LossScaler`` class to pickle: the real one when DeepSpeed imports, else a stand-in
    registered under the same module path while the file is written (what is pickled is the name and
    the fields cur_scale and dynamic, exactly as DeepSpeed pickles it)."""
    if not needed:   # stages 1-2 leave the loss scaler out (DeepSpeed's loader keeps its own)
        yield None
        return
    try:
        from deepspeed.runtime.fp16.loss_scaler import LossScaler
        yield LossScaler
        return
    except ImportError:
        pass
    mod_name, _, cls_name = LOSS_SCALER.rpartition(".")
    cls = type(cls_name, (), {"__module__": mod_name})
    parts = mod_name.split(".")
    saved = {}   # what sys.modules held under those names (absent, or None: "cannot be imported")
    for i in range(1, len(parts) + 1):
        name = ".".join(parts[:i])
        if sys.modules.get(name) is None:
            saved[name] = sys.modules.get(name, _ABSENT)
            sys.modules[name] = types.ModuleType(name)
    setattr(sys.modules[mod_name], cls_name, cls)
    try:
        yield lambda scale=1.0: _fields(cls(), cur_scale=float(scale), dynamic=False)
    finally:
        for name, old in saved.items():
            if old is _ABSENT:
                sys.modules.pop(name, None)
            else:
                sys.modules[name] = old


_ABSENT = object()


def _fields(obj, **kw):
    obj.__dict__.update(kw)
    return obj


def deepspeed_parts(saved, rank: int, stage: int | None = None, world: int | None = None, hyper=None,
                    client_state=None, loss_scaler_cls=None, sub_group_size: int | None = None):
    """(file name, object) of the files DeepSpeed rank ``rank`` writes, from zerolab checkpoint ``saved``."""
    rec, lay = saved.engine, saved.layout
    stage = rec["stage"] if stage is None else int(stage)
    world = saved.world_size if world is None else int(world)
    if stage not in (1, 2, 3):
        raise CheckpointError(f"DeepSpeed format: ZeRO stage {stage}; choose 1, 2 or 3 (stage 0 is DeepSpeed's "
                              f"non-ZeRO layout, not written)")
    dtype = DTYPES[rec.get("compute_dtype", "float32")]
    if dtype == torch.float16:
        raise CheckpointError("DeepSpeed format: fp16 checkpoints are not written (DeepSpeed's dynamic loss "
                              "scaler would start from scratch); save in bf16 or fp32")
    hyper = hyper or rec["optimizer"].get("hyper")
    if hyper is None:
        raise CheckpointError(f"{saved.dir}: the manifest predates the optimizer record (lr, betas, eps, "
                              f"weight_decay) that DeepSpeed's files need; save the checkpoint again")
    if "exp_avg" not in saved.manifest["state_keys"]:
        raise CheckpointError(f"{saved.dir}: no Adam moments saved (state {saved.manifest['state_keys']})")
    ds = DeepSpeedLayout(saved, stage, world, int(sub_group_size or hyper.get("sub_group_size") or 10**9))
    group = ds_param_group(rec["optimizer"]["type"], hyper, len(ds.groups))
    bf16 = dtype == torch.bfloat16
    cfg = {"train_micro_batch_size_per_gpu": 1, "gradient_accumulation_steps": rec["gradient_accumulation_steps"],
           "zero_optimization": {"stage": stage, **({"sub_group_size": ds.sub_group_size} if stage == 3 else {})},
           "bf16": {"enabled": bf16}}
    step = int(rec["optimizer"]["step_count"])
    moments = zip(ds.split(ds.slice("exp_avg", rank)), ds.split(ds.slice("exp_avg_sq", rank)))
    state = {i: {"step": step, "exp_avg": m, "exp_avg_sq": v} for i, (m, v) in enumerate(moments)}
    torch_sd = {"state": state, "param_groups": [group]}
    fp32 = ds.slice("fp32", rank)
    if stage <= 2:
        last = rank == world - 1
        osd = {"base_optimizer_state": torch_sd, "single_partition_of_fp32_groups": [fp32[: ds.size - ds.pad * last]],
               "zero_stage": stage, "group_paddings": [ds.pad if last else 0],
               "param_alignment_paddings": [[0] * len(ds.names)], "partition_count": [world], "ds_version": DS_VERSION}
    else:
        osd = {"zero_stage": 3, "loss_scaler": (loss_scaler_cls or (lambda s: s))(1.0), "dynamic_loss_scale": False,
               "overflow": False, "partition_count": world, "optimizer_state_dict": torch_sd,
               "fp32_flat_groups": ds.split(fp32)}
    prefix = "bf16_" if bf16 else ""
    yield f"{prefix}zero_pp_rank_{rank}_mp_rank_00_optim_states.pt", \
        {"optimizer_state_dict": osd, "ds_config": cfg, "ds_version": DS_VERSION}
    if stage <= 2 and rank != 0:
        return
    yield ("mp_rank_00_model_states.pt" if stage <= 2 else f"zero_pp_rank_{rank}_mp_rank_00_model_states.pt"), \
        model_states(saved, ds, rank, dtype, cfg, client_state)


def model_states(saved, ds: DeepSpeedLayout, rank: int, dtype, cfg: dict, client_state) -> dict:
    """DeepSpeed's model-state file: the module (stage 3: empty parameters), names, shapes, counters."""
    rec, lay = saved.engine, saved.layout
    zl_module = saved.model_states().get("module", {})
    buffers = saved.file(optim_file(0)).get("buffers", {})
    module, frozen_shapes, fragments = OrderedDict(), OrderedDict(), OrderedDict()
    for k in lay["keys"]:
        canon = lay["aliases"].get(k, k)
        if k in lay["buffers"]:
            module[k] = buffers[k].clone()
        elif ds.stage == 3:
            module[k] = torch.empty(0, dtype=dtype)
        elif canon in saved.index:
            module[k] = module[canon] if canon in module else saved.param(canon).view(saved.index[canon][3]).to(dtype)
        else:
            module[k] = zl_module[k].to(dtype)
        if k in lay["frozen"] and k in zl_module:
            whole = zl_module[k].to(dtype)
            frozen_shapes[k] = whole.shape
            piece = -(-whole.numel() // ds.world)
            flat = torch.cat([whole.reshape(-1), whole.new_zeros(piece * ds.world - whole.numel())])
            fragments[k] = flat[rank * piece: (rank + 1) * piece].clone() if ds.stage == 3 else whole.clone()
    sched = rec.get("scheduler")
    out = {"module": module, "buffer_names": list(lay["buffers"]), "optimizer": None,
           "param_shapes": [OrderedDict((n, torch.Size(saved.index[n][3])) for n in ds.names[a:b])
                            for a, b in ds.groups],
           "frozen_param_shapes": frozen_shapes if ds.stage >= 2 and frozen_shapes else None,
           "shared_params": dict(lay["aliases"]) if rank == 0 else {},   # as DeepSpeed: rank 0's lists them
           "frozen_param_fragments": fragments if ds.stage >= 2 and fragments else None,
           "lr_scheduler": {"last_batch_iteration": sched["position"] - 1} if sched else None,
           "data_sampler": None, "random_ltd": None,
           "skipped_steps": rec["skipped_steps"], "global_steps": rec["global_steps"],
           "dp_world_size": ds.world, "mp_world_size": 1,
           "checkpoint_parallel_dimensions": {"pp_degree": 1, "tp_degree": 1}, "ds_config": cfg,
           "ds_version": DS_VERSION}
    client = dict(saved.model_states().get("client_state", {}) if client_state is None else client_state)
    clash = sorted(set(client) & set(out))
    if clash:
        raise CheckpointError(f"client_state keys {clash} collide with DeepSpeed's own keys in the model-state file")
    return {**out, **client}


def write_deepspeed(saved, dst_dir, tag: str, ranks=None, **kw) -> str:
    """Write DeepSpeed's files of ``ranks`` (default: all) into ``dst_dir/tag``; rank 0's caller writes ``latest``."""
    world = kw.get("world") or saved.world_size
    out = os.path.join(os.fspath(dst_dir), tag)
    with _loss_scaler_class(needed=(kw.get("stage") or saved.engine["stage"]) == 3) as scaler:
        for r in (range(world) if ranks is None else ranks):
            for name, obj in deepspeed_parts(saved, r, loss_scaler_cls=scaler, **kw):
                os.makedirs(out, exist_ok=True)   # only once the first file is ready: a refusal leaves nothing
                write_checked(obj, os.path.join(out, name))
    return out
