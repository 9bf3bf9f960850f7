"""A modelled GPU cluster for the replay: ``nodes`` nodes of a hardware preset (chapters 3-14; ``replay.py``)."""
from __future__ import annotations

from dataclasses import dataclass

from zerolab.theory.hardware import HARDWARE, Hardware, get_hardware
from zerolab.theory.replay_scale import ReplayError


@dataclass(frozen=True)
class Cluster:
    """``nodes`` nodes of ``hardware`` (a ``theory.HARDWARE`` preset)."""
    hardware: Hardware
    nodes: int = 1

    def __post_init__(self):
        if isinstance(self.nodes, bool) or not isinstance(self.nodes, int) or self.nodes < 1:
            raise ValueError(f"Cluster nodes must be an integer >= 1, got {self.nodes!r}")

    @property
    def gpus(self) -> int:
        return self.nodes * self.hardware.node.gpus

    def __str__(self):
        return f"{self.nodes} x {self.hardware.name}" if self.nodes > 1 else self.hardware.name


def get_cluster(cluster) -> Cluster:
    """A ``Cluster``; a ``Hardware`` (one node); or a preset name, ``"dgx-h100"`` or ``"dgx-h100:4"`` (4 nodes)."""
    if isinstance(cluster, Cluster):
        return cluster
    if isinstance(cluster, Hardware):
        return Cluster(cluster)
    name, _, nodes = str(cluster).partition(":")
    if name not in HARDWARE or (nodes and not nodes.isdigit()):
        raise ReplayError(f"unknown cluster {cluster!r}; presets: {sorted(HARDWARE)}, optionally ':NODES' "
                          f"(e.g. 'dgx-h100:2'), or a zerolab.theory.replay.Cluster")
    return Cluster(get_hardware(name), int(nodes or 1))
