"""A pipeline step replayed on modelled GPUs (theory/replay_pipe.py): hand-computed sends and receives, the
schedules' bubble against their formulas, the 3D time model against the replay.

Plain unit tests on synthetic traces (``orders_trace``: the schedules' real orders with chosen costs);
tests/test_replay_pipeline_traced.py records a real 2-stage run.
"""
from __future__ import annotations

import pytest

from zerolab.parallel.pipeline_schedule import schedule
from zerolab.theory.bubble import bubble_fraction
from zerolab.theory.hardware import HARDWARE
from zerolab.theory.network import Link
from zerolab.theory.nodes import Node
from zerolab.theory.replay import Cluster, ReplayError, replay
from zerolab.theory.replay_pipe import P2PMismatchError, orders_trace, replay_pipeline

US = 1e-6
# 2 GPUs a node, 1 TFLOP/s achieved, NVLink 1 GB/s and 0.5 us a message; one NIC of 0.5 GB/s, 2 us a message
EASY = HARDWARE["dgx-h100"].with_(name="easy", flops=1e12,
                                  node=Node("easy", 2, 1, 0.5e9, Link("easy-nvlink", 1e9, 0.5e-6), 2e-6))
FREE = HARDWARE["dgx-h100"].with_(name="free-p2p", node=Node("free", 8, 8, 1e30, Link("free", 1e30, 0.0), 0.0))


def orders(kind, m, p, v=1):
    return [schedule(kind, m, p, s, v) if v > 1 else schedule(kind, m, p, s) for s in range(p)]


def test_hand_computed_two_stages_two_micro_batches_1f1b_to_the_microsecond():
    # F = 1 us, B = 2 us, a 1000-byte message 0.5 + 1 = 1.5 us on NVLink.
    # stage 0: F0 [0,1] sends a0 (1 -> 2.5), F1 [1,2] sends a1 (link busy until 2.5: 2.5 -> 4.0)
    # stage 1: F0 [2.5,3.5], B0 [3.5,5.5] sends g0 (5.5 -> 7.0), F1 [5.5,6.5], B1 [6.5,8.5] sends g1 (8.5 -> 10.0)
    # stage 0: B0 waits for g0: [7,9]; B1 waits for g1: [10,12]
    rep = replay(orders_trace(orders("1f1b", 2, 2), f=1e6, b=2e6, nbytes=1000), Cluster(EASY))
    got = [[(op, i, pytest.approx(s / US), pytest.approx(e / US)) for op, i, _, s, e in ops] for ops in rep.ops]
    assert got[0] == [("F", 0, 0, 1), ("F", 1, 1, 2), ("B", 0, 7, 9), ("B", 1, 10, 12)]
    assert got[1] == [("F", 0, 2.5, 3.5), ("B", 0, 3.5, 5.5), ("F", 1, 5.5, 6.5), ("B", 1, 6.5, 8.5)]
    sends = [(pytest.approx(s / US), pytest.approx(e / US)) for k, s, e, lane in rep.spans[0] if lane == "send"]
    assert sends == [(1, 2.5), (2.5, 4.0)]
    assert rep.step_seconds == pytest.approx(12 * US, abs=1e-12)
    assert rep.exposed_comm == pytest.approx([6 * US, 2.5 * US], abs=1e-12)   # waits: 2->7 and 9->10; 0->2.5
    assert rep.bubble == pytest.approx(0.5)                   # busy 6 us of 12 on each rank


def test_free_p2p_gives_the_formula_and_crossing_nodes_pays_the_nic():
    free = replay(orders_trace(orders("1f1b", 2, 2), f=1e6, b=2e6, nbytes=1000),
                  Cluster(EASY.with_(node=FREE.node)))
    assert free.step_seconds == pytest.approx(9 * US, abs=1e-12) and free.bubble == pytest.approx(1 / 3)
    # one stage per node: each message 2 us + 1000 B / (0.5 GB/s NIC / 2 GPUs) = 2 + 4 = 6 us
    # stage 0: a0 1 -> 7, a1 7 -> 13 (the link busy); stage 1: F0 [7,8], B0 [8,10] -> g0 10 -> 16,
    # F1 (a1 at 13) [13,14], B1 [14,16] -> g1 16 -> 22; stage 0: B0 [16,18], B1 [22,24]
    rep = replay(orders_trace(orders("1f1b", 2, 2), f=1e6, b=2e6, nbytes=1000, ranks_per_node=1),
                 Cluster(EASY, 2))
    assert rep.step_seconds == pytest.approx(24 * US, abs=1e-12)
    assert [(op, pytest.approx(s / US)) for op, _, _, s, _ in rep.ops[0]] == [("F", 0), ("F", 1), ("B", 16), ("B", 22)]


def test_a_send_nobody_receives_is_a_named_error():
    tr = orders_trace(orders("1f1b", 2, 2), f=1e6, b=2e6, nbytes=1000)
    tr[1] = [e for k, e in enumerate(tr[1]) if not (e[0] == "p2p" and e[3]["op"] == "recv" and k > 3)]
    with pytest.raises(P2PMismatchError, match="rank 0 sent 2 to rank 1 .* rank 1 received 1"):
        replay(tr, Cluster(EASY))
    tr = orders_trace(orders("1f1b", 2, 2), f=1e6, b=2e6, nbytes=1000)
    tr[0][2][3]["nbytes"] = 999
    with pytest.raises(P2PMismatchError, match="999 bytes sent, 1000 bytes received"):
        replay(tr, Cluster(EASY))


@pytest.mark.parametrize("kind,v", [("gpipe", 1), ("1f1b", 1), ("interleaved", 2), ("zb-h1", 1)])
def test_each_schedule_replayed_at_llama_size_gives_its_formula_when_p2p_is_free(kind, v):
    """Llama-2-7B's 32 layers on pp 4 of one DGX H100, m = 8: the bubble measured on the replay equals the
    schedule's formula with the replay's own F, B, W costs when stages are balanced and p2p is free; with
    NVLink's sends it is larger."""
    p, m = 4, 8
    trace = orders_trace(orders(kind, m, p, v), 1, 1, 1 if kind == "zb-h1" else 0, nbytes=1, v=v)
    free = replay_pipeline(trace, Cluster(FREE), model="llama-2-7b")
    ops = {op: e - s for op, _, _, s, e in free.ops[0]}
    f, b, w = ops["F"] * v, ops["B"] * v, ops.get("W", 0) * v
    if kind != "zb-h1":
        b, w = b / 2, b / 2          # any split of the whole backward: the formula uses f + b + w
    assert free.bubble == pytest.approx(float(bubble_fraction(kind, p, m, v, f, b, w)), rel=1e-9)
    nvlink = replay_pipeline(trace, "dgx-h100", model="llama-2-7b")
    assert nvlink.bubble > free.bubble


def test_planted_receive_that_does_not_wait_is_caught():
    """The hand schedule again with stage 1 unable to start before a0 arrives (2.5 us): its first F is there."""
    rep = replay(orders_trace(orders("1f1b", 2, 2), f=1e6, b=2e6, nbytes=1000), Cluster(EASY))
    assert rep.ops[1][0][3] == pytest.approx(2.5 * US, abs=1e-12)


def test_step_time_3d_against_the_replay_equal_when_sends_are_free_and_apart_by_counted_messages():
    """Llama-2-7B's shape (Ψ, hidden, 32 layers), pp 4, m 8, tp = dp = 1 on one DGX H100: with free p2p the
    time model's pipeline (compute + bubble) equals the replayed 1F1B step; with NVLink's sends the model
    counts 2(m + p - 1) = 22 message times (every send in series, the bubble stretched by them), the replay
    16 (those on 1F1B's critical path: the fill, the drain and its steady state), GPipe's replay 6 = 2(p - 1)."""
    from zerolab.theory.replay_time3d import compare
    from zerolab.theory.shapes import SHAPES
    s = SHAPES["llama-2-7b"]
    cfg = dict(psi=s.params, seq=s.seq, hidden=s.hidden, layers=s.layers)
    free = compare(orders("1f1b", 8, 4), FREE, **cfg)
    assert free["terms"]["pp"] < 1e-18 and free["time3d"] == pytest.approx(free["replay"], rel=1e-12)
    assert free["replay"] == pytest.approx(free["ideal"], rel=1e-12)
    nv = compare(orders("1f1b", 8, 4), "dgx-h100", **cfg)
    assert nv["time3d_messages"] == pytest.approx(2 * (8 + 4 - 1), rel=1e-9)
    assert nv["replay_messages"] == pytest.approx(16, rel=1e-6)
    assert nv["replay"] < nv["time3d"]
    gpipe = compare(orders("gpipe", 8, 4), "dgx-h100", **cfg)
    assert gpipe["replay_messages"] == pytest.approx(2 * (4 - 1), rel=1e-6)


def test_receives_that_wait_on_each_other_are_a_named_error_not_a_hang():
    """Each rank first receives what the other sends only at its end: the messages pair up, the ranks deadlock."""
    def msg(op, peer):
        return ("p2p", 0, 0.0, {"op": op, "nbytes": 8, "peer": peer, "group": "pp", "tag": 9, "issued": 0.0,
                                "waited": 0.0})
    tr = orders_trace(orders("1f1b", 2, 2), f=1e6, b=2e6, nbytes=1000)
    tr = [t[:1] + [msg("recv", 1 - r)] + t[1:] + [msg("send", 1 - r)] for r, t in enumerate(tr)]
    with pytest.raises(ReplayError, match=r"cannot go on.*rank 0 at record 0 \(recv from rank 1\)"):
        replay(tr, Cluster(EASY))
