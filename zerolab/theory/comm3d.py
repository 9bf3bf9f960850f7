"""What tensor and pipeline parallelism send per optimizer step (chapter 10).

``comm_breakdown(psi, n_gpus, stage, tp=, pp=, ...)`` (``theory.comm``) lists a rank's
collectives on three axes; this file is the arithmetic of the two model-parallel ones. Notation:
b = ``micro_batch`` (sequences per micro-batch and DP rank), s = ``seq``, h = ``hidden``,
a = ``act_bytes`` (bytes per activation element), m = micro-batches per optimizer step (the
``grad_accum`` of a DP rank), L = ``layers``. One activation is A = b·s·h·a bytes.

**TP** (axis ``"tp"``, a group of ``tp`` consecutive ranks inside a node). Megatron-LM (Shoeybi et
al. 2019, section 3) puts one all-reduce of A after each row-parallel layer in forward (the
operator g: after the attention's projection and after the MLP's second layer) and one before
each column-parallel layer in backward (f): per transformer block 2 in forward and 2 in backward
when q, k and v are one fused layer (``qkv_fused=True``, Megatron's). TinyGPT's plan
(``zerolab.parallel.GPT_PLAN``) has q, k, v as three layers, one f each: 4 in backward
(``qkv_fused=False``). The vocabulary-parallel embedding adds a g in forward (its output is a
partial sum), the column-parallel head an f in backward, and the vocabulary-parallel
cross-entropy 3 all-reduces of b·s fp32 values (max, target logit, sum of exponentials) — on
the first stage, the last stage and the last stage respectively. Per micro-batch, on a stage
holding B blocks:

    forward   all-reduce A  x  2B (+1 on the first stage)
    backward  all-reduce A  x  2B or 4B (+1 on the last stage)
    loss      all-reduce b·s·4 bytes  x  3 (last stage)

``sequence_parallel=True`` (Korthikanti et al. 2022): each g becomes a reduce-scatter in forward
and an all-gather in backward, each f an all-gather in forward and a reduce-scatter in backward
(one f per block for q, k, v together: the gathered input serves all three): the same bytes as
the all-reduces under the ring model, the activations between them split along the sequence.

**PP** (axis ``"pp"``): point to point, one send of A per micro-batch and stage boundary
forward (the activation, from stages 0 .. p-2) and one backward (its gradient, from stages
1 .. p-1). Every TP rank of a stage sends its own copy (zerolab's ``train_batch``; Megatron's
scatter/gather optimisation that sends 1/tp of it is not modelled). ``train_batch`` then
broadcasts the mean loss (one fp32) from the last stage over the PP group: a chain in which
every stage but p-2 sends it on.

Blocks split over stages as ``zerolab.parallel.split_blocks`` splits them: contiguous, sizes
differing by at most one, the larger first; the embedding on the first stage, the final
LayerNorm, head and loss on the last.
"""
from __future__ import annotations


def stage_blocks(layers: int, pp: int) -> list:
    """Blocks on each of ``pp`` stages (``zerolab.parallel.split_blocks``'s split)."""
    if pp > layers:
        raise ValueError(f"pp={pp} is larger than the number of blocks (layers={layers}): every stage needs a block")
    q, r = divmod(layers, pp)
    return [q + (s < r) for s in range(pp)]


def _int(name, v, lo=1):
    if isinstance(v, bool) or not isinstance(v, int) or v < lo:
        raise ValueError(f"{name} must be an integer >= {lo}, got {v!r}")
    return v


def check_shape(tp, pp, layers, hidden, micro_batch, seq, act_bytes, pp_rank):
    """Validate the model-parallel arguments of ``comm_breakdown``; a clear error names what is missing."""
    _int("tp", tp)
    _int("pp", pp)
    need = {"layers": layers} if tp > 1 else {}
    need.update(hidden=hidden, micro_batch=micro_batch, seq=seq)
    missing = [k for k, v in need.items() if v is None]
    if missing:
        raise ValueError(f"tp={tp}, pp={pp} needs {', '.join(k + '=' for k in missing)} (TP all-reduces and PP "
                         f"sends carry b·s·h activations per block and micro-batch)")
    for k, v in need.items():
        _int(k, v)
    if act_bytes not in (1, 2, 4):
        raise ValueError(f"act_bytes must be one of (1, 2, 4), got {act_bytes!r}")
    if layers is not None:
        stage_blocks(_int("layers", layers), pp)
    if pp_rank is not None and (isinstance(pp_rank, bool) or not isinstance(pp_rank, int)
                                or not 0 <= pp_rank < pp):
        raise ValueError(f"pp_rank must be None or an integer in 0..{pp - 1}, got {pp_rank!r}")


def tp_ops(tp, m, blocks, first, last, act, tokens, qkv_fused=True, sequence_parallel=False, inter=False,
           inter_share=0.0, per_node=None) -> list:
    """The TP collectives of one stage per optimizer step, as ``CommOp`` keyword dicts (module docstring);
    ``per_node``: the TP group's ranks on one node (default: all ``tp``, the group inside a node)."""
    if tp == 1:
        return []
    common = dict(group=tp, per_node=tp if per_node is None else per_node, inter_node=inter, inter_share=inter_share,
                  axis="tp")
    g, f = 2 * blocks + first, (2 if qkv_fused or sequence_parallel else 4) * blocks + last
    if sequence_parallel:   # g: RS forward, AG backward; f: AG forward, RS backward (f counted once per pair)
        f = 2 * blocks + last
        ops = [("all_gather", "act-forward", f), ("reduce_scatter", "act-forward", g),
               ("all_gather", "act-backward", g), ("reduce_scatter", "act-backward", f)]
    else:
        ops = [("all_reduce", "act-forward", g), ("all_reduce", "act-backward", f)]
    out = [dict(op=op, what=what, nbytes=act, count=m * c, **common) for op, what, c in ops if c]
    if last:
        out.append(dict(op="all_reduce", what="loss", nbytes=4 * tokens, count=3 * m, **common))
    return out


def pp_ops(pp, m, s, act, cross_fwd=False, cross_bwd=False, cross_loss=False) -> list:
    """The PP sends of stage ``s`` per optimizer step, as ``CommOp`` keyword dicts (module docstring). A send
    that crosses nodes has one rank on each side (``per_node`` 1); so has the loss broadcast's hop from this
    stage, a chain of sends, when it crosses."""
    if pp == 1:
        return []
    out = []
    if s < pp - 1:
        out.append(dict(op="send", what="activations", group=2, per_node=1 if cross_fwd else 2, nbytes=act, count=m,
                        inter_node=cross_fwd, inter_share=float(cross_fwd), axis="pp"))
    if s > 0:
        out.append(dict(op="send", what="activation-grads", group=2, per_node=1 if cross_bwd else 2, nbytes=act,
                        count=m, inter_node=cross_bwd, inter_share=float(cross_bwd), axis="pp"))
    if s != pp - 2:
        out.append(dict(op="broadcast", what="loss", group=pp, per_node=1 if cross_loss else pp,
                        nbytes=4, count=1, inter_node=cross_loss, inter_share=float(cross_loss), axis="pp"))
    return out


def model_parallel_ops(tp, pp, m, layers, hidden, micro_batch, seq, act_bytes, pp_rank, gpus_per_node=None,
                       qkv_fused=True, sequence_parallel=False) -> tuple[int, list]:
    """(the stage, its TP and PP ``CommOp`` keyword dicts) for stage ``pp_rank``; ``pp_rank=None``: the
    stage that sends the most (the pipeline runs at its busiest stage's pace)."""
    tokens = micro_batch * seq
    act = tokens * hidden * act_bytes
    k = gpus_per_node or tp * pp
    blocks = stage_blocks(layers, pp) if layers is not None else [0] * pp

    def ops(s):
        # rank = (d*pp + s)*tp + t: the s -> s+1 boundary crosses a node iff K divides tp*pp and (s+1)*tp
        cross = lambda b: (tp * pp) % k == 0 and tp * pp > k and (b * tp) % k == 0   # noqa: E731
        return (tp_ops(tp, m, blocks[s], s == 0, s == pp - 1, act, tokens, qkv_fused, sequence_parallel,
                       inter=tp > k, inter_share=(tp // k) / tp if tp > k else 0.0, per_node=min(tp, k))
                + pp_ops(pp, m, s, act, cross(s + 1), cross(s), cross(s + 1) if s < pp - 1 else tp * pp > k))
    if pp_rank is not None:
        return pp_rank, ops(pp_rank)
    sent = [sum(d["count"] * d["nbytes"] for d in ops(s)) for s in range(pp)]
    s = sent.index(max(sent))
    return s, ops(s)


def dp_gpus_per_node(gpus_per_node, tp, pp):
    """Ranks of one DP group inside a node: the DP group strides over tp·pp ranks (TP innermost)."""
    return None if gpus_per_node is None else max(1, gpus_per_node // (tp * pp))


__all__ = ["stage_blocks", "check_shape", "tp_ops", "pp_ops", "model_parallel_ops", "dp_gpus_per_node"]
