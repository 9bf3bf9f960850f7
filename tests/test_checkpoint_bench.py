"""The checkpoint bench runs and its figures hang together (issue 11, bench; not timed).

``python -m zerolab.bench.checkpoint`` on TinyGPT micro at 2 ranks: every stage
saves and loads, the bytes each rank wrote match the files, a load copies out
exactly the rank's share, and consolidation's output is 4 bytes per parameter.
"""
from __future__ import annotations

from zerolab.bench.checkpoint import report, run


def test_checkpoint_bench_figures(tmp_path):
    res = run("micro", (2,), str(tmp_path))
    per_rank = res["save_load"][2]
    psi = per_rank[0][0]["psi"]
    for stage in range(4):
        rows = [r[stage] for r in per_rank]
        assert all(r["save_seconds"] > 0 and r["load_seconds"] > 0 for r in rows)
        # every rank writes its fp32 + Adam slice (12 bytes x padded psi / 2) and a little more
        assert all(r["save_bytes"] >= 12 * psi / 2 for r in rows), (stage, rows)
        expected_read = 12 * psi if stage == 0 else 12 * psi / 2   # stage 0 holds everything
        assert all(abs(r["load_bytes_read"] - expected_read) <= 12 * 64 for r in rows), (stage, rows)
    assert res["consolidate"]["output"] == 4 * psi
    assert res["reshard"]["ranks"][0]["read"] == 12 * psi   # loaded at 1 rank: the whole state
    text = report(res)
    assert "reshard: saved at 2 ranks stage 1, loaded at 1 ranks stage 3" in text
