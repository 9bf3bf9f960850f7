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
import os
import warnings

from torch import nn
from torch.utils.data import DistributedSampler

from zerolab.config.schema import load_json
from zerolab.deepspeed import comm
from zerolab.deepspeed.client import read_client_optimizer, refuse_client_scheduler
from zerolab.deepspeed.data import DeepSpeedDataLoader
from zerolab.deepspeed.engine import DeepSpeedEngine
from zerolab.deepspeed.pipe import PipelineModule
from zerolab.deepspeed.pipe_engine import PipelineEngine
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
    refuse_client_scheduler(lr_scheduler)
    raw = _raw_config(args, config, config_params)
    drop_last = bool(raw.pop("dataloader_drop_last", False))
    has_optimizer = optimizer is not None or raw.get("optimizer") is not None
    if optimizer is not None:   # read (or refused) before any process group exists
        if raw.get("optimizer") is not None:
            warnings.warn("deepspeed.initialize: both optimizer= and the config's \"optimizer\" are given; the "
                          "client optimizer is used (as DeepSpeed does)", UserWarning, stacklevel=2)
        raw["optimizer"], model_parameters = read_client_optimizer(optimizer, model_parameters, model)
    comm.init_distributed(distributed_port=distributed_port, dist_init_required=dist_init_required)
    engine = zl_initialize(model, raw, model_parameters=_groups(model, model_parameters),
                           **({"mesh": model.mesh} if pipe else {}))
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
    if optimizer is not None:
        ds.__dict__["client_optimizer_name"] = raw["optimizer"]["type"]   # DeepSpeed: the client's class name
    return ds, ds.optimizer, loader, ds.lr_scheduler


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
