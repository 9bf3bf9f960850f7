"""runtime/wire.py: the kernel's loopback counters around gloo collectives, against the ledger's
algorithm bytes (issue 14): all-reduce and all-gather about 1x, reduce-scatter about 2x."""
from __future__ import annotations

import pytest
import torch

import zerolab as zl
from zerolab.runtime import wire
from zerolab.runtime.comm import Communicator

pytestmark = pytest.mark.skipif(not wire.available(), reason="no loopback byte counters on this machine")


def _collectives(numel):
    c = Communicator()
    n = c.world_size
    c.all_reduce(torch.ones(8))                        # warm-up: gloo opens its connections
    big, part = torch.ones(numel), torch.ones(numel // n)
    calls = {"all_reduce": lambda: c.all_reduce(big),
             "reduce_scatter": lambda: c.reduce_scatter(torch.empty(numel // n), big),
             "all_gather": lambda: c.all_gather(torch.empty(numel), part)}
    out = {}
    for op, call in calls.items():
        c.ledger.reset()
        call()
        out[op] = (c.ledger.total_bytes() * n, wire.wire_bytes(call, c.barrier))   # all ranks' algorithm bytes
    return out


def test_gloo_wire_bytes_against_algorithm_bytes():
    got = zl.launch(_collectives, world_size=2, args=(1_000_000,), timeout=120)[0]
    ratio = {op: wire_b / algo for op, (algo, wire_b) in got.items()}
    assert 0.85 <= ratio["all_reduce"] <= 1.25, got
    assert 0.85 <= ratio["all_gather"] <= 1.25, got
    assert 1.7 <= ratio["reduce_scatter"] <= 2.5, got          # gloo: an all-reduce inside


def test_planted_frozen_counter_is_caught(monkeypatch):
    """A counter that never moves (reading the wrong interface) measures 0 bytes: the ratio
    test above would fail on it; here the helper is shown to report exactly that."""
    monkeypatch.setattr(wire, "loopback_bytes", lambda: 12345)
    assert wire.wire_bytes(lambda: None, lambda: None) == 0


def test_missing_counters_and_bad_repeats(monkeypatch, tmp_path):
    monkeypatch.setattr(wire, "SYSFS", str(tmp_path / "missing"))
    monkeypatch.setattr(wire, "PROCFS", str(tmp_path / "missing2"))
    assert wire.loopback_bytes() is None
    assert wire.wire_bytes(lambda: None, lambda: None) is None
    dev = tmp_path / "dev"
    dev.write_text("Inter-|   Receive\n face |bytes packets\n    lo: 100 2 0 0 0 0 0 0 777 3 0 0 0 0 0 0\n")
    monkeypatch.setattr(wire, "PROCFS", str(dev))
    assert wire.loopback_bytes() == 777                       # transmit bytes from /proc/net/dev
    with pytest.raises(ValueError, match="repeats"):
        wire.wire_bytes(lambda: None, lambda: None, repeats=0)
