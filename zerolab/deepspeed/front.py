"""``deepspeed.initialize`` and ``deepspeed.add_config_arguments`` on zerolab's engines.

``initialize`` takes DeepSpeed 0.19.8's arguments in DeepSpeed's order and
returns its four values ``(engine, optimizer, training_dataloader,
lr_scheduler)``: the config comes from ``config`` (a dict, a JSON path) or
``args.deepspeed_config``; a client optimizer is read into the config
(``client.py``); the model is wrapped by ``zl.initialize`` (a model built under
``zero.Init`` holds one piece of each parameter per rank; they are gathered there,
unit by unit); with
``training_data`` the loader has DeepSpeed's batch order (``data.py``).
A ``deepspeed.pipe.PipelineModule`` gets zerolab's pipeline over its own mesh
and the pipeline engine (``pipe_engine.py``). Model parallelism (``mpu``,
``mesh_param``) is refused with errors naming what to use instead.
"""
from __future__ import annotations

import argparse
import copy
import os
import warnings

from torch import nn
from torch.utils.data import DistributedSampler

from zerolab.config.schema import load_json
from zerolab.deepspeed import comm
from zerolab.deepspeed.client import read_client_optimizer
from zerolab.deepspeed.data import DeepSpeedDataLoader
from zerolab.deepspeed.engine import DeepSpeedEngine
from zerolab.deepspeed.pipe import PipelineModule
from zerolab.deepspeed.pipe_engine import PipelineEngine
from zerolab.deepspeed.schedules import lr_source, make_client_scheduler, rate_holder
from zerolab.deepspeed.utils import RepeatingLoader
from zerolab.deepspeed.zero import apply_pending_edits, register
from zerolab.engine import initialize as zl_initialize

# DeepSpeed config keys this front door implements itself (the engine's config reader does not know them)
FRONT_KEYS = ("dataloader_drop_last",)


def add_config_arguments(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """DeepSpeed's arguments: ``--deepspeed``, ``--deepspeed_config`` (and the deprecated
    ``--deepscale``, ``--deepscale_config``), in a group named "DeepSpeed"."""
    group = parser.add_argument_group("DeepSpeed", "DeepSpeed configurations")
    group.add_argument("--deepspeed", default=False, action="store_true",
                       help="Enable DeepSpeed (a flag for the script's own use; no effect on the engine)")
    group.add_argument("--deepspeed_config", default=None, type=str, help="DeepSpeed json configuration file.")
    group.add_argument("--deepscale", default=False, action="store_true", help="Deprecated: use --deepspeed")
    group.add_argument("--deepscale_config", default=None, type=str, help="Deprecated: use --deepspeed_config")
    return parser


def _raw_config(args, config, config_params) -> dict:
    if config is None and config_params is not None:
        config = config_params
    from_args = getattr(args, "deepspeed_config", None) or getattr(args, "deepscale_config", None)
    if from_args is not None:
        if config is not None:   # DeepSpeed asserts the same
            raise ValueError("deepspeed.initialize: a config came both in args.deepspeed_config and as config=; "
                             "give one")
        config = from_args
    if config is None:
        raise ValueError("deepspeed.initialize: no config; pass config= (a dict or a JSON path) or "
                         "--deepspeed_config on the command line (deepspeed.add_config_arguments)")
    raw = load_json(os.fspath(config) if isinstance(config, os.PathLike) else config)
    return dict(raw)


def initialize(args=None, model=None, optimizer=None, model_parameters=None, training_data=None, lr_scheduler=None,
               distributed_port=comm.TORCH_DISTRIBUTED_DEFAULT_PORT, mpu=None, dist_init_required=None,
               collate_fn=None, config=None, mesh_param=None, config_params=None):
    """DeepSpeed's ``initialize``; returns ``(engine, optimizer, training_dataloader, lr_scheduler)``.

    ``optimizer`` is None when neither the config nor ``optimizer=`` names one (then, as in
    DeepSpeed, ``engine.backward`` refuses); ``training_dataloader`` is None without
    ``training_data``; ``lr_scheduler`` is None without the config's ``"scheduler"``.
    """
    if model is None:
        raise ValueError("deepspeed.initialize requires a model")
    if not isinstance(model, nn.Module):
        raise TypeError(f"deepspeed.initialize(model=...): expected a torch.nn.Module, got {type(model).__name__}")
    if mpu is not None:
        raise NotImplementedError("deepspeed.initialize(mpu=...): a model-parallel unit (Megatron-style tensor/"
                                  "pipeline groups) is not supported by zerolab's data-parallel engines; zerolab's "
                                  "tensor and pipeline parallelism is zerolab.parallel (chapter 10)")
    if mesh_param is not None:
        raise NotImplementedError("deepspeed.initialize(mesh_param=...): sequence/data-parallel meshes are not "
                                  "supported; zerolab's engines use the whole world as the data-parallel group")
    pipe = isinstance(model, PipelineModule)
    if not pipe and type(model).__name__ == "PipelineModule":
        raise TypeError("deepspeed.initialize(model=PipelineModule): this PipelineModule is DeepSpeed's own; build "
                        "it with zerolab.deepspeed.pipe.PipelineModule (the module the script imported deepspeed as)")
    if model_parameters is not None and not isinstance(model_parameters, (list, tuple)):
        model_parameters = [model_parameters] if isinstance(model_parameters, dict) else list(model_parameters)
    raw = _raw_config(args, config, config_params)
    as_given = copy.deepcopy(raw)   # engine.config: the user's dict, as DeepSpeed keeps it (transformers reads it)
    drop_last = bool(raw.pop("dataloader_drop_last", False))
    has_optimizer = optimizer is not None or raw.get("optimizer") is not None
    holder = None   # the torch optimizer whose param_groups hold the learning rates (a client's)
    if optimizer is not None:   # read (or refused) before any process group exists
        if raw.get("optimizer") is not None:
            warnings.warn("deepspeed.initialize: both optimizer= and the config's \"optimizer\" are given; the "
                          "client optimizer is used (as DeepSpeed does)", UserWarning, stacklevel=2)
        raw["optimizer"], model_parameters, holder = read_client_optimizer(optimizer, model_parameters, model)
    if lr_scheduler is not None and raw.get("scheduler") is not None:
        raise ValueError("deepspeed.initialize: both lr_scheduler= and the config's \"scheduler\" are given; "
                         "keep one")
    if hasattr(lr_scheduler, "step"):   # an object: checked before any process group starts
        make_client_scheduler(lr_scheduler, holder)
    comm.init_distributed(distributed_port=distributed_port, dist_init_required=dist_init_required)
    groups = _groups(model, model_parameters)
    engine = zl_initialize(model, raw, model_parameters=groups, **({"mesh": model.mesh} if pipe else {}))
    say_notes(engine)
    math = getattr(engine.optimizer, "math", engine.optimizer)   # offload keeps torch's maths in .math
    math.same_scheduled_lr = engine.scheduler is not None   # DeepSpeed's schedules set every group's lr
    own_holder = lr_scheduler is not None and holder is None
    if own_holder:
        holder = rate_holder(engine.config.optimizer, model_parameters, model)
    client_scheduler = make_client_scheduler(lr_scheduler, holder)
    if holder is not None:   # a client optimizer's empty groups were dropped (client.py)
        math.lr_source = lr_source(holder, [i for i, g in enumerate(holder.param_groups) if g["params"] or own_holder])
    register(engine)
    apply_pending_edits(engine)   # GatheredParameters(..., modifier_rank=r) edits to a meta-device model
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    if args is not None and hasattr(args, "local_rank"):
        args.local_rank = local_rank   # DeepSpeed aligns args.local_rank with the launcher's LOCAL_RANK
    loader = None
    if training_data is not None:
        if engine.config.train_micro_batch_size_per_gpu is None:
            raise ValueError("deepspeed.initialize(training_data=...): the config sets no batch size; give "
                             "train_micro_batch_size_per_gpu or train_batch_size")
        mbs = engine.config.train_micro_batch_size_per_gpu
        if pipe:   # DeepSpeed's pipeline loader: the DP group's ranks, no shuffling, restarted when it runs out
            sampler = DistributedSampler(training_data, num_replicas=model.mesh.dp, rank=model.mesh.dp_rank,
                                         shuffle=False)
            loader = RepeatingLoader(DeepSpeedDataLoader(training_data, mbs, 0, 1, collate_fn=collate_fn,
                                                         data_sampler=sampler, drop_last=drop_last))
        else:
            loader = DeepSpeedDataLoader(training_data, mbs, engine.rank, engine.world_size, collate_fn=collate_fn,
                                         drop_last=drop_last)
    ds = PipelineEngine(engine, model, loader, local_rank, has_optimizer) if pipe else \
        DeepSpeedEngine(engine, loader, local_rank, has_optimizer)
    ds.__dict__["config"] = as_given
    if optimizer is not None:
        ds.__dict__["client_optimizer_name"] = raw["optimizer"]["type"]   # DeepSpeed: the client's class name
    if client_scheduler is not None:
        ds.__dict__["lr_scheduler"] = client_scheduler   # stepped by engine.step() after each applied step
    return ds, ds.optimizer, loader, ds.lr_scheduler


def say_notes(engine) -> None:
    """The config's notes (keys accepted and ignored, meanings that differ), once, on rank 0, as DeepSpeed warns."""
    if engine.rank == 0:
        for note in engine.config.notes:
            warnings.warn(f"zerolab.deepspeed: {note}", UserWarning, stacklevel=3)


def _groups(model, model_parameters):
    """``model_parameters`` for ``zl.initialize``: None when it is simply every trainable parameter
    (``model.parameters()``, a ``filter`` of them): the engine's plain path, one group."""
    if model_parameters is None:
        return None
    groups = list(model_parameters)
    if groups and all(isinstance(g, nn.Parameter) or not isinstance(g, dict) for g in groups):
        trainable = {id(p) for p in model.parameters() if p.requires_grad}
        if {id(p) for p in groups} >= trainable:
            return None
    if len(groups) == 1 and isinstance(groups[0], dict) and set(groups[0]) == {"params"}:
        return _groups(model, groups[0]["params"])
    return groups
