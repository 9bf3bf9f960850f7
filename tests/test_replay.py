"""The replay on modelled GPUs (theory/replay.py): hand-computed schedules, its rules one by one, its errors.

Synthetic traces here (plain unit tests, no processes); tests/test_replay_traced.py records real ones.
"""
from __future__ import annotations

import pytest

from zerolab.theory.hardware import HARDWARE
from zerolab.theory.network import Link
from zerolab.theory.nodes import Node
from zerolab.theory.replay import Cluster, ReplayError, replay

US = 1e-6
# a 2-GPU node whose numbers make hand arithmetic easy: 1 TFLOP/s achieved, NVLink 1 GB/s, 0.5 us per step
EASY = HARDWARE["dgx-h100"].with_(name="easy", flops=1e12,
                                  node=Node("easy", 2, 2, 0.5e9, Link("easy-nvlink", 1e9, 0.5e-6), 0.5e-6))


def meta(world=2, rpn=None, **kw):
    info = {"rank": 0, "world": world, "ranks_per_node": rpn or world, "stage": 3, "dp": world, "tp": 1, "pp": 1,
            "units": [("rest", 1000, 1000), ("blocks.0", 1000, 1000)], "param_collective": "all_gather",
            "master": False, "dtype_bytes": 2, "offload": "none", "gas": 1}
    info.update(kw)
    return ("trace-meta", -1, 0.0, info)


def comp(unit, flops, phase="forward"):
    return ("compute", unit, 0.0, {"phase": phase, "flops": flops, "start": 0.0})


def issue(seq, op, nbytes, members=(0, 1), group=None, control=False):
    return ("coll-issued", seq, 0.0, {"op": op, "nbytes": nbytes, "members": tuple(members), "group": group,
                                      "tag": f"t{seq}", "control": control})


def wait(seq, soft=False):
    return ("coll-waited", seq, 0.0, {"soft": True}) if soft else ("coll-waited", seq, 0.0)


def opt(numel):
    return ("optimizer", -1, 0.0, {"numel": numel})


def two_unit_schedule():
    """Rank 1 starts with 1 us of compute, so the all-gather A starts when it issues it (t = 1 us)."""
    r0 = [meta(), issue(1, "all_gather", 2000), wait(1), comp(0, 2e6), issue(2, "reduce_scatter", 4000),
          comp(1, 3e6), wait(2), opt(1000)]
    r1 = [meta(rank=1), comp(0, 1e6), issue(1, "all_gather", 2000), wait(1), comp(0, 2e6),
          issue(2, "reduce_scatter", 4000), comp(1, 3e6), wait(2), opt(1000)]
    return [r0, r1]


def test_hand_computed_two_units_two_ranks_to_the_microsecond():
    rep = replay(two_unit_schedule(), Cluster(EASY))
    # A: all-gather of 2000 B over 2 ranks = 1 ring step (0.5 us) + 1000 B / 1 GB/s (1 us), from t = 1 to 2.5 us
    # rank 0 waits 0 -> 2.5 us, rank 1 waits 1 -> 2.5 us; both compute 2 us, issue B at 4.5 us, compute 3 us
    # B: reduce-scatter of 4000 B = 0.5 + 2 us: 4.5 -> 7.0 us, hidden behind compute that ends at 7.5 us
    adam = 1000 * 28 / HARDWARE["dgx-h100"].accelerator.hbm          # an Adam update of 1000 fp32 elements
    assert rep.step_seconds == pytest.approx(7.5 * US + adam, abs=1e-12)
    assert rep.exposed_comm == pytest.approx([2.5 * US, 1.5 * US], abs=1e-12)
    assert len(rep.exposed_intervals[1]) == 1 and rep.exposed_intervals[1][0] == pytest.approx((1 * US, 2.5 * US), abs=1e-12)
    gathers = [s for s in rep.spans[0] if s[0] == "all-gather"]
    assert gathers == [("all-gather", pytest.approx(1 * US), pytest.approx(2.5 * US), "all-gather")]
    rs = [s for s in rep.spans[1] if s[0] == "reduce-scatter"]
    assert rs[0][1:3] == (pytest.approx(4.5 * US), pytest.approx(7.0 * US))


def test_no_overlap_step_is_compute_plus_communication():
    r = [meta(), comp(0, 5e6), issue(1, "all_reduce", 8000), wait(1), comp(1, 5e6, "backward"),
         issue(2, "all_reduce", 8000), wait(2)]
    rep = replay([r, [meta(rank=1)] + r[1:]], Cluster(EASY))
    one = 2 * 0.5 * US + 8000 / 1e9          # all-reduce: 2(N-1) steps, 2S(N-1)/N bytes
    assert rep.step_seconds == pytest.approx(10 * US + 2 * one, abs=1e-12)
    assert rep.exposed_comm[0] == pytest.approx(2 * one, abs=1e-12)
    assert rep.compute_seconds[0] == pytest.approx(10 * US, abs=1e-12)


def test_a_collective_hidden_behind_compute_is_not_exposed():
    r = [meta(), issue(1, "all_gather", 2000), comp(0, 50e6), wait(1)]
    rep = replay([r, [meta(rank=1)] + r[1:]], Cluster(EASY))
    assert rep.exposed_comm == [0.0, 0.0]
    assert rep.step_seconds == pytest.approx(50 * US, abs=1e-12)


def test_a_collective_starts_when_the_last_member_issues_it_and_its_stream_is_free():
    """Two collectives on one group run one after the other; the first waits for rank 1's issue."""
    r0 = [meta(), issue(1, "all_gather", 2000), issue(2, "all_gather", 2000), wait(1), wait(2)]
    r1 = [meta(rank=1), comp(0, 10e6), issue(1, "all_gather", 2000), issue(2, "all_gather", 2000), wait(1), wait(2)]
    rep = replay([r0, r1], Cluster(EASY))
    starts = sorted(s[1] for s in rep.spans[0] if s[0] == "all-gather")
    assert starts == pytest.approx([10 * US, 11.5 * US], abs=1e-12)      # not at 0; the second after the first
    assert rep.step_seconds == pytest.approx(13 * US, abs=1e-12)


def test_a_wait_after_a_successful_poll_does_not_block_but_the_end_of_backward_does():
    r = [meta(), issue(1, "all_gather", 20000), wait(1, soft=True), comp(0, 1e6), ("coll-drain", -1, 0.0)]
    rep = replay([r, [meta(rank=1)] + r[1:]], Cluster(EASY))
    t = 0.5 * US + 10000 / 1e9
    assert rep.step_seconds == pytest.approx(t, abs=1e-12)
    assert rep.exposed_comm[0] == pytest.approx(t - 1 * US, abs=1e-12)     # waited at the drain, not the poll


def test_nics_are_shared_by_the_groups_crossing_beside_each_other():
    """4 recorded ranks on 2 nodes (2 per node); the one-rank-per-node groups stand for 8 groups per node on
    the cluster, which share its NIC: cloud-100gbe's 12.5 GB/s / 8 each."""
    m = dict(world=4, rpn=2)
    inter = {0: (0, 2), 1: (1, 3), 2: (0, 2), 3: (1, 3)}
    traces = [[meta(rank=r, **m), issue(1, "all_reduce", 8_000_000, inter[r]), wait(1)] for r in range(4)]
    rep = replay(traces, "cloud-100gbe:2")
    node = HARDWARE["cloud-100gbe"].node
    expected = 2 * max(node.intra.latency, node.nic_latency) + 8_000_000 / (12.5e9 / 8)   # 2 nodes: S bytes
    assert rep.step_seconds == pytest.approx(expected, rel=1e-12)


def test_the_world_group_scales_to_the_cluster_and_crosses_nodes():
    traces = [[meta(rank=r), issue(1, "all_reduce", 16_000_000), wait(1)] for r in range(2)]
    one = replay(traces, "dgx-h100").step_seconds          # 8 GPUs: NVLink 450 GB/s
    two = replay(traces, "dgx-h100:2").step_seconds        # 16 GPUs: 8 x 50 GB/s NICs
    assert one == pytest.approx(2 * 7 * 3e-6 + 2 * 16e6 * 7 / 8 / 450e9, rel=1e-12)
    assert two == pytest.approx(2 * 15 * 5e-6 + 2 * 16e6 * 15 / 16 / 400e9, rel=1e-12)


def test_optimizer_offload_uses_the_host_bandwidth_of_the_gpus_on_the_node():
    hw = HARDWARE["dgx-a100"]
    one = replay([[meta(world=1, offload="cpu", master=True), opt(10**9)]], Cluster(hw.with_(
        node=hw.node.__class__("one", 1, 1, hw.node.nic_bandwidth, hw.node.intra))))
    assert one.step_seconds == pytest.approx(10**9 * 30 / hw.host_memory + 10**9 * 4 / hw.pcie, rel=1e-12)


def test_same_traces_same_numbers_bit_for_bit():
    a, b = replay(two_unit_schedule(), "dgx-a100:2"), replay(two_unit_schedule(), "dgx-a100:2")
    assert (a.step_seconds, a.exposed_comm, a.spans, a.mfu) == (b.step_seconds, b.exposed_comm, b.spans, b.mfu)


def test_backward_flops_are_charged_as_recorded_not_as_forward():
    r = [meta(), comp(0, 1e6, "forward"), comp(0, 2e6, "backward")]
    rep = replay([r, [meta(rank=1)] + r[1:]], Cluster(EASY))
    assert [s[0] for s in rep.spans[0]] == ["forward", "backward"]
    assert rep.step_seconds == pytest.approx(3 * US, abs=1e-12)
    assert rep.flops == 3e6


# ---------------------------------------------------------------- bad input, each a named error
def test_ranks_that_issued_different_collectives_are_named():
    r0 = [meta(), issue(1, "all_gather", 2000), wait(1)]
    r1 = [meta(rank=1), issue(1, "reduce_scatter", 2000), wait(1)]
    with pytest.raises(ReplayError, match=r"different collective sequences.*all_gather.*rank 0.*reduce_scatter.*rank 1"):
        replay([r0, r1], Cluster(EASY))
    with pytest.raises(ReplayError, match="rank 1 issued 0 collectives"):
        replay([r0, [meta(rank=1)]], Cluster(EASY))


def test_a_compute_span_without_flops_is_named():
    bad = ("compute", 1, 0.0, {"phase": "forward", "start": 0.0})
    with pytest.raises(ReplayError, match="rank 1: a compute span without FLOPs.*unit 1"):
        replay([[meta()], [meta(rank=1), bad]], Cluster(EASY))


def test_a_trace_without_meta_and_a_missing_rank_are_named():
    with pytest.raises(ReplayError, match="rank 0's trace has no 'trace-meta'"):
        replay([[comp(0, 1)], [meta(rank=1)]], Cluster(EASY))
    with pytest.raises(ReplayError, match="1 traces for a world of 2"):
        replay([[meta()]], Cluster(EASY))


def test_a_tier_the_cluster_lacks_and_a_group_it_cannot_place_are_named():
    m = dict(world=4, rpn=2)
    inter = {0: (0, 2), 1: (1, 3), 2: (0, 2), 3: (1, 3)}
    traces = [[meta(rank=r, **m), issue(1, "all_reduce", 800, inter[r]), wait(1)] for r in range(4)]
    with pytest.raises(ReplayError, match="inter-node tier.*one node"):
        replay(traces, "dgx-h100")
    odd = {0: (0, 1, 2), 1: (0, 1, 2), 2: (0, 1, 2)}
    traces = [[meta(rank=r, **m), issue(1, "all_reduce", 800, odd[r]), wait(1)] for r in range(3)] + [[meta(rank=3, **m)]]
    with pytest.raises(ReplayError, match=r"group \[0, 1, 2\].*cannot place"):
        replay(traces, "dgx-h100:2")


def test_unknown_cluster_and_too_many_ranks_are_named():
    with pytest.raises(ReplayError, match="unknown cluster 'dgx-z'.*presets"):
        replay(two_unit_schedule(), "dgx-z")
    traces = [[meta(world=16, rank=r)] for r in range(16)]
    with pytest.raises(ReplayError, match="16 ranks but DGX H100 has 8 GPUs"):
        replay(traces, "dgx-h100")


def test_a_replayed_all_reduce_runs_at_the_published_nccl_tests_bus_bandwidth():
    """One all-reduce over every GPU of 4 nodes, replayed: its bus bandwidth (2S(N-1)/N / time) is the node
    model's, set against nccl-tests' published figures by theory.published (model / published in TOLERANCE)."""
    from zerolab.theory import published
    for b in published.BUS_BANDWIDTHS[:3]:
        hw = HARDWARE["dgx-a100"].with_(node=b.node)
        n = b.nodes * b.node.gpus
        size = 10**10
        traces = [[meta(world=n, rpn=b.node.gpus, rank=r), issue(1, "all_reduce", size, range(n)), wait(1)]
                  for r in range(n)]
        rep = replay(traces, Cluster(hw, b.nodes))
        busbw = 2 * size * (n - 1) / n / rep.step_seconds / 1e9
        assert busbw == pytest.approx(b.model_gbs, rel=0.01)             # latency is < 1 % at 10 GB
        assert published.TOLERANCE[0] <= busbw / b.published_gbs <= published.TOLERANCE[1], b.what
