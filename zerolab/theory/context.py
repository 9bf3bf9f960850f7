"""What context parallelism sends per optimizer step (chapter 11).

Notation as ``theory/comm3d.py``: b = ``micro_batch`` (sequences per micro-batch and
DP rank), s = ``seq`` (the whole sequence), h = ``hidden`` (query heads × head dim,
per TP rank: h/tp when the heads are split by TP too), h_kv = ``kv_hidden`` (key/value
heads × head dim; h without grouped-query attention), a = ``act_bytes``, L = ``layers``
whose attention is context-parallel, m = micro-batches per step, cp = the ``"cp"``
group's size. A rank holds s/cp tokens, so its q (and its attention output) is
Q = b·(s/cp)·h·a bytes and its k (and its v) K = b·(s/cp)·h_kv·a.

**Ulysses** (``zerolab.parallel.context_ulysses``), per layer and micro-batch: forward
all-to-alls of q, k, v (sequence-split to head-split) and of the output back;
backward the inverse all-to-all of each of their gradients::

    forward    all-to-all Q x 2 (q, output)      all-to-all K x 2 (k, v)
    backward   all-to-all Q x 2                  all-to-all K x 2

An all-to-all of a tensor of N bytes over cp ranks sends N·(cp-1)/cp of it (each rank
keeps its own piece): per layer, forward and backward together, 4·(Q + K)·(cp-1)/cp —
falling as 1/cp, constant when s and cp grow together (DeepSpeed-Ulysses' point).

**Ring** (``zerolab.parallel.context_ring``), per layer and micro-batch, each a
point-to-point send to the next rank of the ring::

    forward    (cp-1) sends of the K/V chunk                      2K bytes each
    backward   (cp-1) sends of the K/V chunk with its dK/dV       4K bytes each
               1 send bringing the dK/dV accumulators home         2K bytes

Every rank sends the same (the causal mask skips compute, not sends): (6cp - 4)·K per
layer, tending to 6·b·s·h_kv·a whatever cp. The engine's
ledger books both under ``group="cp"``: ``engine.comm.total_bytes(group="cp")``
(``mesh.ledger``) equals ``context_bytes`` (tests/test_context_parallel.py).

With cp > 1 the gradients of the parameters are averaged over dp·cp ranks:
``comm_breakdown(..., cp=)`` lists ZeRO's ops over that group (``axis="dp_cp"``, the
engine's communicator, ``Mesh.grad_group``) beside these (``axis="cp"``).
"""
from __future__ import annotations

from zerolab.theory.network import ring_bytes

METHODS = ("ulysses", "ring")


def _int(name, v):
    if isinstance(v, bool) or not isinstance(v, int) or v < 1:
        raise ValueError(f"{name} must be an integer >= 1, got {v!r}")
    return v


def _sizes(cp, method, layers, hidden, micro_batch, seq, act_bytes, kv_hidden):
    if method not in METHODS:
        raise ValueError(f"cp_method must be one of {METHODS}, got {method!r}")
    need = dict(layers=layers, hidden=hidden, micro_batch=micro_batch, seq=seq)
    missing = [k for k, v in need.items() if v is None]
    if missing:
        raise ValueError(f"cp={cp} needs {', '.join(k + '=' for k in missing)} (context parallelism moves q, k, v "
                         f"of s/cp tokens per layer and micro-batch)")
    for k, v in dict(need, cp=cp).items():
        _int(k, v)
    if act_bytes not in (1, 2, 4):
        raise ValueError(f"act_bytes must be one of (1, 2, 4), got {act_bytes!r}")
    if seq % cp:
        raise ValueError(f"cp={cp} does not divide seq={seq}: every rank holds s/cp tokens")
    kv_hidden = hidden if kv_hidden is None else _int("kv_hidden", kv_hidden)
    tokens = micro_batch * seq // cp
    return tokens * hidden * act_bytes, tokens * kv_hidden * act_bytes


def context_ops(cp, method, m, layers, hidden, micro_batch, seq, act_bytes, kv_hidden=None, tp=1,
                gpus_per_node=None) -> list:
    """The ``"cp"`` group's collectives of one rank per optimizer step, as ``CommOp`` keyword dicts
    (module docstring). ``tp``: a cp group strides over tp ranks, so it spans tp·cp consecutive ranks
    (crossing nodes when that exceeds ``gpus_per_node``; the ring's crossing is its busiest rank's)."""
    q, k = _sizes(cp, method, layers, hidden, micro_batch, seq, act_bytes, kv_hidden)
    if cp == 1:
        return []
    per_node = cp if gpus_per_node is None else max(1, min(cp, gpus_per_node // tp))
    inter = per_node < cp
    n = m * layers
    if method == "ulysses":
        common = dict(op="all_to_all", group=cp, per_node=per_node, inter_node=inter,
                      inter_share=(cp - per_node) / (cp - 1), axis="cp")
        return [dict(what="q-out-forward", nbytes=q, count=2 * n, **common),
                dict(what="kv-forward", nbytes=k, count=2 * n, **common),
                dict(what="q-out-backward", nbytes=q, count=2 * n, **common),
                dict(what="kv-backward", nbytes=k, count=2 * n, **common)]
    common = dict(op="send", group=2, per_node=1 if inter else 2, inter_node=inter, inter_share=float(inter),
                  axis="cp")
    return [dict(what="kv-forward", nbytes=2 * k, count=(cp - 1) * n, **common),
            dict(what="kv-dkv-backward", nbytes=4 * k, count=(cp - 1) * n, **common),
            dict(what="dkv-home", nbytes=2 * k, count=n, **common)]


def context_bytes(cp, method, layers, hidden, micro_batch, seq, act_bytes=4, kv_hidden=None, m=1,
                  backward=True) -> int:
    """Bytes one rank of the ``"cp"`` group sends per step for ``m`` micro-batches (module docstring);
    ``backward=False``: the forward passes only."""
    total = 0
    for d in context_ops(cp, method, m, layers, hidden, micro_batch, seq, act_bytes, kv_hidden):
        if backward or d["what"].endswith("forward"):
            each = d["nbytes"] if d["op"] == "send" else ring_bytes(d["op"], d["nbytes"], d["group"])
            total += d["count"] * each
    return total


def with_context(breakdown, op_class, args: dict) -> list:
    """``comm_breakdown(**args)`` with ``args["cp"]`` > 1 (``theory.comm`` passes itself and ``CommOp``):
    its ZeRO ops over the n/(tp·pp) = dp·cp ranks booked under ``"dp_cp"``, then ``context_ops``."""
    cp, method = args.pop("cp"), args.pop("cp_method")
    tp, hidden = args["tp"], args["hidden"]
    ops = context_ops(cp, method, args["grad_accum"], args["layers"], hidden // tp if hidden else hidden,
                      args["micro_batch"], args["seq"], args["act_bytes"] or args["dtype_bytes"], tp=tp,
                      gpus_per_node=args["gpus_per_node"])
    base = breakdown(**args)
    return [op_class(**dict(vars(o), axis="dp_cp")) if o.axis == "dp" else o for o in base] + \
        [op_class(**d) for d in ops]


__all__ = ["METHODS", "context_ops", "context_bytes", "with_context"]
