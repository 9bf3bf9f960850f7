"""The bench's floor and memory columns (issue 16, points 2-3): efficiency against the floor,
peak minus model states, the peak-memory plot."""
from __future__ import annotations

import os

import pytest

from zerolab.bench import runner as bench
from zerolab.bench import specs as sp
from zerolab.bench.floor import floor_ms, with_floor
from zerolab.bench.report import plot_memory, world_table
from zerolab.theory.network import ring_bytes


def test_floor_is_the_slowest_ranks_median_and_scales_with_bytes():
    per_rank = [dict(compute=[0.010, 0.012, 0.011], optimizer=[0.002, 0.004, 0.003], comm=[0.002, 0.003, 0.002],
                     comm_bytes=1000),
                dict(compute=[0.011, 0.010, 0.013], optimizer=[0.003, 0.002, 0.004], comm=[0.004, 0.001, 0.002],
                     comm_bytes=1000)]
    f = floor_ms(per_rank)   # slowest rank per round: compute 11, 12, 13 -> 12 ms; optimizer 3, 4, 4 -> 4; comm 3
    assert f == pytest.approx(dict(compute_ms=12.0, optimizer_ms=4.0, comm_ms=3.0, comm_bytes=1000))
    row = with_floor(dict(bytes_per_step=500, median_ms=27.0), f)
    assert row["floor_ms"] == pytest.approx(13.5) and row["efficiency"] == pytest.approx(0.5)
    assert with_floor(dict(bytes_per_step=0, median_ms=12.0), f)["efficiency"] == pytest.approx(1.0)
    # a sharded contender (stage >= 1) on 4 ranks updates a quarter: 12 - 4 x 3/4 + 1.5 = 10.5 ms
    assert with_floor(dict(stage=1, bytes_per_step=500, median_ms=21.0), f, 4)["floor_ms"] == pytest.approx(10.5)
    assert with_floor(dict(stage=0, bytes_per_step=500, median_ms=21.0), f, 4)["floor_ms"] == pytest.approx(13.5)


def test_bench_reports_floor_efficiency_and_memory(tmp_path):
    result = bench.bench(world_sizes=[2], stages=[0, 1], steps=1, repeats=2, warmup=0, model="tiny",
                         out=str(tmp_path), verbose=False, timeout=300)
    world = result["runs"][0]
    f = world["floor"]
    assert f["compute_ms"] > 0 and f["comm_ms"] > 0
    assert f["comm_bytes"] == ring_bytes("all_reduce", 4 * sp.model_params("tiny"), 2)
    for r in world["contenders"]:
        assert 0 < r["efficiency"] < 5 and r["floor_ms"] >= f["compute_ms"], r
        assert r["peak_minus_states_bytes"] == max(r["peak_bytes"]) - r["states_theory_bytes"]
    table = world_table(result, world)
    assert "eff" in table and "peak-16Ψ/N" in table and "floor, same run" in table
    assert os.path.getsize(tmp_path / "bench_memory.png") > 1000 and "memory_png" in result["files"]
    assert plot_memory(dict(result, mode="overlap"), str(tmp_path / "x.png")) is None
