"""Ring algorithms and links: what a collective sends, and how long it takes.

The single source for "bytes one rank sends" (used by ``theory.comm_volume``
and by the ``comm`` ledger) and for the alpha-beta time model (used by the
simulated link and chapter 2). Pure Python: nothing distributed here.

Alpha-beta model: a collective that takes ``s`` sequential message steps and
makes each rank send ``b`` bytes costs ``s * alpha + b / beta`` seconds, where
alpha is the per-message latency and beta the per-direction bandwidth.
"""
from __future__ import annotations

from dataclasses import dataclass

OPS = ("all_reduce", "reduce_scatter", "all_gather", "broadcast", "all_to_all")


def ring_bytes(op: str, nbytes: int, n: int, rank: int = 0, src: int = 0) -> int:
    """Bytes one rank sends for ``op`` under the bandwidth-optimal ring algorithm.

    ``nbytes`` is the size of the *full* tensor: the all-reduced tensor, the
    reduce-scatter input, the all-gather output, the broadcast tensor, the
    all-to-all input. Chapter 2 derives each line.
    """
    if n < 1:
        raise ValueError(f"n (number of ranks) must be >= 1, got {n}")
    if n == 1:
        return 0
    if op == "all_reduce":        # reduce-scatter, then all-gather
        return 2 * nbytes * (n - 1) // n
    if op in ("reduce_scatter", "all_gather", "all_to_all"):
        return nbytes * (n - 1) // n
    if op == "broadcast":         # pipelined chain src -> src+1 -> ...: the last link sends nothing
        return 0 if (rank - src) % n == n - 1 else nbytes
    raise ValueError(f"unknown collective {op!r}; expected one of {OPS}")


def ring_steps(op: str, n: int) -> int:
    """Sequential message steps (each pays the latency alpha once)."""
    if n <= 1:
        return 0
    return 2 * (n - 1) if op == "all_reduce" else n - 1


@dataclass(frozen=True)
class Link:
    """A network link in the alpha-beta model.

    bandwidth: bytes per second in *one* direction (a "600 GB/s" NVLink figure
    is the two-way total: 300 GB/s each way). latency: seconds per message.
    """
    name: str
    bandwidth: float
    latency: float = 0.0

    def __post_init__(self):
        if self.bandwidth <= 0:
            raise ValueError(f"Link bandwidth must be > 0 bytes/s, got {self.bandwidth}")
        if self.latency < 0:
            raise ValueError(f"Link latency must be >= 0 s, got {self.latency}")

    def time(self, op: str, nbytes: int, n: int, rank: int = 0, src: int = 0) -> float:
        """Seconds ``op`` on a ``nbytes`` tensor across ``n`` ranks takes on this link."""
        return ring_steps(op, n) * self.latency + ring_bytes(op, nbytes, n, rank, src) / self.bandwidth

    def __str__(self):
        return f"{self.name} ({self.bandwidth / 1e9:g} GB/s per direction, {self.latency * 1e6:g} us)"


GB = 1e9
# Presets for the links the book discusses (per-direction bandwidths).
LINKS = {
    "nvlink3": Link("nvlink3", 300 * GB, 3e-6),            # A100: "600 GB/s" = 2 x 300 GB/s
    "nvlink4": Link("nvlink4", 450 * GB, 3e-6),            # H100: "900 GB/s" = 2 x 450 GB/s
    "pcie4": Link("pcie4", 32 * GB, 5e-6),                 # PCIe 4.0 x16, nominal
    "infiniband-200g": Link("infiniband-200g", 25 * GB, 5e-6),   # HDR 200 Gb/s
    "ethernet-100g": Link("ethernet-100g", 12.5 * GB, 25e-6),
    "ethernet-10g": Link("ethernet-10g", 1.25 * GB, 50e-6),
    # A slow link sized for the book's tiny CPU models, so that overlap and
    # prefetch have something to hide: 1 GB/s, 200 us per message.
    "demo": Link("demo", 1 * GB, 200e-6),
}


def get_link(link) -> Link | None:
    """``None``, a ``Link``, or a preset name from ``LINKS``."""
    if link is None or isinstance(link, Link):
        return link
    try:
        return LINKS[link]
    except KeyError:
        raise ValueError(f"unknown link {link!r}; presets: {sorted(LINKS)} (or pass a zerolab.Link)") from None
