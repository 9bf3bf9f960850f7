"""The engine every stage shares: forward, backward, step, memory (chapter 3).

``Engine`` is DeepSpeed-shaped: ``engine(*inputs)``, ``engine.backward(loss)``
and ``engine.step()`` are called for every micro-batch; the engine decides when
the gradient-accumulation boundary is and only then updates the parameters.

What a stage changes is small and named (stage files override these):

    own(buf, u)           which part of a unit this rank updates (stage 0: all of it)
    keep_grad(p)          where a parameter's fresh gradient goes (hook, during backward)
    reduce_bucket(b)      the collective for one gradient bucket (during backward)
    owned_grads()         this rank's reduced gradients, one tensor per unit, for the step
    after_update()        what follows the optimizer step (stages 1-2: all-gather params)

Gradient buckets (``reduce_bucket_size`` elements, whole units, last unit
first; ``buckets.py``) are reduced as soon as every parameter in them has its
gradient, in bucket order on every rank, asynchronously when ``overlap_comm``
is on. When autograd returns, ``backward`` flushes buckets holding unused
parameters and waits for what is in flight. Each gradient hook first finishes
the collectives that have already completed (a non-blocking poll), so a
bucket's staging buffer is freed while backward is still running. That needs
the backend to report completion: NCCL and gloo's all-reduce/all-gather do;
gloo's reduce-scatter does not (its ``Work`` reports done only after ``wait``),
so on gloo stage 1-2's reduce-scatter buffers live until backward ends.
Collectives *sum* gradients; the step multiplies by 1/N, 1/loss-scale and the
clipping factor in one pass over the shard.
"""
from __future__ import annotations

import time

import torch
from torch import nn

from zerolab.engine import events as ev
from zerolab.runtime.comm import Communicator
from zerolab.engine.flat import FlatParams, model_device
from zerolab.engine.groups import resolve_groups, unit_runs
from zerolab.engine.bigmodel.materialize import buffer_marks, check_initialised, materialize
from zerolab.engine.accumulate import CallerReduces, keep_reduced_once
from zerolab.engine.api import EngineAPI
from zerolab.engine.buckets import GradientBuckets
from zerolab.engine.mesh_norm import grad_sq, model_parallel_all_reduce
from zerolab.engine.optim import ShardedOptimizer, clip_coefficient, make_scheduler
from zerolab.engine.unused import SkipUnused, param_spans
from zerolab.engine.precision import DynamicLossScaler, cast_floats, local_overflow, precision_of
from zerolab.engine.trace import drained, start_trace, traced, updated


class Engine(EngineAPI, SkipUnused, CallerReduces, GradientBuckets):
    """The training loop; a stage subclass defines own/build_grads/keep_grad/reduce_bucket/
    owned_grads/zero_grads/after_update/grad_bytes (see ``Stage0Engine``)."""
    stage = 0
    shards_optimizer = False        # stages 1+: the optimizer holds only this rank's shard
    reduce_every_micro_step = False  # stage 2: gradients cannot wait for the boundary
    report_grad_norm, last_grad_norm = False, None   # the norm before clipping: when clipping, or if asked
    tracer = None                    # a traced run's recorder (trace.py)
    partitions_params = False        # stage 3: only this rank's shard of the parameters is allocated

    def __init__(self, model: nn.Module, cfg, communicator: Communicator | None = None, model_parameters=None):
        self.module, self.config = model, cfg
        self.communicator = communicator or Communicator(link=cfg.link)   # one rank without torch.distributed
        self.rank, self.world_size = self.communicator.rank, self.communicator.world_size
        self.precision = precision_of(cfg)
        self.gas, self.overlap_comm = cfg.gradient_accumulation_steps, bool(cfg.zero.overlap_comm)
        device = model_device(model)
        group_of, self.group_hypers = resolve_groups(model, model_parameters, cfg.optimizer.type,
                                                     cfg.optimizer.params)
        self.group_of = group_of
        self.flat = FlatParams(model, self.world_size, self.rank, self.precision.compute_dtype, device,
                               persist_threshold=self.persist_threshold(), policy=cfg.units, group_of=group_of,
                               sharded=self.partitions_params, fill=False)
        # stage 3: frozen parameters partitioned too, in the same units (their "frozen twins")
        self.frozen_flat = None
        if self.partitions_params and any(not p.requires_grad for p in model.parameters()):
            fz = FlatParams(model, self.world_size, self.rank, self.precision.compute_dtype, device,
                            persist_threshold=self.persist_threshold(), policy=cfg.units, sharded=True,
                            fill=False, select="frozen")
            self.flat.frozen = fz.frozen   # the small ones stay whole
            self.frozen_flat = fz if fz.units else None
        # unit by unit: copy the model's values in, or build a meta-device model's (materialize.py)
        keep = {i for i, u in enumerate(self.flat.units) if u.name == "persistent"}
        span = (lambda u: self.flat.own_range(u, self.shards_optimizer)) if self.precision.has_master else None
        self.uninitialised = materialize(self.flat, model, self.communicator, keep, self.frozen_flat, span)
        for m in model.modules():  # buffers compute in the compute dtype too (as module.to(dtype))
            for k, b in m._buffers.items():
                if b is not None and b.is_floating_point():
                    m._buffers[k] = b.to(self.precision.compute_dtype)
        self._buffer_marks = buffer_marks(model, self.uninitialised)
        self._broadcast_initial_state()
        self.build_buckets(cfg.zero.reduce_bucket_size, cfg.zero.allgather_bucket_size)
        self.build_grads()
        self.build_optimizer()
        self.flat.exact.clear()   # an engine whose master is elsewhere (offload) did not take them
        self.scheduler = make_scheduler(cfg.scheduler)
        self.scaler = DynamicLossScaler.from_config(cfg.fp16) if cfg.fp16.enabled else None
        self.micro_steps = self.global_steps = self.skipped_steps = 0
        self._reducing, self._reduced_unstepped, self._fired, self._in_backward = False, False, set(), False
        self._reduce_deferred = False   # backward(allreduce_gradients=False) at the boundary, not reduced yet
        self._seen = set()   # parameters this rank saw a gradient for since the last step (unused.py)
        self.backwards_this_micro_step = 0
        self._hooks = [p.register_post_accumulate_grad_hook(self._grad_hook) for p in self.flat.params()]
        self.events = [] if cfg.trace else None  # timeline: (event, bucket or -1, perf_counter seconds)
        if cfg.trace:   # + FLOPs, collectives and updates (trace.py)
            self.tracer = start_trace(self)
        self.checkpoint_stats = {}   # bytes and seconds of the last save/load (checkpoint/save.py)

    def persist_threshold(self) -> int:
        """Parameters of at most this many elements stay whole on every rank (stage 3; 0 = none)."""
        return 0

    def build_optimizer(self) -> None:
        """The update targets, one fp32 tensor per unit (the rank's own params in fp32, else its
        fp32 master copy), and the optimizer state over them (offload replaces this)."""
        units, device = self.flat.units, self.flat.device
        owned_numel = sum(self.own(self.flat.flat, u).numel() for u in units)
        if self.precision.has_master:
            self.master = torch.empty(owned_numel, dtype=torch.float32, device=device)  # fp32 master: owned numel
            self.targets, off = [], 0
            for i, u in enumerate(units):   # from the model's fp32 values where it had them (materialize)
                own = self.own(self.flat.flat, u)
                self.targets.append(self.master[off: off + own.numel()])
                self.targets[-1].copy_(self.flat.exact.pop(i, own))
                off += own.numel()
        else:
            self.master = None
            self.targets = [self.own(self.flat.flat, u) for u in units]
        self.optimizer = ShardedOptimizer(self.config.optimizer.type, self.config.optimizer.params, self.targets,
                                          self.group_hypers, self.group_segments())

    def group_segments(self):
        """Per unit, the parameter-group runs of the elements this rank updates (None: one group)."""
        if self.group_of is None:
            return None
        return [unit_runs(u, self.group_of, *self.flat.own_range(u, self.shards_optimizer)) for u in self.flat.units]

    def event(self, name: str, index: int = -1) -> None:
        if self.events is not None:
            self.events.append((name, index, time.perf_counter()))

    # ---------------------------------------------------------------- the training loop
    def forward(self, *args, **kwargs):
        if self.uninitialised:
            check_initialised(self.uninitialised, self._buffer_marks)
        if self.precision.compute_dtype != torch.float32:
            args, kwargs = cast_floats(args, self.precision.compute_dtype), cast_floats(kwargs, self.precision.compute_dtype)
        with traced(self, "forward"):
            return self.module(*args, **kwargs)

    __call__ = forward

    @property
    def keeps_full_grads(self) -> bool:
        """Stages 0-1: every parameter's whole gradient until the step (stages 2-3 reduce each backward)."""
        return not self.reduce_every_micro_step

    def is_gradient_accumulation_boundary(self) -> bool:
        return (self.micro_steps + 1) % self.gas == 0

    def backward(self, loss: torch.Tensor, allreduce_gradients: bool = True) -> None:
        """loss / gradient_accumulation_steps (x the fp16 loss scale), then autograd. ``allreduce_gradients=False``
        (DeepSpeed's old name), stages 0-1: at the boundary gradients stay local until ``allreduce_gradients()``."""
        self.begin_backward(allreduce_gradients)
        factor = (self.scaler.scale if self.scaler else 1.0) / self.gas
        try:
            with traced(self, "backward"):
                (loss.float() * factor if factor != 1.0 else loss).backward()
        finally:
            self._in_backward = False
        self._end_of_backward()
        drained(self)   # a traced run: what the end of backward waited for (trace.py)

    def begin_backward(self, allreduce_gradients: bool = True) -> None:
        """What precedes autograd; zerolab.deepspeed runs it too when a script calls loss.backward()."""
        if not allreduce_gradients and not self.keeps_full_grads:
            raise ValueError(f"backward(loss, allreduce_gradients=False): stage {self.stage} reduces each bucket in "
                             f"the backward, keeping a shard; deferring needs zero_optimization.stage 0 or 1")
        self.backwards_this_micro_step += 1   # a second one before step() adds to the first (accumulate.py)
        if self._reduced_unstepped:
            keep_reduced_once(self)
        boundary = self.is_gradient_accumulation_boundary()
        self._reducing = (self.reduce_every_micro_step or boundary) and allreduce_gradients
        self._reduced_unstepped = self._reducing and not self.reduce_every_micro_step
        self._reduce_deferred = boundary and not allreduce_gradients
        self.reset_buckets()
        self._fired, self._in_backward = set(), True
        self.event(ev.BACKWARD_START)

    def _grad_hook(self, p) -> None:
        if not self._in_backward:
            raise RuntimeError("a gradient arrived outside engine.backward(): call engine.backward(loss), "
                               "not loss.backward(), so the engine can reduce the gradients")
        if id(p) in self._fired:
            raise RuntimeError("a parameter received its gradient twice in one backward (reentrant activation "
                               "checkpointing?); its bucket may already be reduced. Use "
                               "torch.utils.checkpoint.checkpoint(..., use_reentrant=False)")
        self._fired.add(id(p))
        self.finish_completed()  # overlap_comm: free what earlier collectives no longer need
        self.keep_grad(p)
        if self._reducing:
            self.grad_arrived(p)

    def _end_of_backward(self) -> None:
        self._seen |= self._fired
        if self._reducing:
            self.flush_buckets()

    @torch.no_grad()
    def step(self) -> None:
        """Called every micro-batch; updates the parameters at the accumulation boundary."""
        if self._reduce_deferred:
            raise RuntimeError("engine.step(): the gradients of backward(loss, allreduce_gradients=False) were "
                               "never reduced; call engine.allreduce_gradients() before engine.step()")
        self.micro_steps += 1
        self._reduced_unstepped, self.backwards_this_micro_step = False, 0
        if self.micro_steps % self.gas:
            return
        self.event(ev.STEP_START)
        self.agree_before_update()
        self.last_grad_norm, grads = None, self.owned_grads()
        seen, self._seen = self._seen, set()
        if self.scaler is not None and self._overflow(grads):
            self.scaler.update(True)
            self.skipped_steps += 1
            self.global_steps += 1   # DeepSpeed counts a skipped step too (its tags and logs do)
            self.zero_grads()
            return
        math = getattr(self.optimizer, "math", self.optimizer)   # offload's optimizer keeps torch's maths in .math
        if math.param_spans is None:
            math.param_spans = param_spans(self.flat, self.shards_optimizer)
        math.skip_now = self.unused_everywhere(seen)   # no gradient on any rank: not stepped (unused.py)
        scale = 1.0 / (self.world_size * (self.scaler.scale if self.scaler else 1.0))  # sum -> mean, unscale
        if self.config.gradient_clipping > 0 or self.report_grad_norm:
            # on the device the collective runs on: under optimizer offload the gradients are on the host
            sq = (grad_sq(self, grads) * scale ** 2).to(self.flat.device)
            if self.shards_optimizer:
                self.communicator.all_reduce(sq, tag="grad-norm")
            model_parallel_all_reduce(self, sq)   # 3D: the TP slices and PP stages too (mesh_norm.py)
            self.last_grad_norm = float(sq.sqrt())
            scale *= clip_coefficient(self.last_grad_norm, self.config.gradient_clipping)
        if isinstance(self.optimizer, ShardedOptimizer):  # unit by unit: stage 1 gathers while later units update
            self.optimizer.step(grads, self.get_lr(), scale, after=self.unit_updated)
        else:  # offload's optimizer updates in its own pieces
            self.optimizer.step(grads, self.get_lr(), scale)
            updated(self, sum(t.numel() for t in self.targets))
            if self.master is not None:
                torch._foreach_copy_([self.own(self.flat.flat, u) for u in self.flat.units], self.targets)
        self.after_update()
        self.zero_grads()
        self.global_steps += 1
        if self.scaler is not None:
            self.scaler.update(False)
        self.event(ev.STEP_END)

    def agree_before_update(self) -> None:
        """Collective, each step before any update: the ranks confirm the same work (stage 3: unit_order.py)."""

    def unit_updated(self, i: int) -> None:
        """Unit ``i``'s update is done: copy its fp32 master into the 16-bit parameters."""
        updated(self, self.targets[i].numel())   # a traced run records it (trace.py)
        if self.master is not None:
            self.own(self.flat.flat, self.flat.units[i]).copy_(self.targets[i])

    def _overflow(self, grads) -> bool:
        """fp16: inf/nan anywhere in any rank's shard -> every rank skips (all-reduce MAX)."""
        flag = torch.tensor([1.0 if local_overflow(grads) else 0.0], device=self.flat.device)
        self.communicator.all_reduce(flag, op="max", tag="overflow")
        model_parallel_all_reduce(self, flag, op="max")
        return bool(flag.item())

    def get_lr(self) -> float:
        """The learning rate of the next optimizer step (the scheduler counts taken steps only)."""
        if self.scheduler is None:
            return self.optimizer.lr
        return self.scheduler.lr(self.optimizer.step_count)

    @property
    def loss_scale(self) -> float:
        return self.scaler.scale if self.scaler else 1.0

    # ---------------------------------------------------------------- setup, inspection
    def _broadcast_initial_state(self) -> None:
        """Every rank starts from rank 0's parameters and buffers, as DDP does when it is built.
        Unlike DDP's default (``broadcast_buffers=True``: rank 0's buffers again before every
        forward), buffers are not sent again: each rank's BatchNorm statistics follow its own
        data from here on (chapter 3)."""
        if self.world_size == 1:
            return
        c = self.communicator   # the trainable parameters went unit by unit (materialize.py)
        for _, p in self.flat.frozen:
            c.broadcast(p.data, src=0, tag="init-frozen")
        for _, b in self.module.named_buffers():
            c.broadcast(b, src=0, tag="init-buffers")
