"""``deepspeed.zero``: ``Init`` (partitioned construction) and ``GatheredParameters`` (chapter 6's gather).

``zero.Init`` here builds the model on the **meta device**: inside the block
every parameter is a shape without storage, so no rank ever holds the whole
model; ``deepspeed.initialize`` then materialises it unit by unit (stage 3:
each rank allocates only its shard; ``zerolab.engine.bigmodel.materialize``), filling
the values with each module's ``reset_parameters()``. DeepSpeed's ``zero.Init``
instead runs the constructors for real and partitions each parameter as soon as
its module is built. Two consequences: a model's ``__init__`` that computes a
value (a buffer filled by arithmetic, a custom initialisation outside
``reset_parameters``) gets no value here -- the engine reports such tensors as
uninitialised; load the weights with ``engine.load_state_dict`` or edit them
inside ``GatheredParameters(..., modifier_rank=0)`` after ``initialize``; and
the initial values come from the random stream at ``initialize``, not at
construction.

The DeepSpeed pattern of editing weights between construction and
``initialize`` (``with GatheredParameters(model.fc.weight, modifier_rank=0):``
right after ``zero.Init``) works: inside the block the meta parameters get
real, full storage on every rank (as DeepSpeed gathers them), and on leaving
it rank ``modifier_rank``'s values are kept aside (without ``modifier_rank``
the edits are dropped, as DeepSpeed drops them); ``initialize`` then writes
them into the shards through ``zl.gathered_parameters(..., modifier_rank)``.
Until then that rank holds those full tensors: edit a few parameters this way,
not a whole large model.

``GatheredParameters(params, modifier_rank=None)`` is ``zl.gathered_parameters``
on the engine that owns ``params``: at stage 3 the units holding them are
all-gathered for the block (collective: every rank enters) and, with
``modifier_rank=r``, rank r's in-place edits are broadcast back into every
rank's shard. Parameters no engine owns are left alone, as DeepSpeed leaves
parameters that are not partitioned. One difference, measured against
DeepSpeed 0.19.8 (ZeRO-3, fp32, CPU): an edit made this way *after*
``initialize`` is kept here (the fp32 master takes the edited elements), while
DeepSpeed's next optimizer step copies its own fp32 partition back over it.
Edit before ``initialize`` (right after ``zero.Init``) and both agree.
"""
from __future__ import annotations

import weakref

import torch
import torch.distributed as dist
from torch import nn

from zerolab.engine import gathered_parameters

_ENGINES: "weakref.WeakSet" = weakref.WeakSet()   # zerolab engines built by deepspeed.initialize
# id(meta parameter) -> (the parameter, modifier rank, its values on that rank / None elsewhere): edits
# made before initialize, written into the shards by apply_pending_edits (a weak reference would stop
# torch.utils.swap_tensors, which materialising the model uses)
_PENDING: dict = {}


def register(engine) -> None:
    _ENGINES.add(engine)


def engine_of(params):
    """The engine whose model holds any of ``params`` (None: no engine does)."""
    ids = {id(p) for p in params}
    for engine in list(_ENGINES):
        if any(id(p) in ids for p in engine.module.parameters()):
            return engine
    return None


def apply_pending_edits(engine) -> None:
    """Collective (inside ``deepspeed.initialize``): write the edits made to the model's meta
    parameters before ``initialize`` into the engine, one gathered block per modifier rank."""
    by_rank: dict = {}
    for p in engine.module.parameters():
        entry = _PENDING.pop(id(p), None)
        if entry is not None and entry[0] is p:
            by_rank.setdefault(entry[1], []).append((p, entry[2]))
    for r in sorted(by_rank):
        params = [p for p, _ in by_rank[r]]
        with gathered_parameters(engine, params, modifier_rank=r), torch.no_grad():
            if engine.rank == r:
                for p, value in by_rank[r]:
                    p.copy_(value)


def _swap(p, value) -> None:
    torch.utils.swap_tensors(p, nn.Parameter(value, requires_grad=p.requires_grad))


class Init:
    """``with deepspeed.zero.Init(config_dict_or_path=ds_config): model = build()`` -- on the meta device."""

    def __init__(self, module=None, data_parallel_group=None, mem_efficient_linear=True, remote_device=None,
                 pin_memory=False, config_dict_or_path=None, config=None, enabled=True, dtype=None, mpu=None,
                 zero_param_parallel_group=None, zero_quantized_weights=False,
                 zero_quantized_nontrainable_weights=False, sequence_data_parallel_group=None, param_swapper=None):
        if module is not None:
            raise NotImplementedError("zero.Init(module=...): partitioning an already-built model is not "
                                      "supported; pass it to deepspeed.initialize, which shards it there")
        groups = {"data_parallel_group": data_parallel_group, "mpu": mpu, "param_swapper": param_swapper,
                  "zero_param_parallel_group": zero_param_parallel_group,
                  "sequence_data_parallel_group": sequence_data_parallel_group}
        given = [k for k, v in groups.items() if v is not None]
        if given:
            raise NotImplementedError(f"zero.Init({', '.join(given)}=...): zerolab partitions over the whole "
                                      f"world (every rank of torch.distributed's default group)")
        if zero_quantized_weights or zero_quantized_nontrainable_weights:
            raise NotImplementedError("zero.Init(zero_quantized_weights=True): set ZeRO++'s "
                                      "\"zero_quantized_weights\" in the config's zero_optimization instead")
        if remote_device not in (None, "none"):
            raise NotImplementedError(f"zero.Init(remote_device={remote_device!r}): where the shards live is the "
                                      f"config's zero_optimization.offload_param.device, read at initialize")
        if dtype is not None and not (isinstance(dtype, torch.dtype) and dtype.is_floating_point):
            raise ValueError(f"zero.Init(dtype=...): expected a floating torch.dtype, got {dtype!r}")
        self.enabled, self.config = enabled, config_dict_or_path if config_dict_or_path is not None else config
        self._device = None

    def __enter__(self):
        if self.enabled:
            self._device = torch.device("meta")
            self._device.__enter__()   # factory calls without a device now build meta tensors
        return self

    def __exit__(self, *exc):
        if self._device is not None:
            self._device.__exit__(*exc)
            self._device = None
        return False


class GatheredParameters:
    """``with deepspeed.zero.GatheredParameters(params, modifier_rank=None): ...`` (collective at stage 3)."""

    def __init__(self, params, modifier_rank=None, fwd_module=None, enabled=True):
        if fwd_module is not None:
            raise NotImplementedError("GatheredParameters(fwd_module=...): registering external parameters is "
                                      "not supported; zerolab gathers a parameter with its own unit")
        if isinstance(params, torch.Tensor):
            params = [params]
        self.params = [p for p in (params or []) if p is not None]
        self.modifier_rank, self.enabled, self._cm, self._meta = modifier_rank, enabled, None, []

    def __enter__(self):
        if not self.enabled or not self.params:
            return None
        engine = engine_of(self.params)
        if engine is None:   # before initialize: meta parameters (zero.Init) get full storage for the block
            self._meta = [p for p in self.params if p.is_meta]
            for p in self._meta:
                pending = _PENDING.get(id(p))
                value = pending[2] if pending is not None and pending[2] is not None else None
                _swap(p, value.clone() if value is not None else torch.zeros(p.shape, dtype=p.dtype))
            return None   # parameters no engine partitions are left alone, as DeepSpeed
        self._cm = gathered_parameters(engine, self.params, self.modifier_rank)
        return self._cm.__enter__()

    def __exit__(self, *exc):
        meta, self._meta = getattr(self, "_meta", []), []
        if meta:
            rank = dist.get_rank() if dist.is_initialized() else 0
            for p in meta:
                if self.modifier_rank is not None and exc[0] is None:
                    value = p.detach().clone() if rank == self.modifier_rank else None
                    _PENDING[id(p)] = (p, self.modifier_rank, value)
                _swap(p, torch.empty(p.shape, dtype=p.dtype, device="meta"))
            return False
        if self._cm is None:
            return False
        cm, self._cm = self._cm, None
        return cm.__exit__(*exc)
