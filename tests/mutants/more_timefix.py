"""Mutants of the analytic time models (theory/comm.py's link per collective, theory/hardware.py's offload shares)."""
from __future__ import annotations

from mutants import Mutant

NODES_T = "tests/test_comm_nodes.py"
SHARE_T = "tests/test_offload_share.py"

MUTANTS = [
    Mutant("comm-crossing-by-size", "zerolab/theory/comm.py",
           "        lk = op_link(op, nd)",
           "        lk = nd.link_for(op.group if op.inter_node else 1)",
           (NODES_T,), "a group crosses nodes only when it is larger than a node: qgZ's 2-rank inter all-to-all on "
                       "2 nodes runs on NVLink, and a cross-node group gets the node's whole NICs"),
    Mutant("comm-nics-not-shared", "zerolab/theory/nodes.py",
           "bw = min(self.intra.bandwidth, self.network_bandwidth * per_node / self.gpus)",
           "bw = min(self.intra.bandwidth, self.network_bandwidth)",
           (NODES_T,), "every cross-node group gets the node's whole NICs, though 8 one-rank-per-node groups share them"),
    Mutant("comm-qgz-inter-whole-node", "zerolab/theory/comm.py",
           "CommOp(\"all_to_all\", \"grads-inter\", group=nodes, per_node=1,",
           "CommOp(\"all_to_all\", \"grads-inter\", group=nodes, per_node=k if nodes > k else 1,",
           (NODES_T,), "qgZ's inter all-to-all booked as if the node's 8 ranks were in one group (the NICs not shared)"),
    Mutant("offload-host-by-8-for-one-gpu", "zerolab/theory/hardware.py",
           "        return min(n_gpus, self.gpus_per_node)",
           "        return self.gpus_per_node",
           (SHARE_T,), "host memory and NVMe divided by 8 GPUs per node even when the job has one GPU"),
    Mutant("offload-3d-dp-ranks-only", "zerolab/theory/time3d.py",
           "offload_param, hw, gpus=n_gpus)}",
           "offload_param, hw)}",
           (SHARE_T,), "3D: the host shared by the DP ranks only, as if TP/PP ranks on the node used none of it"),
]
