"""Stage 3: ZeRO-3, parameter partitioning (chapter 6).

Stage 2 plus one idea: a rank only ever *updates* its shard of the
parameters, so between uses it need not keep the rest. Each rank keeps
``param_shard`` (padded Ψ / N elements, shard space, allocated as such from
the start: the model is never whole on a rank, ``materialize.py``); a unit (a
transformer block, an embedding, a norm; ``flat.find_units``) is made whole
only while its module computes:

    forward pre-hook     gather_params(unit)      all-gather its shards into a (padded_u,) buffer
                         prefetch()               start the next units' all-gathers (async)
    forward post-hook    release_params(unit)     params -> empty tensors, buffer storage -> 0 bytes
    backward pre-hook    gather_params(unit)      again: backward needs the weights too
    last grad of unit    release_params(unit)
    its backward done    stage 2's reduce-scatter of the unit (``reduce_order.py``: the same moment on every rank)
    step                 update the shard in place; nothing to all-gather afterwards

Per micro-step a rank sends 3·Ψ(N-1)/N elements (forward gather, backward
gather, reduce-scatter): 1.5x DDP, for 16Ψ/N bytes of model state.

Released buffers keep their identity (``untyped_storage().resize_(0)``, as
FSDP does), so tensors autograd saved in forward (e.g. ``weight.t()``) see the
re-gathered values in backward and never pin the memory.
``stage3_param_persistence_threshold``: parameters this small stay whole, in a
unit of their own, all-gathered after the step like stage 2. Gathering ahead
and keeping units for reuse (the other ``stage3_*`` knobs) is ``prefetch.py``;
frozen parameters (a LoRA base) are partitioned as *frozen twins*, ``frozen.py``.
``{"zerolab": {"debug": true}}``: a released parameter raises an explanatory error when touched.
A module's forward may read a parameter of another unit without calling its module (a parent
reading its child's weight): the read gathers that unit, which stays gathered until backward has
its gradients (or the forward ends, without gradients) — DeepSpeed's "external parameters", found
as DeepSpeed finds them, through each module's ``_parameters`` (``ReadGathers``).
Every rank must gather the same units in the same order; ``unit_order.py`` checks it at each step.
"""
from __future__ import annotations

import weakref

import torch
from torch import nn

from zerolab.engine import events as ev
from zerolab.runtime.measure import storage_bytes
from zerolab.engine.frozen import FrozenTwins, release_waits, with_twins
from zerolab.engine.gathered import GatheredMixin, ReleasedParameter
from zerolab.engine.prefetch import Prefetcher, UnitTrace
from zerolab.engine.reduce_order import ReduceWhenDone
from zerolab.engine.unit_hooks import tensors_of, unit_hooks
from zerolab.engine.unit_order import UnitOrderCheck
from zerolab.engine.stage2 import Stage2Engine
from zerolab.engine.flat import released


class Stage3Engine(GatheredMixin, Prefetcher, FrozenTwins, ReduceWhenDone, UnitOrderCheck, Stage2Engine):
    stage = 3

    def persist_threshold(self) -> int:
        return self.config.zero.stage3_param_persistence_threshold

    partitions_params = True   # the flat buffer is this rank's shard from the start (engine/flat.py)

    def own(self, buf: torch.Tensor, u) -> torch.Tensor:
        """This rank's shard of unit ``u`` in a shard-space buffer (stage 3 has no full-size one)."""
        return self.flat.shard_view(buf, u)

    def __init__(self, model: nn.Module, cfg, communicator=None, **kw):
        super().__init__(model, cfg, communicator, **kw)   # stage 2 on the rank's shard of the flat buffer
        flat, z, fz = self.flat, cfg.zero, self.frozen_flat
        # the rank's parameters, compute dtype: padded Ψ / N elements (its shard of every unit)
        self.param_shard = flat.flat
        # frozen ones, compute dtype: padded Ψ_frozen / N elements (None: nothing frozen to partition)
        self.frozen_shard = fz.flat if fz is not None else None
        # unit indices: the trainable units, then the frozen twins (T + j); per unit a (padded_u,)
        # full buffer, compute dtype, 0 bytes of storage while released, and its (param, view) pairs
        self.n_trainable = len(flat.units)
        self.units, self._full, self._views = with_twins(flat, fz)
        units = self.units
        self.persistent = {i for i, u in enumerate(flat.units) if u.name == "persistent"}
        self._unit_of = {id(p): i for i, u in enumerate(units) for _, p in u.params}
        # what each unit's release in backward waits for (frozen.py)
        self.twin_of, self._twin_waits, self._n_params = release_waits(model, flat.policy, units, self.n_trainable,
                                                                       self.persistent)
        self._grads_left = list(self._n_params)
        self.trace = UnitTrace({i: u.padded for i, u in enumerate(units)})
        self.prefetch_elements = z.stage3_prefetch_bucket_size
        self.max_live, self.max_reuse = z.stage3_max_live_parameters, z.stage3_max_reuse_distance
        self.debug = cfg.debug
        self._empty = torch.empty(0, dtype=self.param_shard.dtype, device=self.param_shard.device)
        self._gathered, self._inflight, self._ahead, self._keep = set(), {}, set(), set()
        self._tracing = False    # recording the unit order (prefetch.py)
        self.live_elements = 0   # elements of gathered or in-flight units (not persistent)
        for i in range(len(units)):
            if i not in self.persistent:
                self._gathered.add(i)
                self.live_elements += units[i].padded
                self.release_params(i)
        self.peak_live_elements = 0
        if self.events is not None:
            self.events.clear()

        # hooks: each unit's module gathers its unit around its forward and backward; the root
        # also starts and ends the step; a module using a (tied) parameter of another unit gathers it too
        self._module_hooks = []
        self._root_units = [i for i, u in enumerate(units) if u.name == "rest"]
        for module, deps, root, index in unit_hooks(model, units, flat.policy, self._unit_of, self.persistent):
            self._module_hooks += self._hook(module, deps, root=root, index=index)
        self._running, self._pinned = [], set()   # the hooked modules' units, innermost last; units read (read_param)
        me = weakref.ref(self)
        for m in model.modules():
            if any(id(q) in self._unit_of for q in m._parameters.values() if q is not None):
                m._parameters = ReadGathers(me, m._parameters)

    def read_param(self, p) -> None:
        """A parameter is read. In a forward, by a module that does not gather its unit (a parent
        reading its child's weight): the unit is gathered (the same read on every rank, so the same
        gather), kept until release_all (end of backward, or of a forward without gradients), and
        reduced when backward ends (the reader's gradient for it comes after the child's backward)."""
        i = self._unit_of.get(id(p))
        if i is None or not self._running or i in self._running[-1] or i in self.persistent:
            return
        if i not in self._gathered:
            self.gather_params([i])
        self._pinned.add(i)
        if torch.is_grad_enabled() and i < self.n_trainable:
            if self._calls_left is None:
                self._calls_left = [0] * self.n_trainable
            self._calls_left[i] += 1   # a call whose end never comes: ready when backward ends

    # ---------------------------------------------------------------- gather, release
    def gather_params(self, units) -> None:
        """Make ``units`` whole: issue their all-gathers (unless prefetched), then wait for them."""
        for i in units:
            if i not in self._gathered and i not in self._inflight:
                self._issue(i)
        for i in units:
            if i in self._inflight:
                self._complete(i)

    def _issue(self, i: int) -> None:
        u, buf = self.units[i], self._full[i]
        buf.untyped_storage().resize_(u.padded * buf.element_size())  # (padded_u,) allocated again
        self.live_elements += u.padded
        self.peak_live_elements = max(self.peak_live_elements, self.live_elements)
        self.event(ev.GATHER_ISSUED, i)
        self.note_gather(i)   # every rank must gather the same units in the same order (unit_order.py)
        self._inflight[i] = self.fetch_unit(i)

    def fetch_unit(self, i: int):
        """Issue the collective that fills unit ``i``'s full buffer; return its handle (ZeRO++ overrides it)."""
        return self.communicator.all_gather(self._full[i], self.shard_of(i), async_op=True, tag=f"unit-{i}")

    def _complete(self, i: int) -> None:
        try:
            self._inflight.pop(i).wait()
        except RuntimeError as e:
            raise self.gather_failed(i, e) from e
        for p, v in self._views[i]:
            if self.debug:
                p.__class__ = p._zl_class
            p.data = v
        self._gathered.add(i)
        self.event(ev.GATHER_DONE, i)

    def release_params(self, i: int) -> None:
        """Free unit ``i``: its params become empty tensors and its buffer's storage 0 bytes."""
        if i in self._inflight:
            self._complete(i)   # a collective writing into the buffer must finish first
        if i not in self._gathered:
            return
        for p, _ in self._views[i]:
            p.data = self._empty
            if self.debug:
                p.__class__ = ReleasedParameter
        released(self._full[i])
        self._gathered.discard(i)
        self._ahead.discard(i)
        self._keep.discard(i)
        self.live_elements -= self.units[i].padded
        self.event(ev.RELEASE, i)

    def release_all(self) -> None:
        """Release every gathered unit (not the persistent one)."""
        self._pinned.clear()
        for i in list(self._inflight) + list(self._gathered):
            if i not in self.persistent:
                self.release_params(i)

    # ---------------------------------------------------------------- hooks
    def _hook(self, module: nn.Module, units: list, root: bool, index: int = -1) -> list:
        frozen = [i for i in units if i >= self.n_trainable]

        def pre_forward(_, args, kwargs):
            if root:
                self.release_all()   # anything left by a forward that had no backward
                self._running = []
                # a training forward records the unit order (and prefetches along it); an eval or
                # no_grad forward (validation, generation) releases everything when it ends
                self._tracing = torch.is_grad_enabled() and self.module.training
                if self._tracing:
                    self.trace.start()
                if torch.is_grad_enabled():
                    self._grads_left = list(self._n_params)
            self._use(units)
            self._running.append(units)
            # reduced when its backward is done; a forward inside backward is a recomputation (activation
            # checkpointing): the backward under way is its own, so it adds no call to wait for, and the unit
            # it gathers stays gathered for that backward (released when its gradients are in)
            if not root and index >= 0 and torch.is_grad_enabled() and not self._in_backward:
                self.watch_backward(index, args, kwargs)
            if frozen and torch.is_grad_enabled():   # frozen twins: released once the inputs have gradients
                self.watch_inputs(frozen, args, kwargs)
            self.event(ev.FORWARD_START if root else ev.UNIT_FWD_START, index)   # compute starts now

        def post_forward(_, args, output):
            self.event(ev.FORWARD_END if root else ev.UNIT_FWD_END, index)
            tensors = [t for t in tensors_of(output) if t.requires_grad]
            if tensors and torch.is_grad_enabled():
                torch.autograd.graph.register_multi_grad_hook(tensors, pre_backward, mode="any")
            if self._running:
                self._running.pop()
            if root and not self._tracing:
                self.release_all()
            for i in units:
                if (root or i not in self._root_units) and i not in self._pinned and not self._in_backward:
                    self._done_with(i)

        def pre_backward(_grad):
            self._use(units)
            if not root:
                self.event(ev.UNIT_BWD_START, index)

        return [module.register_forward_pre_hook(pre_forward, with_kwargs=True),
                module.register_forward_hook(post_forward)]

    def keep_grad(self, p) -> None:
        """Stage 2's gradient handling; a unit whose gradients are all in is released."""
        super().keep_grad(p)
        i = self._unit_of[id(p)]
        self._grads_left[i] -= 1
        self.twin_grad_in(p, i)
        if self._grads_left[i] == 0 and i not in self.persistent:
            self.event(ev.UNIT_BWD_END, i)
            self.release_params(i)
            self.unit_grads_done(i)

    def _end_of_backward(self) -> None:
        super()._end_of_backward()
        self.release_all()
        self.finish_trace()

    gathers_params = False  # stage 1-2's all-gather after the step is what stage 3 drops

    def after_update(self) -> None:
        """Each rank updated its own shard, which is all it keeps: no all-gather, except for the
        persistent unit (small params kept whole), as in stage 2."""
        for i in self.persistent:
            u = self.units[i]
            self.communicator.all_gather(self._full[i], self.flat.shard_view(self.param_shard, u),
                                         tag="persistent-params")

    # ---------------------------------------------------------------- inspection
    def memory(self):
        """Stage 2's report; params add the persistent unit and the frozen shard, buffers the gathered units."""
        r = super().memory()
        r.params += sum(storage_bytes(self._full[i]) for i in self.persistent) + storage_bytes(self.frozen_shard)
        r.gathered = sum(storage_bytes(b) for i, b in enumerate(self._full) if i not in self.persistent)
        r.buffers += r.gathered
        return r


class ReadGathers(dict):
    """A module's ``_parameters`` at stage 3: reading a parameter (``module.weight``) tells the
    engine (``read_param``), which gathers it if a forward reads it released."""
    __slots__ = ("engine",)

    def __init__(self, engine_ref, params):
        super().__init__(params)
        self.engine = engine_ref

    def __getitem__(self, key):
        p = super().__getitem__(key)
        engine = self.engine()
        if engine is not None and p is not None:
            engine.read_param(p)
        return p

    def __reduce__(self):   # pickled (torch.save(model)) as the plain dict it stands for
        return dict, (dict(self),)
