"""Nodes: GPUs per node, NICs per node and their speed, the fabric inside (chapters 2, 11, 12).

The one place that knows the cluster's topology. ``step_comm_time`` (``comm``),
the Memory Explorer's time bars, the stage-choice procedure (``plan``) and the
book's multi-node figures all ask a ``Node`` which link a collective runs on.

A ring collective over ``n`` ranks of such nodes (NCCL's ring algorithm):

* inside one node (n <= gpus) every hop is the intra-node fabric (NVLink);
* across nodes, NCCL runs one ring (channel) per NIC. Each ring crosses every
  node boundary once, so the bytes one GPU sends, 2S(N-1)/N for an all-reduce
  of S bytes, leave the node *in total* through its ``nics`` NICs, while each
  GPU still sends its own bytes over NVLink. The ring's pace per rank — its
  "bus bandwidth", what nccl-tests prints as busbw — is therefore

        min(intra-node bandwidth, nics x nic_bandwidth)

  A DGX A100 (8 x 200 Gb/s = 200 GB/s < NVLink's 300) is set by its NICs; a
  node with one 100 GbE NIC runs every cross-node ring at 12.5 GB/s. (Charging
  the whole ring to one NIC would make a DGX 8x too slow.)

Bandwidths are line rates per direction; ``theory.published`` sets the model
against published nccl-tests and ZeRO++ figures (the model is 4-25 % optimistic).
"""
from __future__ import annotations

from dataclasses import dataclass, replace

from zerolab.theory.network import LINKS, Link, get_link

GB = 1e9


@dataclass(frozen=True)
class Node:
    """One kind of node: ``gpus`` GPUs joined by ``intra`` (per GPU, per direction) and
    ``nics`` NICs of ``nic_bandwidth`` bytes/s per direction each, ``nic_latency`` s per message."""
    name: str
    gpus: int
    nics: int
    nic_bandwidth: float
    intra: Link
    nic_latency: float = 5e-6

    def __post_init__(self):
        for key in ("gpus", "nics"):
            v = getattr(self, key)
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ValueError(f"Node {key} must be an integer >= 1, got {v!r}")
        if self.nic_bandwidth <= 0:
            raise ValueError(f"Node nic_bandwidth must be > 0 bytes/s, got {self.nic_bandwidth!r}")
        if not isinstance(self.intra, Link):
            raise ValueError(f"Node intra must be a zerolab.Link, got {self.intra!r}")

    @property
    def network_bandwidth(self) -> float:
        """Bytes/s one node sends to the network per direction, all NICs together."""
        return self.nics * self.nic_bandwidth

    def spans(self, group: int) -> bool:
        """Does a group of ``group`` consecutive ranks cross a node boundary?"""
        return group > self.gpus

    def link_for(self, group: int) -> Link:
        """The link a ring over ``group`` ranks runs at: NVLink inside a node; across nodes
        the slower of NVLink and the node's NICs together (module docstring)."""
        if not self.spans(group):
            return self.intra
        bw = min(self.intra.bandwidth, self.network_bandwidth)
        return Link(f"{self.name} ring across nodes", bw, max(self.intra.latency, self.nic_latency))

    def nic_share(self) -> Link:
        """One GPU's share of the node's NICs: what a point-to-point message between nodes runs at
        (a pipeline's send, every GPU of the node sending beside it)."""
        return Link(f"{self.name} NIC share", self.network_bandwidth / self.gpus, self.nic_latency)

    def group_link(self, members=None, *, size: int | None = None, per_node: int | None = None) -> Link:
        """The link a ring over a group runs at, from where its ranks sit (rank r on node r // gpus).

        ``members``: the group's global ranks; or ``size`` and ``per_node`` (ranks of the group on each
        node it touches). A group inside one node runs on ``intra``. A group that crosses nodes with
        ``per_node`` ranks on each shares the node's NICs with the ``gpus / per_node`` groups like it
        that run beside it (the other local ranks' groups: 8 one-rank-per-node groups of a DGX share
        its 8 NICs, one each; the world group, 8 ranks per node, has them all):

            bandwidth = min(intra, nics x nic_bandwidth x per_node / gpus)
        """
        if members is not None:
            members = sorted(set(int(r) for r in members))
            on = {}
            for r in members:
                on[r // self.gpus] = on.get(r // self.gpus, 0) + 1
            size, per_node = len(members), max(on.values())
            crosses = len(on) > 1
        else:
            if size is None or per_node is None or size < 1 or not 1 <= per_node <= min(size, self.gpus):
                raise ValueError(f"group_link needs members, or size >= 1 and 1 <= per_node <= min(size, gpus "
                                 f"{self.gpus}); got size={size!r}, per_node={per_node!r}")
            crosses = size > per_node
        if not crosses:
            return self.intra
        bw = min(self.intra.bandwidth, self.network_bandwidth * per_node / self.gpus)
        return Link(f"{self.name} ring across nodes, {per_node} per node", bw, max(self.intra.latency, self.nic_latency))

    def with_nics(self, nics: int, nic_bandwidth: float | None = None) -> "Node":
        """The same node with another NIC count (and speed): ``DGX_A100.with_nics(1)``."""
        bw = self.nic_bandwidth if nic_bandwidth is None else nic_bandwidth
        return replace(self, name=f"{self.name.split(' [')[0]} [{nics} x {bw * 8 / GB:g} Gb/s]",
                       nics=nics, nic_bandwidth=bw)

    def __str__(self):
        return (f"{self.name}: {self.gpus} GPUs on {self.intra.name} ({self.intra.bandwidth / GB:g} GB/s), "
                f"{self.nics} x {self.nic_bandwidth * 8 / GB:g} Gb/s NIC{'s' if self.nics > 1 else ''} = {self.network_bandwidth / GB:g} GB/s")


# Presets (line rates per direction; sources in the comments).
NODES = {
    # NVIDIA DGX A100: 8 A100 on NVLink3/NVSwitch (600 GB/s both ways = 300 per direction),
    # 8 ConnectX-6 HDR 200 Gb/s NICs for the compute fabric, one per GPU.
    "dgx-a100": Node("DGX A100", 8, 8, 200e9 / 8, LINKS["nvlink3"]),
    # NVIDIA DGX H100: 8 H100 on NVLink4 (900 GB/s = 450 per direction), 8 ConnectX-7 NDR 400 Gb/s.
    "dgx-h100": Node("DGX H100", 8, 8, 400e9 / 8, LINKS["nvlink4"]),
    # A cloud VM with 8 NVLink-connected A100 and a single 100 GbE NIC (25 us per message).
    "cloud-100gbe": Node("cloud 8 x A100, 1 x 100 GbE", 8, 1, 100e9 / 8, LINKS["nvlink3"], 25e-6),
    # NVIDIA DGX-2 (the ZeRO++ paper's cluster): 16 V100 on NVSwitch (NVLink2: 6 x 25 = 150 GB/s
    # per direction), 8 x 100 Gb/s EDR InfiniBand NICs (the paper ran it with 4 and with 1).
    "dgx-2": Node("DGX-2", 16, 8, 100e9 / 8, Link("nvlink2", 150 * GB, 3e-6)),
}


def get_node(node) -> Node | None:
    """``None``, a ``Node``, or a preset name from ``NODES``."""
    if node is None or isinstance(node, Node):
        return node
    try:
        return NODES[node]
    except (KeyError, TypeError):
        raise ValueError(f"unknown node {node!r}; presets: {sorted(NODES)} (or pass a zerolab.theory.Node)") from None


def node_from_links(link, inter_link=None, gpus_per_node=None) -> Node:
    """The node the (link, inter_link, gpus_per_node) arguments describe: ``link`` inside,
    ONE NIC of ``inter_link``'s speed per node (so a cross-node ring runs at that NIC's speed).
    Without ``gpus_per_node`` every rank is in one node and ``link`` carries everything."""
    intra = get_link(link)
    if not isinstance(intra, Link):
        raise ValueError("link must be a zerolab.Link or a preset name from zerolab.LINKS")
    inter = get_link(inter_link)
    if inter is not None and gpus_per_node is None:
        raise ValueError("inter_link needs gpus_per_node (which ranks share a node?)")
    if gpus_per_node is None:
        return Node(f"one {intra.name} domain", 2**62, 1, intra.bandwidth, intra)
    inter = inter or intra
    return Node(f"{gpus_per_node} GPUs on {intra.name}, 1 x {inter.name}", gpus_per_node, 1,
                inter.bandwidth, intra, inter.latency)
