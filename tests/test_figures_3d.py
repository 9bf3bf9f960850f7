"""Chapter 10's helpers: the mesh figure says what the runtime's layout says; the pipeline replay gives the
textbook step time and catches a deadlock; the 3-D run's ledger bytes equal theory.comm_breakdown's; the
sleeping pipeline holds p - s micro-batches in flight under 1F1B and m under GPipe."""
from __future__ import annotations

import pytest

import zerolab as zl
from zerolab.book import runs3d
from zerolab.book.figures_3d import mesh_cells, mesh_figure, timeline_figure
from zerolab.parallel import schedule
from zerolab.runtime.mesh import coordinates, mesh_layout


def infos(dp, tp, pp, k):
    lay = mesh_layout(dp, tp, pp)
    out = []
    for r in range(dp * tp * pp):
        c = coordinates(r, dp, tp, pp)
        out.append({"rank": r, "node": r // k, **c,
                    "groups": {g: next(x for x in lay[g] if r in x) for g in ("dp", "pp", "tp")}})
    return out


def test_mesh_figure_writes_each_ranks_layers_and_shards():
    cells = {r: lines for r, _, lines in mesh_cells(infos(2, 2, 2, 4), n_layer=4)}
    # TP innermost, then PP, DP outermost: rank 6 = (dp 1, pp 1, tp 0), on node 1
    assert cells[6] == ["rank 6", "PP stage 1: layers 2-3", "TP shard 0/2", "ZeRO shard 1/2"]
    assert cells[1] == ["rank 1", "PP stage 0: layers 0-1", "TP shard 1/2", "ZeRO shard 0/2"]
    fig, alt = mesh_figure(infos(2, 2, 2, 4), n_layer=4)
    texts = [t.get_text() for t in fig.axes[0].texts]
    assert sum(t.startswith("rank ") for t in texts) == 8 and "node 1" in texts
    assert "TP groups [[0, 1], [2, 3], [4, 5], [6, 7]]" in alt and "DP groups [[0, 4], [1, 5], [2, 6], [3, 7]]" in alt


def test_mesh_figure_follows_the_layout_it_is_given():
    # a planted layout with PP innermost would put rank 1 on stage 1: the figure must say so
    swapped = infos(2, 2, 2, 4)
    for i in swapped:
        i["pp"], i["tp"] = i["rank"] % 2, i["rank"] // 2 % 2
    cells = {r: lines for r, _, lines in mesh_cells(swapped, n_layer=4)}
    assert cells[1][1] == "PP stage 1: layers 2-3"


def test_mesh_figure_from_a_real_launch():
    got = zl.launch(runs3d.mesh_info, 8, args=(2, 2, 2, 4), ranks_per_node=4, timeout=120, threads=1)
    want = infos(2, 2, 2, 4)
    for g, w in zip(got, want):
        assert {k: g[k] for k in w} == w


@pytest.mark.parametrize("p,m", [(2, 4), (4, 8), (3, 3), (1, 5)])
def test_replay_gives_the_textbook_step(p, m):
    for kind in ("gpipe", "1f1b"):
        orders = [schedule(kind, m, p, s) for s in range(p)]
        assert runs3d.replay(orders, 1.0, 2.0) == pytest.approx((m + p - 1) * 3.0)


def test_replay_catches_a_deadlock_and_a_backward_before_its_forward():
    # stage 0 runs F0 then B0 at once: B0 waits for stage 1's B0, which comes after its F1, which waits
    # for stage 0's F1, which comes after B0: stuck
    p, m = 3, 4
    orders = [schedule("1f1b", m, p, s) for s in range(p)]
    orders[0] = [("F", 0), ("B", 0)] + [x for x in orders[0] if x not in (("F", 0), ("B", 0))]
    assert runs3d.replay(orders) is None
    assert runs3d.replay([[("B", 0), ("F", 0)]]) is None


@pytest.fixture(scope="module")
def run_122():
    return runs3d.run_3d(1, 2, 2, refuse=True)


def test_a_3d_run_books_what_the_formulas_say(run_122):
    for r in run_122:   # dp = 1: no DP bytes; TP and PP: theory.comm_breakdown's, per stage
        assert r["bytes"] == r["predicted"] and r["dp_slice"] == 0, r["coords"]
        assert r["memory"]["params"] == r["exact"]["params"] and r["memory"]["optimizer"] == r["exact"]["optimizer"]
    assert len({tuple(r["losses"]) for r in run_122}) == 1
    assert "only ZeRO-0/1 with pp > 1" in run_122[0]["refused"][2] and run_122[0]["refused"][3]


def test_the_sleeping_pipeline_in_flight_and_timeline():
    runs = {k: runs3d.bubble_run(2, 4, k, tf=0.01, tb=0.02, width=16, rows=4) for k in ("gpipe", "1f1b")}
    assert [s["peak"] for s in runs["gpipe"]] == [4, 4] and [s["peak"] for s in runs["1f1b"]] == [2, 1]
    for stages in runs.values():
        for s in stages:
            assert [k for k, _, _ in s["events"]].count("B") == 4 and 0 < s["idle"] < 1
    fig, alt = timeline_figure(runs)
    assert len(fig.axes) == 2 and "in flight [2, 1]" in alt
