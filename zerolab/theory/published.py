"""The node model against published measurements (chapters 2, 11).

Two kinds of figures, each with its source (cited, never re-measured here):

* nccl-tests all-reduce **bus bandwidth** (busbw = bytes x 2(N-1)/N / time, what one rank's
  ring moves per second): the model's busbw is ``Node.link_for(n).bandwidth``.
* the ZeRO++ blog's **throughput ratios** on 384 V100 (24 DGX-2 nodes): the model's ratio is
  (compute + ZeRO-3 communication) / (compute + ZeRO++ communication), nothing overlapped,
  with compute at an *assumed* V100 rate (``V100_FLOPS``) — stated beside the result.

``TOLERANCE``: the model uses line rates, so it should be at or above a measured busbw and
at most 30 % above it (NCCL's protocol overhead on NVLink is about 20 %, NVIDIA/nccl-tests#212).
"""
from __future__ import annotations

from dataclasses import dataclass

from zerolab.theory.comm import step_comm_time
from zerolab.theory.nodes import NODES, Node

TOLERANCE = (0.95, 1.30)    # model / published, for bus bandwidths
V100_FLOPS = 40e12          # assumed achieved fp16 FLOP/s per V100 in the ZeRO++ runs (32 % of 125 peak)


@dataclass(frozen=True)
class BusBW:
    """A published nccl-tests all-reduce bus bandwidth (GB/s) on ``nodes`` nodes of ``node``."""
    what: str
    node: Node
    nodes: int
    published_gbs: float
    source: str

    @property
    def model_gbs(self) -> float:
        return self.node.link_for(self.nodes * self.node.gpus).bandwidth / 1e9

    @property
    def ratio(self) -> float:
        return self.model_gbs / self.published_gbs


BUS_BANDWIDTHS = (
    BusBW("DGX A100, 8 x HDR 200 Gb/s, multi-node", NODES["dgx-a100"], 4, 192.0,
          "NVIDIA/nccl#812 (NVIDIA: '8x200Gbit/s IB ... we measure 192GB/s AllReduce BusBW')"),
    BusBW("HGX A100, 4 x HDR 200 Gb/s, 2 nodes", NODES["dgx-a100"].with_nics(4), 2, 91.0,
          "NVIDIA/nccl-tests#100 (user measurement, 91 GB/s busbw)"),
    BusBW("DGX H100, 8 x NDR 400 Gb/s, multi-node (46-48 GB/s per NIC)", NODES["dgx-h100"], 4, 8 * 47.0,
          "NVIDIA/nccl-tests#290 (NVIDIA: 'For NDR @ 400Gbps you should see 46-48GB/s per NIC')"),
    BusBW("H200, 8 x 400 Gb/s, 248 nodes", NODES["dgx-h100"], 248, 350.0,
          "NVIDIA/nccl-tests#283 (user: 'typically measuring around 350G')"),
    BusBW("A100, one node, NVLink ring", NODES["dgx-a100"], 1, 240.0,
          "NVIDIA/nccl#1712 (NVIDIA: 'you should be seeing close to 240 GB/s')"),
    BusBW("H100, one node, NVLink ring", NODES["dgx-h100"], 1, 370.0,
          "NVIDIA/nccl-tests#212 (NVIDIA: 'effective NVLink bandwidth of 370GB/s' with NCCL_ALGO=RING)"),
)


@dataclass(frozen=True)
class SpeedUp:
    """A published ZeRO++-over-ZeRO-3 throughput ratio (low, high) for ``psi`` on ``n`` GPUs."""
    what: str
    node: Node
    n: int
    psi: float
    tokens: int                  # tokens per GPU per micro-batch
    published: tuple[float, float]
    source: str

    def model(self, flops: float = V100_FLOPS) -> float:
        """(compute + ZeRO-3 comm) / (compute + ZeRO++ comm), fp16, no overlap, 6Ψ FLOPs/token."""
        compute = 6 * self.psi * self.tokens / flops
        base = step_comm_time(self.psi, self.n, 3, node=self.node)
        pp = step_comm_time(self.psi, self.n, 3, node=self.node, quantized_weights=True,
                            quantized_gradients=True, hpz=True)
        return (compute + base) / (compute + pp)

    def ratio(self, flops: float = V100_FLOPS) -> float:
        """Model over the middle of the published range."""
        return self.model(flops) / (sum(self.published) / 2)


_BLOG = "DeepSpeed ZeRO++ blog (microsoft/DeepSpeed blogs/zeropp, 2023), 384 V100"
SPEEDUPS = (
    SpeedUp("18B, 4 x 100 Gb/s per node, 1k tokens/GPU", NODES["dgx-2"].with_nics(4), 384, 18e9, 1024,
            (1.28, 1.36), _BLOG + ", fig. 6: +28 % to +36 % at 1k tokens per GPU"),
    SpeedUp("18B, 4 x 100 Gb/s per node, 2k tokens/GPU", NODES["dgx-2"].with_nics(4), 384, 18e9, 2048,
            (1.24, 1.29), _BLOG + ", fig. 6: +24 % to +29 % at 2k tokens per GPU"),
    SpeedUp("18B, 1 x 100 Gb/s per node, 1k tokens/GPU", NODES["dgx-2"].with_nics(1), 384, 18e9, 1024,
            (2.0, 2.2), _BLOG + ", fig. 7: about 2x on average, up to 2.2x at 100 Gb/s"),
)


def comparison_text(flops: float = V100_FLOPS) -> str:
    """Model vs published, side by side with the ratio (the table chapter 12 prints)."""
    lines = [f"{'nccl-tests all-reduce busbw':<62}{'model':>8}{'published':>11}{'ratio':>7}   source"]
    for b in BUS_BANDWIDTHS:
        lines.append(f"{b.what:<62}{b.model_gbs:>6.0f} GB/s{b.published_gbs:>6.0f} GB/s{b.ratio:>6.2f}   {b.source}")
    lines.append(f"\n{'ZeRO++ / ZeRO-3 throughput (compute at %.0f TFLOP/s, assumed)' % (flops / 1e12):<62}"
                 f"{'model':>8}{'published':>11}{'ratio':>7}   source")
    for s in SPEEDUPS:
        lo, hi = s.published
        lines.append(f"{s.what:<62}{s.model(flops):>7.2f}x{lo:>6.2f}-{hi:.2f}x{s.ratio(flops):>6.2f}   {s.source}")
    return "\n".join(lines)
