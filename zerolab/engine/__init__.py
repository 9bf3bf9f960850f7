"""The engines: ``zl.initialize(model, config)`` (chapters 3-5; stage 3 in chapter 6).

One file per idea: ``flat`` (the flat, padded per-unit buffers every stage
shares), ``precision`` (dtypes and the fp16 loss scaler), ``optim`` (the
optimizer over a flat shard, clipping, schedules), ``base`` (the training
loop), then ``stage0`` (DDP), ``stage1`` (+ optimizer-state partitioning) and
``stage2`` (+ gradient partitioning) and ``stage3`` (+ parameter partitioning,
with ``prefetch``'s unit trace); ``zeropp`` (ZeRO-3 + qwZ, hpZ, qgZ, chapter 9)
with ``quantize``'s int8/int4 kernel.
"""
from __future__ import annotations

import dataclasses

import torch
from torch import nn

from zerolab.config import Config, ConfigError
from zerolab.config.optimizer import check_optimizer_params
from zerolab.config.zero import check_zeropp
from zerolab.engine.base import Communicator, Engine
from zerolab.engine.gathered import gathered_parameters
from zerolab.engine.stage0 import Stage0Engine
from zerolab.engine.stage1 import Stage1Engine
from zerolab.engine.stage2 import Stage2Engine
from zerolab.engine.stage3 import Stage3Engine
from zerolab.engine.zeropp.engine import ZeroPPEngine
from zerolab.parallel.pipeline import is_stage, pipeline_stage, sync_tied

__all__ = ["initialize", "gathered_parameters", "Engine", "Stage0Engine", "Stage1Engine", "Stage2Engine", "Stage3Engine",
           "ZeroPPEngine"]

ENGINES = {0: Stage0Engine, 1: Stage1Engine, 2: Stage2Engine, 3: Stage3Engine}


def initialize(model: nn.Module, config, link=None, *, model_parameters=None, mesh=None) -> Engine:
    """Wrap ``model`` in the engine for ``config``'s ZeRO stage (a dict, a path or a ``zl.Config``).

    Call it on every rank with the same model; rank 0's parameters and buffers
    are broadcast to the others. A model built under ``with torch.device("meta"):``
    is materialised unit by unit (stage 3: each rank only its shard; chapter 6), then
    filled by ``engine.load_state_dict`` or its modules' ``reset_parameters()``.
    ``model_parameters``: parameter groups as torch optimizers take them (a list of
    parameters or of dicts with per-group ``lr``, ``weight_decay``...; the config's
    optimizer params are the defaults). Raises ``ConfigError`` / ``ValueError`` for
    what the engine cannot do, before touching the model; if building the engine
    fails later (a bad ``nvme_path``), the model is put back as it was. ``mesh``: a
    ``zl.mesh`` (3D, chapter 10): the engine shards over its DP group only; with pp > 1
    ``model`` is the whole model (an ``nn.Sequential`` or list of blocks, or a GPT-shaped
    model), cut here into this rank's stage (``pipeline_stage``; a stage already cut is kept),
    a weight tied between the first and the last stage synchronised over the embedding group.
    """
    _check_tp_mesh(model, mesh)
    cfg = Config.from_any(config)
    if link is not None:  # a simulated link (zerolab.theory.network) for this engine only
        cfg = dataclasses.replace(cfg, link=link)
    communicator = Communicator(link=cfg.link) if mesh is None else mesh.communicator(mesh.grad_group, cfg.link)
    if mesh is not None and mesh.pp > 1 and cfg.zero.stage > 1:
        raise ConfigError(f"{mesh}: ZeRO-{cfg.zero.stage} with pipeline parallelism would reduce gradients (and at "
                          f"stage 3 re-gather parameters) every micro-batch; as DeepSpeed, only ZeRO-0/1 with pp > 1")
    if mesh is not None and mesh.pp > 1 and cfg.fp16.enabled:
        raise ConfigError(f"{mesh}: fp16 loss scaling with pipeline parallelism is not implemented yet (each stage "
                          f"would scale the gradient it receives again); use bf16")
    cfg = cfg.with_world_size(communicator.world_size)
    if mesh is not None and mesh.pp > 1:
        if isinstance(model, list):
            model = nn.Sequential(*model)
        if not isinstance(model, nn.Module):
            raise ValueError(f"{mesh}: the model to cut into pp={mesh.pp} stages must be an nn.Module or a list "
                             f"of blocks, got {type(model).__name__}")
        model = model if is_stage(model) else pipeline_stage(model, mesh)
    _check_supported(model, cfg)
    if mesh is not None and mesh.pp > 1:
        sync_tied(model, mesh)   # a collective over the embedding group (nothing without a tied weight)
    check_zeropp(cfg.zero, cfg.precision, communicator.world_size, communicator.ranks_per_node)
    cls = ZeroPPEngine if cfg.zero.zeropp else ENGINES[cfg.zero.stage]
    if cfg.zero.offload_optimizer.device != "none" or cfg.zero.offload_param.device != "none":
        from zerolab.engine.offload.engines import offload_engine  # chapter 7: ZeRO-Offload / ZeRO-Infinity
        cls = offload_engine(cfg.zero)
    saved = ModelSnapshot(model)
    try:
        engine = cls(model, cfg, communicator, model_parameters=model_parameters)
    except BaseException:   # e.g. a bad nvme_path: put the model back as it was, so a retry works
        saved.restore()
        raise
    engine.mesh = mesh   # None, or the zl.mesh whose DP group (dp×cp with cp > 1) the engine shards over
    for p in model.parameters():
        p._zerolab_engine = True
    return engine


class ModelSnapshot:
    """What building an engine changes in a model, kept to undo a failed ``initialize``: each
    module's parameter, buffer and hook tables, each parameter's data, ``requires_grad``,
    ``.grad`` and gradient hooks, and the buffers' values (cloned: they are broadcast in place).
    Frozen parameters may hold rank 0's values afterwards (they are broadcast in place; a
    successful ``initialize`` gives them the same)."""

    HOOKS = ("_forward_pre_hooks", "_forward_hooks", "_backward_hooks", "_backward_pre_hooks",
             "_forward_pre_hooks_with_kwargs", "_forward_hooks_with_kwargs", "_forward_hooks_always_called")

    def __init__(self, model: nn.Module):
        self.modules = [(m, dict(m._parameters), dict(m._buffers),
                         {h: dict(getattr(m, h)) for h in self.HOOKS if hasattr(m, h)}) for m in model.modules()]
        params = {id(p): p for p in model.parameters()}.values()
        self.params = [(p, p.data, p.requires_grad, p.grad, dict(getattr(p, "_post_accumulate_grad_hooks", None) or {}))
                       for p in params]
        self.buffer_values = [(b, b.detach().clone()) for b in model.buffers()]

    def restore(self) -> None:
        for m, params, buffers, hooks in self.modules:
            m._parameters.clear()
            m._parameters.update(params)
            m._buffers.clear()
            m._buffers.update(buffers)
            for h, table in hooks.items():
                getattr(m, h).clear()
                getattr(m, h).update(table)
        for p, data, requires_grad, grad, grad_hooks in self.params:
            if data.is_meta and not p.is_meta:   # materialised (swapped in place): back to meta the same way
                torch.utils.swap_tensors(p, nn.Parameter(torch.empty_like(data), requires_grad=requires_grad))
            p.data, p.grad = data, grad
            p.requires_grad_(requires_grad)
            if getattr(p, "_post_accumulate_grad_hooks", None) is not None:
                p._post_accumulate_grad_hooks.clear()
                p._post_accumulate_grad_hooks.update(grad_hooks)
        for b, value in self.buffer_values:
            b.copy_(value)


def _check_tp_mesh(model, mesh) -> None:
    """A tensor-parallel model (``zl.tensor_parallel``: its layers hold different slices on each TP rank) needs
    the mesh it was converted over: without it every rank would be a DP replica, rank 0's slices broadcast
    over the others'. Read by duck typing (a layer's ``tp_dims`` and TP communicator)."""
    if not isinstance(model, nn.Module):
        return
    for name, m in model.named_modules():
        tp = getattr(getattr(m, "comm", None), "world_size", 1) if getattr(m, "tp_dims", None) else 1
        if tp > 1 and mesh is None:
            raise ValueError(f"{name!r} is a tensor-parallel layer ({type(m).__name__}, tp={tp}): a model converted "
                             f"by zl.tensor_parallel needs zl.initialize(model, config, mesh=mesh) with the mesh it "
                             f"was converted over (without it the TP ranks would be trained as DP replicas)")
        if tp > 1 and mesh.tp != tp:
            raise ValueError(f"{name!r} is a tensor-parallel layer over tp={tp}, but the mesh has tp={mesh.tp}")


def _check_supported(model: nn.Module, cfg) -> None:
    z = cfg.zero
    check_zeropp(z, cfg.precision)   # a Config built in code gets the config's rules too (JSON is checked when read)
    check_optimizer_params(cfg.optimizer.type, cfg.optimizer.params)
    params = list(model.parameters())
    if any(getattr(p, "_zerolab_engine", False) for p in params):
        raise ValueError("this model is already wrapped by a zerolab engine; build a fresh model")
    trainable = [p for p in params if p.requires_grad]
    if not trainable:
        raise ValueError("the model has no trainable parameters (requires_grad=True); nothing to train")
    dtypes = {p.dtype for p in params}
    if len(dtypes) > 1 or not next(iter(dtypes)).is_floating_point:
        raise ValueError(f"all parameters must share one floating dtype; found {sorted(map(str, dtypes))}")
    if cfg.units is not None:
        classes = {type(m).__name__ for m in model.modules()}
        unknown = [c for c in cfg.units if c not in classes]
        if unknown:
            raise ConfigError(f"zerolab.units: no module of class {unknown} in the model; its classes are "
                              f"{sorted(classes)}")
    storages = {}
    for name, p in model.named_parameters():
        ptr = p.untyped_storage().data_ptr()
        if p.numel() == 0 or p.is_meta:   # a meta parameter has no storage yet
            continue
        if ptr in storages and storages[ptr] is not p:
            raise ValueError(f"parameter {name!r} shares memory with another parameter (a view of it); the "
                             f"flat buffer would separate them. Tie modules by assigning the same nn.Parameter")
        storages[ptr] = p
    devices = {p.device for p in params if not p.is_meta}
    if len(devices) > 1:
        raise ValueError(f"all parameters must be on one device; found {sorted(map(str, devices))}")
    for name, m in model.named_modules():
        if isinstance(m, (nn.Embedding, nn.EmbeddingBag)) and m.sparse:
            raise ValueError(f"{name}: sparse gradients (sparse=True) are not supported; use sparse=False")
    for p in params:
        if p.grad is not None and p.grad.is_sparse:
            raise ValueError("sparse gradients are not supported")
