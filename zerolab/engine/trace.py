"""A traced run (``{"zerolab": {"trace": true}}``): what the replay on modelled GPUs reads (chapters 3-14).

``start_trace`` gives the engine a ``runtime.trace.TraceRecorder`` over ``engine.events``: the
engine's communicator books every collective's issue and wait there, each unit's module
marks where its compute starts (forward: its pre-hook; backward: when its output's gradient
arrives), and ``Engine.forward``/``backward`` count FLOPs while they run. The first record
of a trace (kept first across ``events.clear()``) is ``"trace-meta"``: who recorded it and
the units; each update of a unit's shard adds an ``"optimizer"`` record. ``theory.replay``
replays the list on a modelled cluster.
"""
from __future__ import annotations

import time
from contextlib import nullcontext

import torch
from torch import nn

from zerolab.engine.flat import find_units
from zerolab.engine.unit_hooks import tensors_of
from zerolab.runtime.trace import Record, TraceRecorder

META, OPTIMIZER = "trace-meta", "optimizer"


def start_trace(engine) -> TraceRecorder:
    """Install the recorder on ``engine`` (its communicator's ledger and its units' modules)."""
    rec = TraceRecorder(engine.events)
    engine.communicator.ledger.recorder = rec
    index = {u.name: i for i, u in enumerate(engine.flat.units) if u.name != "persistent"}
    rest = index.get("rest", -1)
    for path, module in find_units(engine.module, engine.flat.policy):
        if path in index and path != "rest":
            _mark(module, index[path], rest, rec)
    return rec


def _mark(module: nn.Module, i: int, rest: int, rec: TraceRecorder) -> None:
    def pre_forward(_, args):
        rec.enter_unit(i)

    def post_forward(_, args, output):
        rec.enter_unit(rest)
        outs = [t for t in tensors_of(output) if t.requires_grad]
        if outs and torch.is_grad_enabled():   # its backward starts when its output's gradient arrives
            torch.autograd.graph.register_multi_grad_hook(outs, lambda _g: rec.enter_unit(i), mode="any")
    module.register_forward_pre_hook(pre_forward)
    module.register_forward_hook(post_forward)


def meta(engine) -> tuple:
    """The ``"trace-meta"`` record: the recording's ranks, nodes, stage, units and precision."""
    c, cfg = engine.communicator, engine.config
    mesh = getattr(engine, "mesh", None)
    info = {"rank": torch.distributed.get_rank() if torch.distributed.is_initialized() else 0,
            "world": torch.distributed.get_world_size() if torch.distributed.is_initialized() else 1,
            "ranks_per_node": c.ranks_per_node, "stage": engine.stage, "dp": c.world_size,
            "tp": getattr(mesh, "tp", 1), "pp": getattr(mesh, "pp", 1),
            "units": [(u.name, u.numel, u.padded) for u in engine.flat.units],
            "param_collective": getattr(engine, "param_collective", None),
            "master": engine.precision.has_master,
            "dtype_bytes": torch.finfo(engine.precision.compute_dtype).bits // 8,
            "offload": cfg.zero.offload_optimizer.device, "gas": engine.gas}
    return Record(META, -1, time.perf_counter(), info)


def keep_meta_first(engine) -> None:
    """Put the meta record first again (a caller may have cleared ``engine.events`` since)."""
    ev = engine.events
    if not ev or ev[0][0] != META:
        ev.insert(0, meta(engine))


def traced(engine, phase: str):
    """Inside: FLOPs counted as ``phase`` ("forward" / "backward") when ``engine`` is traced."""
    if engine.tracer is None:
        return nullcontext()
    keep_meta_first(engine)
    return engine.tracer.computing(phase)


def drained(engine) -> None:
    """The end of a backward: the engine has waited for all its collectives in flight."""
    if engine.tracer is not None:
        engine.tracer.drained()


def updated(engine, numel: int) -> None:
    """``numel`` elements of this rank's shard were just updated by the optimizer (traced runs only)."""
    if engine.tracer is not None:
        engine.events.append(Record(OPTIMIZER, -1, time.perf_counter(), {"numel": int(numel)}))
