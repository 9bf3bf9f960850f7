"""The node model (theory/nodes.py): hand-computed times, the published figures within the
stated tolerance, and the planted one-NIC bug the model replaced (issue 14)."""
from __future__ import annotations

import pytest

import zerolab as zl
from zerolab import theory
from zerolab.theory import nodes, published
from zerolab.theory.nodes import NODES, Node

PSI = 7.5e9


def test_ring_across_dgx_a100_runs_at_the_nics_together():
    a100 = NODES["dgx-a100"]
    assert a100.link_for(8) is a100.intra                              # one node: NVLink
    assert a100.link_for(64).bandwidth == 8 * 25e9 == 200e9            # 8 NICs x 25 GB/s < 300
    assert NODES["dgx-h100"].link_for(16).bandwidth == 400e9           # 8 x 50 < 450
    assert NODES["cloud-100gbe"].link_for(16).bandwidth == 12.5e9
    fast_nics = Node("x", 8, 8, 100e9, zl.LINKS["nvlink3"])
    assert fast_nics.link_for(16).bandwidth == 300e9                   # then NVLink sets the pace


def test_step_time_hand_computed():
    # DDP, 7.5B in bf16 on 8 x DGX A100: all-reduce of M = 15e9 bytes over 64 ranks,
    # 2 * 63 steps at 5 us + 2 * 63/64 * M at 200 GB/s
    m = 2 * 7_500_000_000
    want = 2 * 63 * 5e-6 + 2 * (63 * m // 64) / 200e9
    assert theory.step_comm_time(PSI, 64, 0, node="dgx-a100") == pytest.approx(want, rel=1e-12)
    # ZeRO-3 on one node: 3 collectives of M(N-1)/N on NVLink (300 GB/s, 3 us)
    want3 = 3 * (7 * 3e-6 + (7 * m // 8) / 300e9)
    assert theory.step_comm_time(PSI, 8, 3, node="dgx-a100") == pytest.approx(want3, rel=1e-12)
    # the same node with one NIC is 8x slower across nodes (bandwidth term)
    one = NODES["dgx-a100"].with_nics(1)
    assert one.nics == 1 and "1 x 200" in one.name
    t1 = theory.step_comm_time(PSI, 64, 0, node=one)
    assert t1 == pytest.approx(2 * 63 * 5e-6 + 2 * (63 * m // 64) / 25e9, rel=1e-12)
    # the old arguments are a node with one NIC of inter_link's speed: same as before
    old = theory.step_comm_time(PSI, 64, 0, "nvlink3", inter_link="infiniband-200g", gpus_per_node=8)
    assert old == pytest.approx(t1, rel=1e-12)
    # hpZ's backward all-gather stays on NVLink inside the node
    t_hpz = theory.step_comm_time(PSI, 64, 3, node="dgx-a100", hpz=True)
    t_3 = theory.step_comm_time(PSI, 64, 3, node="dgx-a100")
    assert t_hpz < t_3


def test_planted_one_nic_model_is_caught():
    """The bug issue 14 fixed: the whole cross-node ring on one NIC. Planting it changes the DGX
    A100 figure by 8x, far outside the published tolerance."""
    b = published.BUS_BANDWIDTHS[0]
    wrong = b.node.with_nics(1).link_for(64).bandwidth / 1e9 / b.published_gbs
    assert not published.TOLERANCE[0] <= wrong <= published.TOLERANCE[1]


@pytest.mark.parametrize("row", published.BUS_BANDWIDTHS, ids=lambda r: r.what)
def test_bus_bandwidth_within_tolerance_of_published(row):
    lo, hi = published.TOLERANCE
    assert lo <= row.ratio <= hi, (row.what, row.model_gbs, row.published_gbs, row.source)


@pytest.mark.parametrize("row", published.SPEEDUPS, ids=lambda r: r.what)
def test_zeropp_speedup_within_20_percent_of_published(row):
    assert 0.8 <= row.ratio() <= 1.2, (row.what, row.model(), row.published)


def test_comparison_text_names_every_source():
    text = published.comparison_text()
    for row in published.BUS_BANDWIDTHS + published.SPEEDUPS:
        assert row.source in text


@pytest.mark.parametrize("kwargs, match", [
    (dict(node="dgx-a200"), "unknown node 'dgx-a200'"),
    (dict(node="dgx-a100", link="nvlink3"), "either node"),
    (dict(node="dgx-a100", gpus_per_node=4), "contradicts"),
    (dict(), "needs node"),
    (dict(link="nvlink3", inter_link="infiniband-200g"), "inter_link needs gpus_per_node"),
])
def test_bad_arguments_are_named(kwargs, match):
    with pytest.raises(ValueError, match=match):
        theory.step_comm_time(PSI, 16, 2, **kwargs)


def test_bad_node_fields():
    with pytest.raises(ValueError, match="nics must be an integer"):
        Node("x", 8, 0, 1e9, zl.LINKS["nvlink3"])
    with pytest.raises(ValueError, match="intra must be a zerolab.Link"):
        Node("x", 8, 1, 1e9, "nvlink3")
    assert nodes.get_node(None) is None and nodes.get_node("dgx-h100") is NODES["dgx-h100"]


def test_group_link_classifies_by_where_the_ranks_sit_and_shares_the_nics():
    """A group crosses nodes when its ranks sit on more than one, whatever its size; groups that cross
    beside each other share the node's NICs (8 one-rank-per-node groups of a DGX: one NIC each)."""
    a100 = NODES["dgx-a100"]
    assert a100.group_link(range(8)) is a100.intra                       # one node
    assert a100.group_link(range(0, 64, 8)).bandwidth == 25e9             # 8 ranks, one per node: crosses
    assert a100.group_link(range(0, 64, 8)).bandwidth == a100.group_link(size=8, per_node=1).bandwidth
    assert a100.group_link(range(64)).bandwidth == 200e9                  # the whole world: every NIC
    assert a100.group_link(range(16)).bandwidth == a100.link_for(16).bandwidth
    cloud = NODES["cloud-100gbe"]
    assert cloud.group_link(size=16, per_node=1).bandwidth == 12.5e9 / 8  # one NIC shared by 8 groups
    with pytest.raises(ValueError, match="per_node"):
        a100.group_link(size=4, per_node=9)
