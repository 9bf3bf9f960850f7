"""Training runs the engine chapters launch on N ranks, and their single-process reference (chapters 3-5).

The chapters call ``zl.launch(train_many, world_size=N, args=(configs,), kwargs=...)``:
every rank trains a ``TinyGPT`` preset with ``zl.initialize`` for a few steps
on synthetic data and returns what it measured — ``engine.memory()`` and a
census of live tensors between the last backward and step, the ledger's
collectives per optimizer step, step times, the engine's event timeline, and
(rank 0) the consolidated parameters. ``reference`` trains the same model in
one process with plain ``torch.optim`` on the same global batches, written
independently of the engine, so ``max_abs_diff`` between the two says
whether N ranks computed what one process computes.

Data: optimizer step s uses the global batch ``synthetic_batch(model,
N*g*B, seed, step=s)``; rank r's micro-batch k is rows ``[(k*N + r)*B, +B)``.
"""
from __future__ import annotations

import gc
import statistics
import time

import torch

from zerolab.config import Config
from zerolab.config.optimizer import OPTIMIZER_DEFAULTS
from zerolab.engine import events as ev
from zerolab.runtime.measure import settled_census
from zerolab.book.models import TinyGPT, loss_fn, synthetic_batch

PRECISION_KEYS = {"fp32": {}, "mixed": {"bf16": {"enabled": True}},
                  "mixed_fp32_grads": {"bf16": {"enabled": True}, "data_types": {"grad_accum_dtype": "fp32"}}}
FORWARD = "forward"   # the book's own mark: a forward pass starts (stages 0-2 emit no forward events)
_DONE = {ev.REDUCE_DONE: ev.REDUCE_ISSUED, ev.GATHER_DONE: ev.GATHER_ISSUED}


def ds_config(stage, *, precision="fp32", optimizer="Adam", lr=3e-3, weight_decay=0.0, bucket=None,
              gather_bucket=None, overlap=None, gas=1, clip=0.0, link=None, trace=False,
              collectives="reduce_scatter") -> dict:
    """A DeepSpeed-style config dict (the keys a DeepSpeed user writes); None leaves DeepSpeed's default.
    ``collectives``: stages 1-2's pair (engine/stage1.py); the book's runs default to the ring
    algorithm's reduce-scatter + all-gather, whose bytes the formulas give ("per_backend": gloo's pair)."""
    zero = {"stage": stage}
    if bucket is not None:
        zero["reduce_bucket_size"] = bucket
    if gather_bucket is not None:
        zero["allgather_bucket_size"] = gather_bucket
    if overlap is not None:
        zero["overlap_comm"] = overlap
    params = {"lr": lr, "weight_decay": weight_decay}
    if optimizer == "SGD":
        params["momentum"] = 0.9
    cfg = {"optimizer": {"type": optimizer, "params": params}, "gradient_accumulation_steps": gas,
           "gradient_clipping": clip, "zero_optimization": zero, **PRECISION_KEYS[precision]}
    if link or trace:
        cfg["zerolab"] = {"link": link, "trace": trace}
    if stage in (1, 2) and collectives != "per_backend":
        cfg.setdefault("zerolab", {})["collectives"] = collectives
    return cfg


def make_model(preset="micro", model_seed=1, key_bias=False):
    """The chapters' model: TinyGPT without the attention key bias (its true gradient is
    exactly zero, so Adam turns rounding noise there into ±lr steps; chapter 3).
    ``preset``: a name in ``models.PRESETS`` or a dict of TinyGPT keyword arguments."""
    if isinstance(preset, dict):
        return TinyGPT(**preset, key_bias=key_bias, seed=model_seed)
    return TinyGPT.preset(preset, key_bias=key_bias, seed=model_seed)


def micro_batch(model, step, k, rank, n, gas, batch_per_rank, seed):
    """Rank ``rank``'s micro-batch ``k`` of optimizer step ``step``: (B, T) inputs and targets."""
    x, y = synthetic_batch(model, n * gas * batch_per_rank, seed=seed, step=step)
    lo = (k * n + rank) * batch_per_rank
    return x[lo: lo + batch_per_rank], y[lo: lo + batch_per_rank]


def train(config, preset="micro", steps=3, batch_per_rank=2, seed=7, model_seed=1, key_bias=False,
          check_census=False, watch_backward=False, state=True) -> dict:
    """Inside a launched rank: train with ``zl.initialize(model, config)``; return what was measured.

    ``check_census``: count live tensors before the model exists and between the
    last backward and step, so the caller can compare with ``engine.memory()``.
    ``watch_backward``: sample ``engine.memory()`` after every gradient during
    backward (a hook that runs after the engine's): the most grads + buffers it held.
    """
    import torch.distributed as dist

    from zerolab.engine import initialize
    rank, n = (dist.get_rank(), dist.get_world_size()) if dist.is_initialized() else (0, 1)
    if check_census:
        gc.collect()
        gc.freeze()              # what this forked rank inherited leaves the census's walk
        base = settled_census()
    model = make_model(preset, model_seed, key_bias)
    engine = initialize(model, config)
    gas = engine.gas
    engine.comm.reset()          # the broadcast at initialize is not part of a step
    peak = {"grads+buffers": 0}
    hooks = []
    if watch_backward:
        def sample(_p):
            m = engine.memory()
            peak["grads+buffers"] = max(peak["grads+buffers"], m.grads + m.buffers)
        hooks = [p.register_post_accumulate_grad_hook(sample) for p in engine.flat.params()]
    out = {"rank": rank, "world_size": n, "psi": engine.flat.numel, "padded": engine.flat.padded,
           "units": [(u.name, u.numel, u.padded, u.shard) for u in engine.flat.units],
           "buckets": [sum(u.padded for u in b) for b in engine.buckets],
           "records": [], "step_seconds": [], "losses": [], "events": []}
    for step in range(steps):
        seen = len(engine.comm.records)
        if engine.events is not None:
            engine.events.clear()
        t0 = time.perf_counter()
        fwd = []
        for k in range(gas):
            x, y = micro_batch(model, step, k, rank, n, gas, batch_per_rank, seed)
            fwd.append(time.perf_counter())
            loss = loss_fn(engine(x), y)
            engine.backward(loss)
            out["losses"].append(float(loss.detach()))
            del x, y, loss
            if step == steps - 1 and k == gas - 1:      # between the last backward and its step
                out["memory"] = engine.memory().as_dict()
                if check_census:
                    out["census"] = settled_census() - base
            engine.step()
        out["step_seconds"].append(time.perf_counter() - t0)
        out["records"].append([(r.op, r.bytes, r.numel, r.dtype, r.tag, r.seconds)
                               for r in engine.comm.records[seen:]])
        if engine.events is not None:
            out["events"].append([(FORWARD, -1, t) for t in fwd] + list(engine.events))  # this step's timeline
    for h in hooks:
        h.remove()
    out["peak_backward"] = peak["grads+buffers"]
    sd = engine.full_state_dict()
    out["state"] = sd if (state and rank == 0) else None
    out["params_checksum"] = float(sum(v.double().sum() for k, v in sd.items() if v.is_floating_point()))
    engine.close()
    if check_census:
        gc.unfreeze()
    return out


def train_many(configs, **kwargs) -> list:
    """Inside a launched rank: ``train`` each config in turn (one launch, many runs)."""
    return [train(c, **kwargs) for c in configs]


def reference(config, world_size, preset="micro", steps=3, batch_per_rank=2, seed=7, model_seed=1,
              key_bias=False) -> dict:
    """One process, plain ``torch.optim``, each optimizer step on the whole global batch
    (N ranks x g micro-batches x B rows): the parameters N-rank training must reach."""
    model = make_model(preset, model_seed, key_bias)
    o = Config.from_deepspeed({"optimizer": config["optimizer"]}).optimizer   # "Adam": AdamW, as DeepSpeed's
    kind = {"adam": torch.optim.Adam, "adamw": torch.optim.AdamW, "sgd": torch.optim.SGD}[o.type]
    opt = kind(model.parameters(), **{**OPTIMIZER_DEFAULTS[o.type], **o.params})
    gas = config.get("gradient_accumulation_steps", 1)
    clip = config.get("gradient_clipping", 0.0)
    for step in range(steps):
        x, y = synthetic_batch(model, world_size * gas * batch_per_rank, seed=seed, step=step)
        opt.zero_grad()
        loss_fn(model(x), y).backward()        # mean over the global batch
        if clip:
            torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
        opt.step()
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def max_abs_diff(a: dict, b: dict) -> float:
    """Largest |a - b| over every tensor of two state dicts with the same keys."""
    assert a.keys() == b.keys(), sorted(set(a) ^ set(b))
    return max(float((a[k].double() - b[k].double()).abs().max()) for k in a)


# ---------------------------------------------------------------- summaries the chapters print
def collectives(run, step=-1) -> list:
    """[(op, numel, bytes)] of one optimizer step's collectives, in issue order."""
    return [(op, numel, nbytes) for op, nbytes, numel, _, _, _ in run["records"][step]]


def bytes_by_op(run, step=-1) -> dict:
    out = {}
    for op, nbytes, *_ in run["records"][step]:
        out[op] = out.get(op, 0) + nbytes
    return out


def median_step(runs, skip=1) -> float:
    """Median over steps (after ``skip`` warm-up steps) of the slowest rank's step time, seconds."""
    per_step = [max(r["step_seconds"][i] for r in runs) for i in range(skip, len(runs[0]["step_seconds"]))]
    return statistics.median(per_step)


def timeline(run, step=-1) -> list:
    """Rows for ``plots.plot_timeline`` from one rank's event timeline (config ``"zerolab": {"trace": true}``).

    ``[("compute", spans), ("grads, bucket 0", spans), ...]`` with spans ``(kind, start, end)``:
    compute is forward (its start -> backward start), backward (-> backward end) and the optimizer
    step; each collective row runs from issue to the moment the engine waited for it.
    """
    events = sorted(run["events"][step], key=lambda e: e[2])
    compute, comm, open_, last = [], {}, {}, {}
    for name, i, t in events:
        if name in (FORWARD, ev.BACKWARD_START, ev.STEP_START):
            if name == ev.BACKWARD_START and FORWARD in last:
                compute.append(("forward", last.pop(FORWARD), t))
            last[name] = t
        elif name == ev.BACKWARD_END and ev.BACKWARD_START in last:
            compute.append(("backward", last.pop(ev.BACKWARD_START), t))
        elif name == ev.STEP_END and ev.STEP_START in last:
            compute.append(("optimizer step", last.pop(ev.STEP_START), t))
        elif name in (ev.REDUCE_ISSUED, ev.GATHER_ISSUED):
            open_[(name, i)] = t
        elif name in _DONE and (_DONE[name], i) in open_:
            what = ("grads", "grad reduction") if name == ev.REDUCE_DONE else ("params", "param all-gather")
            comm.setdefault((what[0], i), []).append((what[1], open_.pop((_DONE[name], i)), t))
    return [("compute", compute)] + [(f"{w}, bucket {i}", spans) for (w, i), spans in sorted(comm.items())]


def exposed_comm(run, overlap, skip=1) -> float:
    """Seconds per step this rank spent blocked on collectives (median over steps after ``skip``).

    The rank is blocked during each gradient reduction's whole duration without ``overlap_comm``
    (it blocks backward), only during the part that outlives backward with it, and during the
    parameter all-gathers after the step (stages 1-2 wait for them). Collectives in flight at the
    same time block the rank once: the exposed time is the length of the *union* of these
    intervals, never more than the step.
    """
    return statistics.median([_union_length(blocked_intervals(run, overlap, s))
                              for s in range(skip, len(run["events"]))])


def blocked_intervals(run, overlap, step=-1) -> list:
    """``[(start, end)]``: the intervals of one step in which this rank waited on a collective."""
    rows = timeline(run, step)
    bwd_end = max(e for k, _, e in rows[0][1] if k == "backward")
    out = []
    for label, spans in rows[1:]:
        for kind, s, e in spans:
            if kind == "grad reduction" and overlap:
                s = max(s, bwd_end)
            if e > s:
                out.append((s, e))
    return out


def _union_length(spans) -> float:
    total, end = 0.0, float("-inf")
    for s, e in sorted(spans):
        if e > end:
            total += e - max(s, end)
            end = e
    return total


def plot_timeline(run, ax=None, title=None, step=-1):
    """``plots.plot_timeline`` of ``timeline(run, step)``, rows labelled compute / collective."""
    from zerolab.book import plots
    rows = timeline(run, step)
    ax = plots.plot_timeline([spans for _, spans in rows], ax=ax, title=title)
    ax.set_yticks(range(len(rows)), [label for label, _ in rows])
    ax.set_ylabel("")
    return ax
