"""Chapter 12's timing lessons, replayed on modelled clusters (``zl.replay``; recording: ``book.replayed``).

* **ZeRO-3's cost on three fabrics.** The source articles say ZeRO-3 loses about 15 % of throughput
  against ZeRO-2/DDP on NVLink, 35 % on InfiniBand 200 Gb/s and more than 60 % on 100 GbE
  (``CLAIMS``). ``record`` traces one optimizer step of each ``SETTINGS`` entry once (TinyGPT at toy
  width with Llama-2-13B's 40 layers, 2 ranks); ``replay_fabrics`` replays them at Llama-2-13B's size
  (sequence 4096, micro-batch 1: 4096 tokens per GPU) on ``fabrics()``: one node of 8 A100 on NVLink,
  and two such nodes joined by one 200 Gb/s InfiniBand NIC or one 100 GbE NIC each — the same GPUs
  and compute everywhere, only the network differs. ``loss`` is the throughput lost, 1 - t2/t3.
* **The bound the bytes set.** ZeRO-3 sends 3 units of M(N-1)/N per step, ZeRO-2 2: with the same
  overlap on both sides (none, or all of it), 1 - t2/t3 <= 1/3 whatever the network (``BYTES_BOUND``).
  A loss above a third needs ZeRO-2 to hide more of its traffic than ZeRO-3, or costs the bytes
  do not carry (per-collective latency, the engine's overheads).
* **``plan.times`` against the replay** (``plan_check``): the candidate of ``zl.choose_stage`` for the
  same stage, cluster and size, its compute set to the replay's counted FLOPs at the preset's rate.
* **Persistence** (``stage3_param_persistence_threshold``): ``persistence_settings`` chooses the
  threshold by the *target's* parameter sizes and maps it to the toy's (module docstring of
  ``persistence_settings``).

Every number here is replayed on a modelled cluster, never measured.
"""
from __future__ import annotations

from dataclasses import replace

from zerolab.book import replayed

TARGET = "llama-2-13b"          # theory.SHAPES: hidden 5120, 40 layers, sequence 4096, micro-batch 1
SETTINGS = {   # zero_optimization keys on top of replayed.config's (nothing persistent, no reuse)
    "ZeRO-2": {"stage": 2, "overlap_comm": False},
    "ZeRO-3": {"stage": 3, "overlap_comm": False, "stage3_prefetch_bucket_size": 0},
    "ZeRO-2, overlap_comm": {"stage": 2, "overlap_comm": True, "reduce_bucket_size": replayed.layer_elements()},
    "ZeRO-3, prefetch": {"stage": 3, "overlap_comm": True},          # one recorded layer gathered ahead
}
PAIRS = {"no overlap on either side": ("ZeRO-2", "ZeRO-3"),
         "ZeRO-2 overlap_comm, ZeRO-3 prefetch": ("ZeRO-2, overlap_comm", "ZeRO-3, prefetch")}
# the source articles' figures: ZeRO-3's throughput loss against ZeRO-2/DDP (cited, not computed)
CLAIMS = {"NVLink": 0.15, "InfiniBand 200 Gb/s": 0.35, "100 GbE": 0.60}
CLAIM_TEXT = {"NVLink": "about 15 %", "InfiniBand 200 Gb/s": "about 35 %", "100 GbE": "more than 60 %"}
BYTES_BOUND = 1 / 3             # 1 - 2/3: ZeRO-2's bytes over ZeRO-3's, the most the bytes alone can cost


def fabrics() -> dict:
    """The claim's three fabrics as replay clusters, all on the book's DGX A100 GPUs (``HARDWARE``):
    one node (8 GPUs on NVLink); 2 nodes with one 200 Gb/s InfiniBand NIC each (the DGX A100's HDR
    NIC, one per node: composed here, not a preset); 2 nodes with one 100 GbE NIC each
    (``"cloud-100gbe"``: the same GPUs, 25 us per message)."""
    from zerolab.theory.hardware import HARDWARE
    from zerolab.theory.replay import Cluster
    a100 = HARDWARE["dgx-a100"]
    ib = a100.with_(name="8 x A100, 1 x 200 Gb/s InfiniBand", node=a100.node.with_nics(1))
    return {"NVLink": Cluster(a100, 1), "InfiniBand 200 Gb/s": Cluster(ib, 2),
            "100 GbE": Cluster(HARDWARE["cloud-100gbe"], 2)}


def shape(model=TARGET, seq: int | None = None, micro_batch: int | None = None):
    """``model``'s ``ModelShape`` with another sequence length or micro-batch (tokens per GPU)."""
    from zerolab.theory.shapes import get_shape
    s = get_shape(model)
    changes = {k: v for k, v in dict(seq=seq, micro_batch=micro_batch).items() if v is not None}
    return replace(s, name=f"{s.name}, {changes}", **changes) if changes else s


def record(settings=None, model=TARGET) -> dict:
    """``{name: traces}``: one traced step per setting (default ``SETTINGS``), one launch of 2 ranks."""
    settings = SETTINGS if settings is None else settings
    return replayed.record({k: replayed.config(z) for k, z in settings.items()}, model=model)


def replay_fabrics(traces: dict, model=TARGET, clusters=None) -> dict:
    """``{fabric: {setting: Replay}}`` on ``fabrics()`` (or ``clusters``) at ``model``'s size."""
    clusters = fabrics() if clusters is None else clusters
    return {f: replayed.replay_all(traces, c, model=model) for f, c in clusters.items()}


def loss(base, zero3) -> float:
    """Throughput lost by ``zero3`` against ``base`` (two ``Replay``s): 1 - base step / ZeRO-3 step."""
    return 1 - base.step_seconds / zero3.step_seconds


def losses(replays: dict, pair=PAIRS["no overlap on either side"]) -> dict:
    """``{fabric: loss}`` for a (base, ZeRO-3) pair of setting names."""
    return {f: loss(reps[pair[0]], reps[pair[1]]) for f, reps in replays.items()}


def table(replays: dict, tokens: int) -> str:
    """Claim against replay, one row per fabric: step seconds of each setting and the two losses."""
    out = [f"Llama-2-13B, {tokens:,} tokens per GPU per step, replayed (modelled): ZeRO-3's throughput loss vs ZeRO-2",
           f"{'fabric':<21}{'cluster (modelled)':<40}{'claim':>15}{'no overlap':>12}{'with overlap':>14}"]
    same, over = losses(replays), losses(replays, PAIRS["ZeRO-2 overlap_comm, ZeRO-3 prefetch"])
    cl = fabrics()
    for f in replays:
        out.append(f"{f:<21}{str(cl.get(f, '')):<40}{CLAIM_TEXT.get(f, ''):>15}{same[f]:>12.1%}{over[f]:>14.1%}")
    out.append("step seconds: " + "; ".join(
        f"{f}: " + ", ".join(f"{n} {r.step_seconds:.2f}" for n, r in reps.items()) for f, reps in replays.items()))
    return "\n".join(out)


def plan_check(traces, cluster, stage: int, model=TARGET) -> dict:
    """``plan.times`` of ``zl.choose_stage``'s candidate at ``stage`` (no offload) on ``cluster``'s node,
    its compute given as the replay's (counted FLOPs / the preset's FLOP/s), beside the replay of
    ``traces`` (one optimizer step). Returns ``{"plan": times, "plan_step", "replay": Replay, "issued",
    "counted", "alpha", "optimizer", "control"}``: the collectives the engine issued and those
    ``step_comm_time`` counts, one ring's latency (N-1)·α on the DP group's link, the optimizer's HBM
    seconds (the replay charges them; ``plan.times`` has no GPU optimizer term) and the control
    collectives' seconds (flags, outside Ψ)."""
    from zerolab.theory.comm import comm_breakdown, op_link
    from zerolab.theory.network import ring_bytes, ring_steps
    from zerolab.theory.plan import choose_stage
    from zerolab.theory.replay import get_cluster, replay
    from zerolab.theory.shapes import get_shape
    cluster, target = get_cluster(cluster), get_shape(model)
    hw, n = cluster.hardware, cluster.gpus
    rep = replay(traces, cluster, model=model)
    compute = rep.flops / hw.flops
    plan = choose_stage(target.params, n, 80e9, node=hw.node, hardware=hw, compute_seconds=compute)
    cand = next(c for c in plan.candidates if c.stage == stage and (c.offload_optimizer, c.offload_param) ==
                ("none", "none"))
    ops = comm_breakdown(target.params, n, stage, gpus_per_node=hw.node.gpus)
    link = op_link(ops[0], hw.node)
    issued = [e.info for e in traces[0] if e[0] == "coll-issued"]
    control = sum(ring_steps(i["op"], n) * link.latency + ring_bytes(i["op"], i["nbytes"], n) / link.bandwidth
                  for i in issued if i["control"])
    return {"plan": dict(cand.times), "plan_step": cand.step_seconds, "replay": rep,
            "issued": sum(1 for i in issued if not i["control"]), "counted": sum(op.count for op in ops),
            "alpha": ring_steps("all_gather", n) * link.latency, "optimizer": rep.compute_seconds[0] - compute,
            "control": control}


def persistence_settings(threshold: int = 100_000, model=TARGET, d_model: int = replayed.TOY["d_model"]) -> dict:
    """``{"ZeRO-3, norms persistent": zero keys}``: ``SETTINGS["ZeRO-3, prefetch"]`` (nothing persistent)
    with ``stage3_param_persistence_threshold`` chosen by the *target's* parameter sizes.

    A threshold counts elements, so the toy's cannot be the target's: 1e5 (DeepSpeed's default) keeps
    Llama-2-13B's norm weights whole (5,120 elements each) and none of its matrices (26M and more),
    but it would keep *every* parameter of a toy of width 32 whole — the toy's run would gather
    nothing. The recorded setting keeps the same kind of parameter whole at the toy's width: those of
    one width (``d_model`` elements: norm weights and biases, the per-channel vectors), no matrix."""
    from zerolab.theory.shapes import get_shape
    s = get_shape(model)
    smallest_matrix = s.hidden * (s.kv_heads * s.hidden // s.heads)
    if not s.hidden <= threshold < smallest_matrix:
        raise ValueError(f"threshold {threshold:,} elements keeps {'nothing' if threshold < s.hidden else 'matrices'} "
                         f"of {s.name} whole: choose one between its norm ({s.hidden:,}) and its smallest matrix "
                         f"({smallest_matrix:,} elements)")
    return {"ZeRO-3, norms persistent": {**SETTINGS["ZeRO-3, prefetch"], "stage3_param_persistence_threshold": d_model}}
