"""Harnesses for the engine exercises (4: ZeRO-1 step, 5: ZeRO-2 gradients, 6: ZeRO-3 prefetch).

The learner's function is called inside ``zl.launch`` ranks on the engine's own
pieces: the model is laid out by ``zerolab.engine.flat.FlatParams`` (flat,
padded per-unit buffers), collectives go through a ``zerolab.runtime.comm.Communicator``
(so the ledger sees every byte), and the reference is zerolab's engine or a
plain computation done here with raw ``torch.distributed`` (outside the
learner's ledger). Results come back as plain values for the check cells.
"""
from __future__ import annotations

import time
from types import SimpleNamespace

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from zerolab.engine import initialize
from zerolab.runtime.launch import launch
from zerolab.runtime.comm import Communicator
from zerolab.engine.flat import FlatParams
from zerolab.engine.buckets import group_units
from zerolab.book.models import MLP


def _batch(step: int, rank: int, d_in: int = 16, d_out: int = 4, size: int = 4):
    g = torch.Generator().manual_seed(100 * step + rank)
    return torch.randn(size, d_in, generator=g), torch.randn(size, d_out, generator=g)


def _local_grads(model, flat, x, y) -> torch.Tensor:
    """Backward of this rank's loss; the gradients copied into a flat padded buffer (padded,)."""
    for p in model.parameters():
        p.grad = None
    F.mse_loss(model(x), y).backward()
    g = torch.zeros(flat.padded)                                  # (padded,) fp32, zero padding
    views = flat.param_views(g)
    for p in flat.params():
        views[id(p)].copy_(p.grad)
        p.grad = None
    return g


# ---------------------------------------------------------------- exercise 4: the ZeRO-1 step
def _zero1_worker(step_fn, steps, lr):
    rank, n = dist.get_rank(), dist.get_world_size()
    comm = Communicator()
    model = MLP(seed=0)
    flat = FlatParams(model, n, rank, torch.float32, "cpu")       # flat.flat: (padded,), padded % N == 0
    shard = flat.padded // n
    state = {"m": torch.zeros(shard), "v": torch.zeros(shard), "step": 0}   # Adam state: 2 x S fp32
    engine = initialize(MLP(seed=0), {"train_micro_batch_size_per_gpu": 4,
                                        "optimizer": {"type": "Adam", "params": {"lr": lr}},
                                        "zero_optimization": {"stage": 1},
                                        "zerolab": {"collectives": "reduce_scatter"}})   # the ring pair
    engine.comm.reset()
    grad_errors = []
    for step in range(steps):
        x, y = _batch(step, rank)
        g = _local_grads(model, flat, x, y)
        mean = g.clone()
        dist.all_reduce(mean)                                     # the reference, off the learner's ledger
        mean /= n
        got = step_fn(comm, flat.flat, g, state, lr)
        want = mean[rank * shard: (rank + 1) * shard]
        grad_errors.append(float("inf") if got is None or got.shape != want.shape else
                           float((got - want).abs().max()))
        engine.backward(F.mse_loss(engine(x), y))
        engine.step()
    return {"params": flat.flat.clone(), "engine_params": engine.flat.flat.clone(), "grad_errors": grad_errors,
            "state_numel": (state["m"].numel(), state["v"].numel()), "step": state["step"], "shard": shard,
            "padded": flat.padded, "calls": {op: comm.ledger.count(op) for op in comm.ledger.by_op()},
            "bytes": comm.ledger.by_op(), "engine_bytes": engine.comm.by_op()}


def run_zero1(step_fn, world_size: int, steps: int = 3, lr: float = 1e-2, timeout: float = 90) -> list:
    """Train ``MLP()`` for ``steps`` steps on ``world_size`` ranks twice: with ``step_fn`` doing
    the optimizer step, and with zerolab's ZeRO-1 engine on the same data. Per rank: both
    final flat parameter buffers, the error of each returned gradient shard, and the ledgers."""
    return launch(_zero1_worker, world_size, args=(step_fn, steps, lr), timeout=timeout)


# ---------------------------------------------------------------- exercise 5: ZeRO-2 gradient buckets
def engine_buckets(numels, bucket_elems) -> list:
    """The engine's bucketing rule (``group_units``) applied to parameters of these sizes."""
    units = [SimpleNamespace(index=i, padded=n) for i, n in enumerate(numels)]
    return [[u.index for u in b] for b in group_units(units, bucket_elems)]


def _zero2_worker(bucketer_cls, bucket_elems):
    rank, n = dist.get_rank(), dist.get_world_size()
    comm = Communicator()
    phase = {"backward": False}
    issued = []                                                   # (in backward?, input elements)
    reduce_scatter = comm.reduce_scatter

    def watched(output, input, *a, **k):
        issued.append((phase["backward"], input.numel()))
        return reduce_scatter(output, input, *a, **k)
    comm.reduce_scatter = watched

    model, twin = MLP(seed=0), MLP(seed=0)
    params = list(model.parameters())
    bucketer = bucketer_cls(params, comm, bucket_elems)
    for p in params:
        p.register_post_accumulate_grad_hook(bucketer.on_grad)
    x, y = _batch(0, rank)
    phase["backward"] = True
    F.mse_loss(model(x), y).backward()
    phase["backward"] = False
    got = bucketer.finish()

    F.mse_loss(twin(x), y).backward()                             # the reference: plain full gradients
    grads = [p.grad for p in twin.parameters()]
    want = []
    for b in engine_buckets([p.numel() for p in params], bucket_elems):
        flat = torch.cat([grads[i].reshape(-1) for i in b])
        padded = -(-flat.numel() // n) * n
        full = torch.zeros(padded)                                # (padded,) this bucket, zero padding
        full[:flat.numel()] = flat
        dist.all_reduce(full)
        want.append(full.view(n, -1)[rank] / n)                   # (padded / N,) rank's mean shard
    want = torch.cat(want)
    return {"shard": got, "want": want, "issued": issued, "grads_left": sum(p.grad is not None for p in params),
            "bytes": comm.ledger.total_bytes("reduce_scatter"), "calls": comm.ledger.count()}


def run_zero2(bucketer_cls, world_size: int, bucket_elems: int, timeout: float = 60) -> list:
    """One backward of ``MLP()`` per rank with ``bucketer_cls(params, comm, bucket_elems)`` hooked
    into every parameter; per rank: its shard, the reference shard and what was issued when."""
    return launch(_zero2_worker, world_size, args=(bucketer_cls, bucket_elems), timeout=timeout)


# ---------------------------------------------------------------- exercise 6: ZeRO-3 prefetch
class Tower(nn.Module):
    """Linear + tanh units of different widths, in ``.blocks`` (the engine's units)."""

    def __init__(self, widths=(8, 24, 8, 16, 32, 8)):
        super().__init__()
        torch.manual_seed(0)
        self.blocks = nn.ModuleList(nn.Linear(a, b) for a, b in zip(widths[:-1], widths[1:]))

    def forward(self, x):
        for b in self.blocks:
            x = torch.tanh(b(x))
        return x


def tower_numels() -> list:
    return [sum(p.numel() for p in b.parameters()) for b in Tower().blocks]


def _zero3_worker(schedule, link, compute_s):
    rank, n = dist.get_rank(), dist.get_world_size()
    comm = Communicator(link=link)
    model = Tower()
    x = torch.randn(4, model.blocks[0].in_features, generator=torch.Generator().manual_seed(1))
    want = model(x).detach()
    flat = FlatParams(model, n, rank, torch.float32, "cpu")
    units = flat.units                                            # one per block, in forward order
    shards = [flat.own_view(flat.flat, u).clone() for u in units]  # (S_u,): all a rank keeps
    flat.flat.zero_()                                             # the full parameters are gone
    live, peak, gathered, order = {}, 0, {}, []
    t0 = time.perf_counter()
    for op, i in schedule:
        u = units[i]
        if op == "fetch":
            buf = torch.empty(u.padded)                           # (padded_u,) the gathered unit
            gathered[i] = (comm.all_gather(buf, shards[i], async_op=True, tag=f"unit-{i}"), buf)
            live[i] = u.numel
            peak = max(peak, sum(live.values()))
        elif op == "compute":
            h, buf = gathered[i]
            h.wait()
            block = model.blocks[i]
            w = buf[:block.weight.numel()].view_as(block.weight)
            b = buf[block.weight.numel(): u.numel]
            x = torch.tanh(F.linear(x, w, b))
            if compute_s:
                time.sleep(compute_s)                             # stands in for a big unit's compute
            order.append(i)
        elif op == "release":
            gathered.pop(i)
            live.pop(i)
    return {"out": x, "want": want, "peak": peak, "computed": order, "gathers": comm.ledger.count("all_gather"),
            "bytes": comm.ledger.total_bytes("all_gather"),
            "padded": [u.padded for u in units], "wall": time.perf_counter() - t0}


def run_schedule(schedule, world_size: int = 2, link=None, compute_s: float = 0.0, timeout: float = 60) -> list:
    """Run ``Tower()``'s forward from parameter shards on ``world_size`` ranks, following
    ``schedule`` (a list of ("fetch" | "compute" | "release", unit)); fetches are async
    all-gathers. Per rank: the output and the reference, the peak of live gathered elements,
    the order units were computed in, the all-gathers the ledger saw and the wall time.
    ``link``: a simulated link; ``compute_s``: seconds each compute also sleeps."""
    return launch(_zero3_worker, world_size, args=(list(schedule), link, compute_s), timeout=timeout)


def check_schedule(schedule, order, numels, prefetch_elems, max_live_elems) -> str:
    """'' if ``schedule`` computes ``order`` correctly and prefetches exactly as the rules of
    exercise 6 say (greedy, in order, within both budgets), else what is wrong."""
    pos = {u: k for k, u in enumerate(order)}
    fetched, live, computed = set(), {}, []
    for k, ev in enumerate(schedule):
        if not (isinstance(ev, tuple) and len(ev) == 2 and ev[0] in ("fetch", "compute", "release")):
            return f"event {k} {ev!r}: expected ('fetch' | 'compute' | 'release', unit)"
        op, u = ev
        if u not in pos:
            return f"event {k} {ev!r}: unit {u} is not in the order {list(order)}"
        now = len(computed)                                 # position of the unit to compute next
        if now == len(order) and op != "release":
            return f"event {k} {ev!r}: every unit was already computed"
        current = order[now] if now < len(order) else None
        ahead = sum(numels[v] for v in live if pos[v] > now)
        if op == "fetch":
            if u in fetched:
                return f"event {k}: unit {u} fetched twice"
            if u != current:                                # a prefetch
                nxt = next((v for v in order[now + 1:] if v not in fetched), None)
                if u != nxt:
                    return f"event {k}: prefetched unit {u}, but the next unit not yet fetched is {nxt}"
                if current not in fetched:
                    return f"event {k}: prefetched unit {u} before fetching unit {current}, which is needed now"
                if ahead + numels[u] > prefetch_elems:
                    return (f"event {k}: prefetching unit {u} puts {ahead + numels[u]} elements in flight "
                            f"ahead of unit {current} > prefetch_elems {prefetch_elems}")
                if sum(live.values()) + numels[u] > max_live_elems:
                    return (f"event {k}: prefetching unit {u} makes {sum(live.values()) + numels[u]} elements "
                            f"live > max_live_elems {max_live_elems}")
            fetched.add(u)
            live[u] = numels[u]
        elif op == "compute":
            if u != current:
                return f"event {k}: computed unit {u}, but unit {current} comes first"
            if u not in live:
                return f"event {k}: unit {u} computed before it was fetched"
            nxt = next((v for v in order[now + 1:] if v not in fetched), None)
            if nxt is not None and ahead + numels[nxt] <= prefetch_elems \
                    and sum(live.values()) + numels[nxt] <= max_live_elems:
                return (f"event {k}: unit {nxt} ({numels[nxt]} elements) fits both budgets "
                        f"({ahead} elements ahead, {sum(live.values())} live) but was not prefetched")
            computed.append(u)
        else:
            if u not in computed or u not in live:
                return f"event {k}: unit {u} released before it was computed (or twice)"
            if u != computed[-1]:
                return f"event {k}: release unit {u} right after computing it"
            live.pop(u)
    if computed != list(order):
        return f"units computed: {computed}, expected {list(order)}"
    if live:
        return f"units {sorted(live)} never released"
    return ""


def _stage3_worker(prefetch_elems, max_live_elems):
    config = {"train_micro_batch_size_per_gpu": 4, "optimizer": {"type": "Adam", "params": {"lr": 1e-3}},
              "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0,
                                    "stage3_prefetch_bucket_size": prefetch_elems,
                                    "stage3_max_live_parameters": max_live_elems,
                                    "stage3_max_reuse_distance": 0},
              "zerolab": {"trace": True}}
    engine = initialize(Tower(), config)
    for step in range(2):               # the first micro-step records the unit order; the second prefetches
        engine.events.clear()
        x = torch.randn(4, 8, generator=torch.Generator().manual_seed(step))
        loss = engine(x).pow(2).mean()
        events = [(name, i) for name, i, _ in engine.events]
        engine.backward(loss)
        engine.step()
    issued, by_end = set(), []
    for name, i in events:              # the second forward's timeline
        if name == "gather-issued":
            issued.add(i)               # (a unit issued again is backward's prefetch: not counted)
        elif name == "unit-fwd-end":
            by_end.append(len(issued))
    return {"issued_by_end": by_end, "numels": [u.padded for u in engine.flat.units]}


def engine_prefetch(prefetch_elems: int, max_live_elems: int, world_size: int = 2, timeout: float = 60) -> dict:
    """zerolab's ZeRO-3 engine on ``Tower()`` with these budgets (reuse distance 0, no persistent
    units): for each unit of the second forward, how many units' all-gathers had been issued by
    the end of its compute; and the units' (padded) sizes. Rank 0's view."""
    return launch(_stage3_worker, world_size, args=(prefetch_elems, max_live_elems), timeout=timeout)[0]


def issued_by_compute(schedule) -> list:
    """For each compute event of ``schedule``: how many fetches were issued before it."""
    issued, out = 0, []
    for op, _ in schedule:
        if op == "fetch":
            issued += 1
        elif op == "compute":
            out.append(issued)
    return out
