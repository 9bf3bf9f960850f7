"""``deepspeed.zero``: ``Init`` (partitioned construction) and ``GatheredParameters`` (chapter 6's gather).

``zero.Init`` here is ``zl.zero_init()`` (``zerolab.engine.bigmodel.zero_init``),
the idea of DeepSpeed's own: every module is built for real, and as soon as it
is complete each of its parameters is broadcast from rank 0, cut into one piece
per rank, this rank keeps its piece and the parameter goes to the meta device.
So the values are the constructor's own (a custom ``nn.init`` call in
``__init__``, weights copied in), no rank holds more than one module whole,
and ``deepspeed.initialize`` gathers the pieces unit by unit into its shards.
Without a process group the pieces are the whole parameters (under a
launcher's environment the block first starts one, as DeepSpeed's does). Every rank must
build the same model inside the block (the broadcasts pair up in order).
Buffers are left as built, whole. One difference: a module is partitioned here
when it is attached to its parent, in DeepSpeed when its own ``__init__``
returns, so a value its parent sets in between (``lin = nn.Linear(..);
nn.init.zeros_(lin.bias); self.lin = lin``) is kept here and lost in DeepSpeed
(an in-place op on its empty placeholder); values a module's own ``__init__``
sets are kept by both (measured with tests/ds_zero_init_run.py).

``dtype``, as DeepSpeed reads it: the given one, else the config's (``bf16``
enabled: bfloat16, ``fp16``: float16, else float32); one of float32, float16,
bfloat16. The floating parameters are cast to it when partitioned -- after the
constructor ran in its own dtype, where DeepSpeed makes every floating tensor
in that dtype as it is created (a random draw then rounds the same way, an
arithmetic on it may not). Without ``dtype`` and without a config the
parameters keep the constructor's dtype (DeepSpeed then picks float16 or
bfloat16 by accelerator).

``GatheredParameters(params, modifier_rank=None)``:

* on parameters built under ``zero.Init`` and not yet given to ``initialize``
  (the DeepSpeed pattern of loading or editing weights right after building):
  inside the block each one is whole on every rank (all-gathered from the
  pieces, one collective per parameter in construction order, whatever order
  ``params`` lists them in, as DeepSpeed sorts by its ids); on leaving it, with
  ``modifier_rank=r`` rank r's values are broadcast and every rank keeps its new
  piece; with ``modifier_rank=None`` the pieces are left as they were and the
  edits dropped, as DeepSpeed drops them;
* on an engine's parameters: ``zl.gathered_parameters`` on the engine that owns
  them (stage 3: the units holding them all-gathered for the block; with
  ``modifier_rank=r`` rank r's in-place edits broadcast back into every shard);
* on a model built on the meta device (``with torch.device("meta")``) before
  ``initialize``: full, zero-filled storage for the block; rank r's values are
  kept aside and written into the shards by ``initialize`` (``apply_pending_edits``);
* on any other parameter: nothing, as DeepSpeed leaves parameters it did not
  partition.

One difference, measured against DeepSpeed 0.19.8 (ZeRO-3, fp32, CPU): an edit
made with ``modifier_rank`` *after* ``initialize`` is kept here (the fp32
master takes the edited elements), while DeepSpeed's next optimizer step copies
its own fp32 partition back over it. Before ``initialize`` both agree.
"""
from __future__ import annotations

import os
import weakref

import torch
import torch.distributed as dist
from torch import nn

from zerolab.config import Config
from zerolab.deepspeed import comm
from zerolab.engine import gathered_parameters
from zerolab.engine.bigmodel.zero_init import cut_piece, gather_piece, rank_world, zero_init
from zerolab.runtime.comm import Communicator

_ENGINES: "weakref.WeakSet" = weakref.WeakSet()   # zerolab engines built by deepspeed.initialize
# id(meta parameter) -> (the parameter, modifier rank, its values on that rank / None elsewhere): edits
# made before initialize to a meta-device model, written into the shards by apply_pending_edits (a weak
# reference would stop torch.utils.swap_tensors, which materialising the model uses)
_PENDING: dict = {}
DTYPES = (torch.float32, torch.float16, torch.bfloat16)


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
    """``p`` takes ``value``'s tensor, staying the same Python object with its attributes
    (``torch.utils.swap_tensors`` swaps ``__dict__`` too)."""
    attrs = dict(p.__dict__)
    torch.utils.swap_tensors(p, nn.Parameter(value, requires_grad=p.requires_grad))
    p.__dict__.update(attrs)


def init_dtype(config, dtype):
    """DeepSpeed's choice of ``zero.Init``'s dtype: ``dtype``, else the config's precision (None: neither)."""
    if dtype is not None:
        if dtype not in DTYPES:
            raise ValueError(f"zero.Init(dtype={dtype!r}): DeepSpeed allows torch.float32, torch.float16 or "
                             f"torch.bfloat16")
        return dtype
    return None if config is None else getattr(torch, Config.from_deepspeed(config).compute_dtype)


class Init:
    """``with deepspeed.zero.Init(config_dict_or_path=ds_config): model = build()`` -- ``zl.zero_init()``."""

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
        self.enabled, self.config = enabled, config_dict_or_path if config_dict_or_path is not None else config
        self.dtype = init_dtype(self.config, dtype) if enabled else None
        self._cm = None

    def __enter__(self):
        if not self.enabled:
            return self
        if not dist.is_initialized() and all(k in os.environ for k in comm._LAUNCHER_ENV):
            comm.init_distributed()   # under a launcher, as DeepSpeed's zero.Init does; else one rank
        self._cm = zero_init(self.dtype)
        self._cm.__enter__()
        return self

    def __exit__(self, *exc):
        cm, self._cm = self._cm, None
        return False if cm is None else cm.__exit__(*exc)   # partitions the roots' own parameters


class GatheredParameters:
    """``with deepspeed.zero.GatheredParameters(params, modifier_rank=None): ...`` (collective at stage 3
    and on ``zero.Init``'s parameters)."""

    def __init__(self, params, modifier_rank=None, fwd_module=None, enabled=True):
        if fwd_module is not None:
            raise NotImplementedError("GatheredParameters(fwd_module=...): registering external parameters is "
                                      "not supported; zerolab gathers a parameter with its own unit")
        if isinstance(params, torch.Tensor):
            params = [params]
        self.params = [p for p in (params or []) if p is not None]
        self.modifier_rank, self.enabled, self._cm, self._meta, self._pieces = modifier_rank, enabled, None, [], []

    def __enter__(self):
        if not self.enabled or not self.params:
            return None
        engine = engine_of(self.params)
        if engine is not None:
            self._cm = gathered_parameters(engine, self.params, self.modifier_rank)
            return self._cm.__enter__()
        world = rank_world()[1]
        if self.modifier_rank is not None and not (isinstance(self.modifier_rank, int) and 0 <= self.modifier_rank < world):
            raise ValueError(f"GatheredParameters(modifier_rank={self.modifier_rank!r}): expected None or a rank "
                             f"in 0..{world - 1}")
        unique = list({id(p): p for p in self.params}.values())
        # zero.Init's parameters, in partition order (the same on every rank)
        pieces = sorted((p for p in unique if getattr(p, "_zl_piece", None) is not None), key=lambda p: p._zl_order)
        if any(not p.is_meta for p in pieces):   # DeepSpeed refuses the same overlap
            raise RuntimeError("GatheredParameters: nested blocks cannot gather the same parameter twice; "
                               "it is already whole inside an enclosing GatheredParameters")
        world_comm = Communicator() if pieces else None
        for p in pieces:
            _swap(p, gather_piece(p, world_comm).clone().view(p.shape))
        self._pieces = pieces
        # a meta-device model's parameters (built without zero.Init) get full storage for the block
        self._meta = [p for p in unique if p.is_meta and getattr(p, "_zl_piece", None) is None]
        for p in self._meta:
            pending = _PENDING.get(id(p))
            value = pending[2] if pending is not None and pending[2] is not None else None
            _swap(p, value.clone() if value is not None else torch.zeros(p.shape, dtype=p.dtype))
        return None   # parameters no engine partitions are left alone, as DeepSpeed

    def __exit__(self, *exc):
        pieces, meta, self._pieces, self._meta = self._pieces, self._meta, [], []
        keep = self.modifier_rank is not None and exc[0] is None
        rank, world = rank_world()
        for p in pieces:
            piece = p._zl_piece
            if keep:   # rank modifier_rank's values to every rank; each keeps its new piece
                full = p.detach().to(piece.dtype).contiguous().view(-1)
                if world > 1:
                    dist.broadcast(full, src=self.modifier_rank)
                piece = cut_piece(full, rank, world)
            _swap(p, torch.empty(p.shape, dtype=piece.dtype, device="meta"))
            p._zl_piece = piece
            if keep:
                p._zl_set = True   # given its values (from_pretrained's weights): initialize must not re-init it
        for p in meta:
            if keep:
                value = p.detach().clone() if rank == self.modifier_rank else None
                _PENDING[id(p)] = (p, self.modifier_rank, value)
            _swap(p, torch.empty(p.shape, dtype=p.dtype, device="meta"))
        if self._cm is None:
            return False
        cm, self._cm = self._cm, None
        return cm.__exit__(*exc)
