"""The book's analytic time model (``theory.step_comm_time``) against the replay (``zl.replay``) of a real run.

One traced optimizer step of a 3-layer TinyGPT on 2 gloo ranks (``zerolab.book.replayed``'s recording,
overlap and prefetch off), ZeRO-2 and ZeRO-3, replayed at the recorded model's own size on one DGX H100
node (the recorded DP group stands for its 8 GPUs on NVLink) and on two cloud nodes (16 GPUs, the ring
crossing one 100 Gb/s NIC per node). Both sides use the same alpha-beta ring model and the same link, so:

* **bandwidth term: equal.** The replay's collectives carry, unit by unit, exactly the bytes
  ``comm_volume`` counts for Ψ = the recorded model's parameter count (here Ψ divides by N: no padding).
* **latency term: different, by a count.** The replay pays (N-1)·α for *every* collective the engine
  issued: ZeRO-2 one reduce-scatter and one all-gather per unit (2U), ZeRO-3 an all-gather per unit in
  forward and again in backward (nothing persists, nothing is reused) plus a reduce-scatter per unit
  (3U). ``step_comm_time`` (without ``bucket_elems``) counts each kind once: 2 collectives at ZeRO-2, 3 at
  ZeRO-3. The measured relationship, asserted to float rounding:

      replay comm = step_comm_time + (collectives issued - collectives counted) · (N-1) · α

  At toy width the latency is nearly all of it (the printed totals differ about sixfold); the analytic
  model is right about bytes and optimistic about message count, which is why ``bucket_elems`` exists.
* The engine's control collectives (small all-reduces of flags and the unit order, not parameters) are
  outside Ψ: the test sets them apart and checks only that each costs its own alpha-beta time.
"""
from __future__ import annotations

import pytest

from zerolab.book import replayed
from zerolab.theory.comm import comm_breakdown, comm_volume, op_link, step_comm_time
from zerolab.theory.network import ring_bytes, ring_steps
from zerolab.theory.nodes import get_node
from zerolab.theory.replay import replay
from zerolab.theory.shapes import ModelShape

pytestmark = pytest.mark.slow
V, D, H, S, B, LAYERS = 96, 32, 2, 16, 2, 3
# cluster preset -> (node preset step_comm_time takes, the GPUs the recorded DP group stands for)
CLUSTERS = {"dgx-h100": ("dgx-h100", 8), "cloud-100gbe:2": ("cloud-100gbe", 16)}


def tiny_shape():
    """The recorded TinyGPT as a ModelShape (GPT-2's layer, tied head)."""
    return ModelShape("TinyGPT", D, LAYERS, H, H, 4 * D, V, seq=S, micro_batch=B, tied=True, gpt=True)


@pytest.fixture(scope="module")
def traces():
    """{stage: traces}: one launch of 2 ranks, one traced step per stage, overlap and prefetch off."""
    settings = {st: replayed.config({"stage": st, "overlap_comm": False, "stage3_prefetch_bucket_size": 0})
                for st in (2, 3)}
    return replayed.record(settings, model=tiny_shape())


def _replayed_collectives(tr, cluster):
    """Rank 0's replayed collectives as (trace info, seconds), in issue order (one group: one stream)."""
    rep = replay(tr, cluster, model=tiny_shape())
    spans = [s for s in rep.spans[0] if s[3] != "compute"]
    issued = [e.info for e in tr[0] if e[0] == "coll-issued"]
    assert len(spans) == len(issued) and all(s[0] == i["op"].replace("_", "-") for s, i in zip(spans, issued))
    return [(i, e - s) for (_, s, e, _), i in zip(spans, issued)]


@pytest.mark.parametrize("cluster", list(CLUSTERS))
@pytest.mark.parametrize("stage", [2, 3])
def test_replayed_comm_is_step_comm_time_plus_alpha_per_extra_collective(traces, stage, cluster):
    node, n = CLUSTERS[cluster]
    tr = traces[stage]
    meta = next(e.info for e in tr[0] if e[0] == "trace-meta")
    psi, units = sum(numel for _, numel, _ in meta["units"]), len(meta["units"])
    colls = _replayed_collectives(tr, cluster)
    model = [(i, t) for i, t in colls if not i["control"]]
    control = [(i, t) for i, t in colls if i["control"]]
    ops = comm_breakdown(psi, n, stage, gpus_per_node=get_node(node).gpus)
    link = op_link(ops[0], get_node(node))            # the link step_comm_time puts the DP ring on
    alpha = ring_steps("all_gather", n) * link.latency   # one reduce-scatter's or all-gather's latency

    replay_comm = sum(t for _, t in model)
    analytic = step_comm_time(psi, n, stage, node=node)
    counted = sum(op.count for op in ops)
    print(f"\nZeRO-{stage} on {cluster} (N={n}, Ψ={psi}): replay comm {replay_comm * 1e6:.2f} us over "
          f"{len(model)} collectives, step_comm_time {analytic * 1e6:.2f} us over {counted}")

    assert {i["op"] for i, _ in model} == {"reduce_scatter", "all_gather"}
    assert len(model) == (2 if stage == 2 else 3) * units and counted == (2 if stage == 2 else 3)
    # the bandwidth term: the bytes comm_volume counts, on the same link
    assert replay_comm - len(model) * alpha == pytest.approx(comm_volume(psi, n, stage) / link.bandwidth,
                                                             rel=1e-9)
    # the whole: the analytic time plus the latency of the collectives it does not count
    assert replay_comm == pytest.approx(analytic + (len(model) - counted) * alpha, rel=1e-9)
    # control traffic, outside Ψ: each costs its own alpha-beta time on the same link
    assert control
    for info, t in control:
        assert t == pytest.approx(ring_steps(info["op"], n) * link.latency
                                  + ring_bytes(info["op"], info["nbytes"], n) / link.bandwidth, rel=1e-9)
