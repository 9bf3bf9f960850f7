"""ZeRO++ runs on simulated nodes: bytes, memory, accuracy and speed, with their predictions (chapter 9).

Chapter 9 and ``python -m zerolab.bench.zeropp`` launch these on N ranks laid
out as nodes (``zl.launch(fn, N, ranks_per_node=K, ...)``). Every variant is
stage 3 in bf16 on a ``TinyGPT`` preset with the *measurement settings*:
persistence threshold 0, no prefetch, no reuse (``stage3_max_reuse_distance``
0), so each micro-step runs exactly the three collectives of the model (a
forward gather, a backward gather and the gradient reduction per unit), and
``zl.comm_breakdown`` can predict every byte.

* ``measure_variants``: per variant, the ledger's intra/inter algorithm bytes
  per step next to ``comm_breakdown``'s split, ``engine.memory()`` next to
  ``zl.estimate(..., hpz_partition_size=H)``, the rank-averaged loss curve and
  the error of one SGD update against exact ZeRO-3's.
* ``time_variants``: median step time on a simulated link per tier, next to
  the time model: the step measured without a link + the alpha-beta time of
  the predicted collectives on the links (no overlap: prefetch is off). A
  collective on a simulated link lasts the later of the backend's own transfer
  and the link's time, so this sum is an upper bound of the step on links.
"""
from __future__ import annotations

import os
import statistics
import time

import torch
import torch.distributed as dist

import zerolab.engine as engine_api
from zerolab.book.models import TinyGPT, loss_fn, synthetic_batch
from zerolab.runtime.nodes import node_links
from zerolab.theory.comm import comm_breakdown, split_intra_inter
from zerolab.theory.memory import estimate

VARIANTS = {"ZeRO-3": {}, "qwZ": {"zero_quantized_weights": True}, "hpZ": {"zero_hpz_partition_size": "K"},
            "qgZ": {"zero_quantized_gradients": True},
            "ZeRO++": {"zero_quantized_weights": True, "zero_hpz_partition_size": "K",
                       "zero_quantized_gradients": True}}


def variant_config(flags: dict, k: int, lr: float = 3e-3) -> dict:
    """The DeepSpeed-style config of one variant ("K" in ``flags``: the ranks per node)."""
    zero = {"stage": 3, "stage3_param_persistence_threshold": 0, "stage3_max_reuse_distance": 0,
            "stage3_prefetch_bucket_size": 0, **{key: k if v == "K" else v for key, v in flags.items()}}
    return {"optimizer": {"type": "Adam", "params": {"lr": lr}}, "bf16": {"enabled": True},
            "zero_optimization": zero}


def int_k() -> int:
    """This rank's node size (``zl.launch(..., ranks_per_node=K)`` sets ``LOCAL_WORLD_SIZE``)."""
    return int(os.environ.get("LOCAL_WORLD_SIZE", dist.get_world_size()))


def predicted_ops(e, units=None):
    """``comm_breakdown`` for engine ``e``'s model, flags, units and quantization groups.

    With qgZ the gradients are predicted bucket by bucket, as the engine reduces them: the units
    holding a matrix through qgZ with the bucket's group size, the units of vectors only through
    the plain 16-bit reduce-scatter (``zerolab.engine.zeropp.engine``'s docstring)."""
    z, units = e.config.zero, units or [u.numel for u in e.flat.units]
    k = e.communicator.ranks_per_node

    def ops(sizes, qgz=False, group=4096):
        return comm_breakdown(sum(sizes), e.world_size, 3, 2, 1, k, quantized_weights=z.zero_quantized_weights,
                              quantized_gradients=qgz, hpz=z.zero_hpz_partition_size, units=sizes,
                              weight_group=e.config.qwz_group_size, gradient_group=group)
    out = ops(units)
    if not z.zero_quantized_gradients:
        return out
    out = [op for op in out if not op.what.startswith("grads")]
    for i, bucket in enumerate(e.buckets):
        quantized = [u.numel for u in bucket if id(u) in e._qgz_units[i]]
        plain = [u.numel for u in bucket if id(u) not in e._qgz_units[i]]
        for sizes, qgz in ((quantized, True), (plain, False)):
            if sizes:
                out += [op for op in ops(sizes, qgz, e.qgz_groups[i]) if op.what.startswith("grads")]
    return out


def _step(e, model, s, n, rank, batch):
    x, y = synthetic_batch(model, batch * n, seed=5, step=s, rank=rank, world_size=n)
    loss = loss_fn(e(x), y)
    e.backward(loss)
    e.step()
    return loss.detach().float().reshape(1)


def _flat(state: dict) -> torch.Tensor:
    return torch.cat([v.float().reshape(-1) for v in state.values()])


def measure_variants(preset: str = "micro", steps: int = 30, batch: int = 4, variants=None) -> dict:
    """On every rank: per variant (the first one is the reference, exact ZeRO-3), bytes per step
    (measured and predicted), memory (measured and estimated), the loss curve (Adam) and the update
    error of one SGD step from the same weights, |Δθ - Δθ_ref| / |Δθ_ref| (SGD: Δθ = -lr·gradient,
    so it is the error of the gradient the step used, through the quantized forward and reduction)."""
    rank, n = dist.get_rank(), dist.get_world_size()
    out, ref = {}, None
    for name, flags in (variants or VARIANTS).items():
        model = TinyGPT.preset(preset, seed=1)
        e = engine_api.initialize(model, variant_config(flags, int_k()))
        e.comm.reset()
        losses = []
        for s in range(steps):
            loss = _step(e, model, s, n, rank, batch)
            dist.all_reduce(loss)
            losses.append(loss.item() / n)
        h = e.config.zero.zero_hpz_partition_size
        row = dict(inter=e.comm.total_bytes(scope="inter") / steps, intra=e.comm.total_bytes(scope="intra") / steps,
                   predicted=split_intra_inter(predicted_ops(e)), losses=losses, memory=e.memory().as_dict(),
                   estimate=estimate(e.flat.padded, n, 3, hpz_partition_size=h).as_dict(),
                   psi=e.flat.numel, ranks_per_node=e.communicator.ranks_per_node)
        e.close()
        model = TinyGPT.preset(preset, seed=1)
        cfg = {**variant_config(flags, int_k()), "optimizer": {"type": "SGD", "params": {"lr": 0.1}}}
        e = engine_api.initialize(model, cfg)
        before = _flat(e.full_state_dict())
        _step(e, model, 0, n, rank, batch)
        update = _flat(e.full_state_dict()) - before
        ref = update if ref is None else ref
        row["update_error"] = float((update - ref).norm() / ref.norm())
        out[name] = row
        e.close()
    return out


def modelled_comm_seconds(e, links) -> float:
    """Alpha-beta seconds of one step's predicted collectives: one per unit for the weights (as the
    engine issues them), one set per gradient bucket; a group spanning nodes runs at the inter link."""
    tiers = node_links(links)
    units = [u.numel for u in e.flat.units]

    def seconds(ops, keep):
        return sum(op.count * tiers["inter" if op.inter_node else "intra"].time(op.op, op.nbytes, op.group)
                   for op in ops if keep(op))
    weights = sum(seconds(predicted_ops(e, [u]), lambda op: op.what.startswith("params")) for u in units)
    return weights + seconds(predicted_ops(e, units), lambda op: op.what.startswith("grads"))


def time_variants(preset: str = "tiny", steps: int = 6, warmup: int = 2, batch: int = 4, links=None,
                  variants=None) -> dict:
    """On every rank: per variant, median step time (slowest rank) without a link and on ``links``,
    and the model, an upper bound: the no-link step + the modelled seconds of its collectives on the
    links (each collective lasts the later of loopback's transfer and the link's, never their sum)."""
    rank, n = dist.get_rank(), dist.get_world_size()
    out = {}
    for name, flags in (variants or VARIANTS).items():
        row = {}
        for label, link in (("nolink", None), ("link", links)):
            model = TinyGPT.preset(preset, seed=1)
            e = engine_api.initialize(model, variant_config(flags, int_k()), link=link)
            times = []
            for s in range(warmup + steps):
                dist.barrier()
                e.comm.reset()
                t = time.perf_counter()
                _step(e, model, s, n, rank, batch)
                dt = torch.tensor([time.perf_counter() - t])
                dist.all_reduce(dt, op=dist.ReduceOp.MAX)
                if s >= warmup:
                    times.append(float(dt))
            row[label] = statistics.median(times)
            if label == "link":
                row["modelled_comm"] = modelled_comm_seconds(e, links)
            e.close()
        row["modelled"] = row["nolink"] + row["modelled_comm"]
        out[name] = row
    return out
