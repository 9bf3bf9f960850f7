"""Harnesses that plug a learner's exercise function into the real package (exercises 1-3, 7, 8).

Each ``run_*`` function starts ranks with ``zl.launch``, calls the learner's
function inside them exactly as the engine would call its own code, and
returns plain values (tensors moved to CPU) for the check cell to assert on in
the notebook, so a failing check shows a readable message, not a rank's
traceback. The expected values are computed here independently: from seeds,
``zerolab.theory.network.ring_bytes`` and the engine itself. The harness for the
engine exercises (4-6) lives in ``zerolab.grading.harness_engine``.
"""
from __future__ import annotations

import functools
import warnings

import torch
import torch.distributed as dist
from torch import nn

from zerolab.engine import initialize
from zerolab.runtime.launch import launch
from zerolab.runtime.comm import Communicator

_COLLECTIVES = ("all_reduce", "reduce_scatter", "reduce_scatter_tensor", "reduce_scatter_single", "all_gather",
                "all_gather_into_tensor", "all_gather_single", "broadcast", "reduce", "all_to_all",
                "all_to_all_single", "batch_isend_irecv")


def rank_tensor(seed: int, rank: int, numel: int) -> torch.Tensor:
    """Rank ``rank``'s input: integers stored as float32, so any summation order is exact."""
    g = torch.Generator().manual_seed(1000 * seed + rank)
    return torch.randint(-50, 50, (numel,), generator=g).float()


def expected_sum(seed: int, world_size: int, numel: int) -> torch.Tensor:
    return sum(rank_tensor(seed, r, numel) for r in range(world_size))


# ---------------------------------------------------------------- exercise 2: the ring
def _only_point_to_point(sent: list):
    """Inside a rank: collectives raise; send/isend add the bytes they move to ``sent``."""
    def forbidden(name):
        def f(*a, **k):
            raise RuntimeError(f"dist.{name} is not allowed here: build the ring from dist.isend/dist.recv only")
        return f
    for name in _COLLECTIVES:
        if hasattr(dist, name):
            setattr(dist, name, forbidden(name))
    send, isend = dist.send, dist.isend

    def counted_send(tensor, dst, *a, **k):
        sent.append(tensor.numel() * tensor.element_size())
        return send(tensor, dst, *a, **k)

    def counted_isend(tensor, dst, *a, **k):
        sent.append(tensor.numel() * tensor.element_size())
        return isend(tensor, dst, *a, **k)
    dist.send, dist.isend = counted_send, counted_isend


def _ring_worker(fn, numel, seed):
    sent = []
    _only_point_to_point(sent)
    t = rank_tensor(seed, dist.get_rank(), numel)
    reported = fn(t)
    return {"result": t, "reported": reported, "sent": sum(sent), "messages": len(sent)}


def run_ring_all_reduce(fn, world_size: int, numel: int, seed: int = 0, timeout: float = 60) -> list:
    """Every rank calls ``fn(t)`` on its own tensor; per rank: the tensor after the call,
    the bytes ``fn`` returned, and the bytes it really sent (counted by the harness)."""
    return launch(_ring_worker, world_size, args=(fn, numel, seed), timeout=timeout)


def _collectives_worker(fn, numel, seed):
    comm = Communicator()
    t = rank_tensor(seed, comm.rank, numel)
    fn(t, comm)
    return {"result": t, "calls": {op: comm.ledger.count(op) for op in comm.ledger.by_op()},
            "bytes": comm.ledger.total_bytes()}


def run_all_reduce_via_collectives(fn, world_size: int, numel: int, seed: int = 0, timeout: float = 60) -> list:
    """Every rank calls ``fn(t, comm)`` with a ``zerolab.runtime.comm.Communicator``; per rank: the
    tensor after the call, the collectives it ran and the ring bytes the ledger counted."""
    return launch(_collectives_worker, world_size, args=(fn, numel, seed), timeout=timeout)


# ---------------------------------------------------------------- exercise 1: the engine's memory
def memory_model() -> nn.Module:
    """One unit (no ModuleList), 108 parameters: padding never shows on 2 ranks."""
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 4))


def _memory_worker(config):
    model = memory_model()
    engine = initialize(model, config)
    x = torch.randn(4, 8)
    loss = engine(x).float().pow(2).mean()
    engine.backward(loss)
    report = engine.memory()          # between backward and step: everything exists
    engine.step()
    return {"psi": engine.flat.numel, "params": report.params, "grads": report.grads,
            "optimizer": report.optimizer}


@functools.lru_cache(maxsize=None)
def engine_memory(stage: int, precision: str = "mixed", world_size: int = 2, timeout: float = 60) -> dict:
    """Rank 0's ``engine.memory()`` for a 108-parameter model under ``stage`` and ``precision``
    (Adam), measured between backward and step, plus the model's Ψ. Cached: it does not
    depend on the learner's code."""
    config = {"train_micro_batch_size_per_gpu": 4, "optimizer": {"type": "Adam", "params": {"lr": 1e-3}},
              "zero_optimization": {"stage": stage}}
    if stage == 3:   # a 108-parameter model would otherwise stay whole ("persistent", as in DeepSpeed)
        config["zero_optimization"]["stage3_param_persistence_threshold"] = 0
    if precision != "fp32":
        config["bf16"] = {"enabled": True}
    if precision == "mixed_fp32_grads":
        config["data_types"] = {"grad_accum_dtype": "fp32"}
    return launch(_memory_worker, world_size, args=(config,), timeout=timeout)[0]


def implemented_stages() -> list:
    from zerolab.engine import ENGINES
    return sorted(ENGINES)


# ---------------------------------------------------------------- exercise 3: flat partitions
def partition_model() -> nn.Module:
    """One unit of 26 parameters (15 + 3 + 6 + 2): 3 does not divide it."""
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(5, 3), nn.Tanh(), nn.Linear(3, 2))


def engine_shards(fn, world_size: int) -> list:
    """[(the engine's shard, fn's shard)] for every rank: ``FlatParams`` lays the model out,
    ``fn(list of parameter tensors, world_size, rank)`` builds the rank's shard."""
    from zerolab.engine.flat import FlatParams
    out = []
    for rank in range(world_size):
        model = partition_model()
        originals = [p.detach().clone() for p in model.parameters()]
        flat = FlatParams(model, world_size, rank, torch.float32, "cpu", policy=())   # the whole model: one unit
        (unit,) = flat.units
        out.append((flat.own_view(flat.flat, unit).clone(), fn(originals, world_size, rank)))
    return out


def _gather_worker(fn, numels, seed):
    comm = Communicator()
    params = [rank_tensor(seed, 0, n) for n in numels]          # the same parameters on every rank
    shard = fn(params, comm.world_size, comm.rank)                # (S,)
    full = torch.empty(comm.world_size * shard.numel(), dtype=shard.dtype)   # (N*S,)
    comm.all_gather(full, shard)
    return {"full": full, "shard_numel": shard.numel(), "bytes": comm.ledger.total_bytes()}


def run_gather_shards(fn, world_size: int, numels, seed: int = 0, timeout: float = 60) -> list:
    """Each rank builds its shard with ``fn`` and one all-gather rebuilds the flat buffer."""
    return launch(_gather_worker, world_size, args=(fn, list(numels), seed), timeout=timeout)


def params_for(numels, seed: int = 0) -> list:
    return [rank_tensor(seed, 0, n) for n in numels]


# ---------------------------------------------------------------- exercise 7: run the chosen config
def smoke_model() -> nn.Module:
    from zerolab.book.models import MLP
    torch.manual_seed(0)
    return MLP()


def _smoke_worker(config):
    model = smoke_model()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        engine = initialize(model, config)
    torch.manual_seed(engine.rank)
    x = torch.randn(config.get("train_micro_batch_size_per_gpu", 1), model.d_in)
    loss = engine(x).float().pow(2).mean()
    engine.backward(loss)
    total = engine.memory().total
    engine.step()
    return {"stage": engine.stage, "total": total, "loss": float(loss.detach())}


def run_config(config: dict, world_size: int = 2, timeout: float = 60) -> list:
    """Train one step of ``smoke_model()`` with ``config`` on ``world_size`` ranks; per rank the
    engine's stage, ``memory().total`` (between backward and step) and the loss."""
    return launch(_smoke_worker, world_size, args=(config,), timeout=timeout)


# ---------------------------------------------------------------- exercise 8: resharding
class ReshardNet(nn.Module):
    """Three units of 22, 16 and 15 parameters: "rest" (input 5 -> 3 and head 3 -> 1) and two blocks."""

    def __init__(self):
        super().__init__()
        self.inp = nn.Linear(5, 3)
        self.blocks = nn.ModuleList([nn.Linear(3, 4), nn.Linear(4, 3)])
        self.head = nn.Linear(3, 1)

    def forward(self, x):
        h = torch.tanh(self.inp(x))
        for block in self.blocks:
            h = torch.tanh(block(h))
        return self.head(h)


def reshard_model() -> nn.Module:
    torch.manual_seed(0)
    return ReshardNet()


def flat_shards(world_size: int, state: dict | None = None) -> tuple[list, list]:
    """(unit numels, per rank the list of its per-unit shards) as zerolab's ``FlatParams`` lays
    ``reshard_model()`` (with ``state`` loaded, if given) out on ``world_size`` ranks."""
    from zerolab.engine.flat import FlatParams
    shards = []
    for rank in range(world_size):
        model = reshard_model()
        if state is not None:
            model.load_state_dict(state)
        flat = FlatParams(model, world_size, rank, torch.float32, "cpu")
        shards.append([flat.own_view(flat.flat, u).clone() for u in flat.units])
    return [u.numel for u in flat.units], shards


def _master_worker(steps):
    config = {"train_micro_batch_size_per_gpu": 4, "bf16": {"enabled": True},
              "optimizer": {"type": "Adam", "params": {"lr": 0.05}}, "zero_optimization": {"stage": 1}}
    engine = initialize(reshard_model(), config)
    g = torch.Generator().manual_seed(engine.rank)
    for _ in range(steps):
        loss = engine(torch.randn(4, 5, generator=g)).float().pow(2).mean()
        engine.backward(loss)
        engine.step()
    state = engine.full_state_dict()       # collective: every rank calls it
    return {"master": [t.detach().clone() for t in engine.targets], "state": state}


@functools.lru_cache(maxsize=None)
def engine_master(world_size: int = 2, steps: int = 2, timeout: float = 60) -> list:
    """Per rank of a ZeRO-1 engine (bf16, Adam) after ``steps`` steps of ``reshard_model()``: its
    fp32 master, one tensor per unit (what its checkpoint file holds), and the consolidated
    fp32 state dict. Cached: it does not depend on the learner's code."""
    return launch(_master_worker, world_size, args=(steps,), timeout=timeout)
