"""What gloo really sends: the kernel's loopback byte counters around a step (chapter 2).

The ledger (``engine.comm``, ``runtime/comm.py``) books *algorithm bytes*: the ring
algorithm's bytes computed from each call's tensor sizes (``theory.ring_bytes``). It
never looks at a wire. On one machine gloo's ranks talk over TCP on the loopback
interface, and the kernel counts every byte it carries: ``/sys/class/net/lo/statistics/
tx_bytes`` (or the "lo" line of ``/proc/net/dev``). Reading it before and after a step
gives what all ranks together really sent, TCP/IP headers and acknowledgements included.

Two caveats the book states beside the figure. The counter is per network namespace,
so any other process using loopback at the same time adds to it: ``wire_bytes`` runs
the step ``repeats`` times and keeps the smallest difference (others only add). And
the figure is gloo's own algorithm, not the ring's: gloo implements reduce-scatter
with an all-reduce, so it moves about twice the ledger's bytes for it.
"""
from __future__ import annotations

import os

SYSFS = "/sys/class/net/lo/statistics/tx_bytes"
PROCFS = "/proc/net/dev"


def loopback_bytes() -> int | None:
    """Bytes the loopback interface has carried since boot, or ``None`` where the kernel does
    not expose them (not Linux, or no ``lo``)."""
    try:
        with open(SYSFS) as f:
            return int(f.read())
    except (OSError, ValueError):
        pass
    try:
        with open(PROCFS) as f:
            for line in f:
                name, _, rest = line.partition(":")
                if name.strip() == "lo":
                    return int(rest.split()[8])      # transmit bytes (receive bytes are the 1st field)
    except (OSError, ValueError, IndexError):
        pass
    return None


def available() -> bool:
    """True when the loopback counters can be read on this machine."""
    return loopback_bytes() is not None and os.name == "posix"


def wire_bytes(step, barrier, repeats: int = 3) -> int | None:
    """Call on every rank: the loopback bytes one ``step()`` made all ranks send together,
    the smallest of ``repeats`` tries (``barrier()`` brackets each, so every rank is inside
    the window; its own few bytes are counted too). ``None`` where the counters are missing."""
    if repeats < 1:
        raise ValueError(f"repeats must be >= 1, got {repeats!r}")
    best = None
    for _ in range(repeats):
        barrier()
        before = loopback_bytes()
        step()
        barrier()
        after = loopback_bytes()
        if before is None or after is None:
            return None
        best = after - before if best is None else min(best, after - before)
    return best
