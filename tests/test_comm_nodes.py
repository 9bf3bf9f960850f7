"""Which link each collective of a step runs on (theory/comm.py's ``step_comm_time`` on ``theory.nodes``).

A group crosses nodes when its ranks sit on more than one node, whatever its size: qgZ's inter-node
all-to-all has one rank per node, so on 2 nodes it is a group of 2 that crosses. And the groups that
cross beside each other share the node's NICs: the 8 one-rank-per-node all-to-alls of a node of 8 GPUs
each get an eighth of its network bandwidth. Times below are computed by hand from the bandwidths.
"""
from __future__ import annotations

import pytest

from zerolab.theory import comm_breakdown, step_comm_time
from zerolab.theory.comm import CommOp
from zerolab.theory.network import Link
from zerolab.theory.nodes import NODES

PSI = 13e9
ALL3 = dict(quantized_weights=True, quantized_gradients=True, hpz=True)
CLOUD = NODES["cloud-100gbe"]                 # 8 x A100 on NVLink, one 100 GbE NIC (12.5 GB/s), 25 us
WORLD = Link("the world ring, all 8 ranks of a node", 12.5e9, 25e-6)
SHARED = Link("one rank per node: an eighth of the NIC", 12.5e9 / 8, 25e-6)


def _op(ops, what):
    return next(op for op in ops if op.what == what)


def test_every_op_knows_its_ranks_per_node():
    """per_node: the world ring has min(n, gpus) per node, qgZ's inter all-to-all 1, its intra 8, hpZ's
    backward gather its partition; a group crosses exactly when it has more ranks than one node holds."""
    ops = comm_breakdown(PSI, 16, 3, gpus_per_node=8, **ALL3)
    got = {op.what: (op.group, op.per_node, op.inter_node) for op in ops}
    assert got == {"params-forward": (16, 8, True), "params-backward": (8, 8, False),
                   "grads-intra": (8, 8, False), "grads-inter": (2, 1, True)}
    assert [op.per_node for op in comm_breakdown(PSI, 4, 2, gpus_per_node=8)] == [4, 4]       # inside one node
    assert all(op.per_node == 8 for op in comm_breakdown(PSI, 64, 0, gpus_per_node=8))


@pytest.mark.parametrize("n, gpus, kw", [(16, 8, ALL3), (128, 8, ALL3), (64, 8, {}), (8, 8, ALL3), (32, 16, ALL3),
                                         (64, 8, dict(quantized_gradients=True)), (12, None, {})])
def test_per_node_is_consistent_with_crossing(n, gpus, kw):
    for op in comm_breakdown(PSI, n, 3, gpus_per_node=gpus, **kw):
        assert 1 <= op.per_node <= op.group and (gpus is None or op.per_node <= gpus), op
        assert op.inter_node == (op.group > op.per_node), op


def test_3d_ops_know_their_ranks_per_node():
    """DP over tp·pp-strided ranks: gpus/(tp·pp) per node; TP inside the node; a PP send that crosses has
    one rank on each side."""
    shape = dict(layers=8, hidden=64, micro_batch=1, seq=16)
    ops = comm_breakdown(1e9, 64, 1, gpus_per_node=8, tp=4, pp=4, **shape)
    dp = [op for op in ops if op.axis == "dp"]
    assert {(op.group, op.per_node, op.inter_node) for op in dp} == {(4, 1, True)}   # 4 DP ranks, 1 per node
    assert {(op.group, op.per_node, op.inter_node) for op in ops if op.axis == "tp"} == {(4, 4, False)}
    for op in ops:
        assert 1 <= op.per_node <= op.group and op.inter_node == (op.group > op.per_node), op
    dp2 = [op for op in comm_breakdown(1e9, 64, 1, gpus_per_node=8, tp=2, pp=1, **shape) if op.axis == "dp"]
    assert {(op.group, op.per_node) for op in dp2} == {(32, 4)}
    sends = [op for op in ops if op.op == "send"]
    assert sends and all(op.per_node == (1 if op.inter_node else 2) for op in sends)


def test_qgz_inter_all_to_all_crosses_nodes_on_two_nodes():
    """On 2 nodes qgZ's inter-node all-to-all is a group of 2 — one rank on each node: it crosses, over an
    eighth of the NIC. (The size-only rule, group > gpus, put it on NVLink at 300 GB/s.)"""
    ops = comm_breakdown(PSI, 16, 3, gpus_per_node=8, quantized_gradients=True)
    fwd, bwd, intra, inter = (_op(ops, w) for w in ("params-forward", "params-backward", "grads-intra", "grads-inter"))
    want = (WORLD.time("all_gather", fwd.nbytes, 16) + WORLD.time("all_gather", bwd.nbytes, 16)
            + CLOUD.intra.time("all_to_all", intra.nbytes, 8) + SHARED.time("all_to_all", inter.nbytes, 2))
    got = step_comm_time(PSI, 16, 3, node=CLOUD, quantized_gradients=True)
    assert got == pytest.approx(want, rel=1e-12)
    assert got > inter.bytes / SHARED.bandwidth          # the inter bytes alone take this long at the NIC's share


def test_cross_node_groups_share_the_nics():
    """On 16 nodes the inter all-to-all (16 ranks, 1 per node) does cross by size too, but it is one of the 8
    such groups each node runs at once: 12.5 / 8 GB/s each, not the whole NIC."""
    ops = comm_breakdown(PSI, 128, 3, gpus_per_node=8, **ALL3)
    inter = _op(ops, "grads-inter")
    assert (inter.group, inter.per_node) == (16, 1)
    rest = step_comm_time(PSI, 128, 3, node=CLOUD, **ALL3) - SHARED.time("all_to_all", inter.nbytes, 16)
    fwd, bwd, intra = (_op(ops, w) for w in ("params-forward", "params-backward", "grads-intra"))
    assert rest == pytest.approx(WORLD.time("all_gather", fwd.nbytes, 128) + CLOUD.intra.time("all_gather", bwd.nbytes, 8)
                                 + CLOUD.intra.time("all_to_all", intra.nbytes, 8), rel=1e-12)
    # the figures the chapters quote: ZeRO++ on 16 x 8 cloud nodes ~1.62 s (the whole-NIC model said 1.19 s)
    assert round(step_comm_time(PSI, 128, 3, node=CLOUD, **ALL3), 2) == 1.62
    assert round(step_comm_time(PSI, 16, 3, node=CLOUD, **ALL3), 2) == 1.33          # 2 nodes (said 1.07 s)
    one = NODES["dgx-a100"].with_nics(1)                                             # chapter 14, Q10 (said 5.04x)
    assert round(step_comm_time(PSI, 64, 3, node=one) / step_comm_time(PSI, 64, 3, node=one, **ALL3), 1) == 3.7


def test_world_ring_keeps_every_nic():
    """ZeRO-3's and DDP's rings span all ranks: 8 per node, the whole NICs, as before."""
    m = 2 * 13_000_000_000
    assert step_comm_time(PSI, 64, 0, node="dgx-a100") == pytest.approx(2 * 63 * 5e-6 + 2 * (63 * m // 64) / 200e9,
                                                                       rel=1e-12)


def test_cross_node_op_without_per_node_is_refused():
    from zerolab.theory.comm import op_link
    op = CommOp("all_to_all", "grads-inter", group=2, nbytes=8, count=1, inter_node=True)
    with pytest.raises(ValueError, match="per_node"):
        op_link(op, CLOUD)
