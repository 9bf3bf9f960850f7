"""zerolab.book.figures_zeropp (chapter 9): the topology figure shows the runtime's own groups; the tier figure, the ledger's bytes beside the model's."""
import pytest

from zerolab.book.figures_zeropp import topology_figure
from zerolab.runtime.nodes import node_layout


def test_topology_uses_the_runtime_layout():
    fig, alt = topology_figure(8, 4)
    intra, inter = node_layout(8, 4)
    assert intra == [[0, 1, 2, 3], [4, 5, 6, 7]] and inter == [[0, 4], [1, 5], [2, 6], [3, 7]]
    assert str(intra) in alt and str(inter) in alt
    texts = [t.get_text() for t in fig.axes[0].texts]
    assert sum(t.startswith("rank ") for t in texts) == 8
    assert "secondary 1/4" in texts and "primary 5/8" in texts


def test_planted_wrong_layout_is_caught():
    _, alt = topology_figure(8, 2)
    assert str(node_layout(8, 4)[0]) not in alt


# ---- tier_bytes_figure: the ledger's bytes per tier beside the model's (chapter 9's second figure) ----

def measured_like(qgz_inter=50_760):
    """The shape of ``zeropp.measure_variants``' rows (bytes per rank and step), as a 2 x 2 run gave them."""
    rows = {"ZeRO-3": (67_680, 67_680), "qwZ": (45_180, 45_180), "hpZ": (75_200, 45_120),
            "qgZ": (56_400, qgz_inter), "ZeRO++": (52_670, 16_950)}
    return {n: {"intra": float(a), "inter": float(b), "predicted": {"intra": a, "inter": b}} for n, (a, b) in rows.items()}


def test_tier_bars_are_the_measured_and_predicted_bytes():
    from zerolab.book.figures_zeropp import tier_bytes_figure
    m = measured_like()
    fig, alt = tier_bytes_figure(m)
    heights = [p.get_height() for p in fig.axes[0].patches]
    names = list(m)
    expect = [m[n][t] / 1e3 for t in ("intra", "inter") for n in names] + \
             [m[n]["predicted"][t] / 1e3 for t in ("intra", "inter") for n in names]
    assert sorted(heights) == pytest.approx(sorted(expect)) and len(heights) == 4 * len(names)
    assert "ZeRO-3 67,680 inside the node and 67,680 across (predicted: the same)" in alt
    assert f"ZeRO++ sends {67_680 / 16_950:.1f} times fewer bytes across nodes" in alt


def test_planted_measurement_off_its_prediction_shows_in_the_alt():
    from zerolab.book.figures_zeropp import tier_bytes_figure
    m = measured_like()
    m["qgZ"]["inter"] += 36                      # a ledger that books bytes the model does not predict
    _, alt = tier_bytes_figure(m)
    assert "qgZ 56,400 inside the node and 50,796 across (predicted: 56,400 and 50,760)" in alt


@pytest.mark.parametrize("n, k", [(4, 2), (8, 4), (12, 4)])
def test_topology_lines_cross_no_rank_box(n, k):
    """A red inter-node line runs from one node's rank box to the next node's, in the gap between them:
    it never crosses the text of a box (the rank, its primary and secondary shard)."""
    fig, _ = topology_figure(n, k)
    ax = fig.axes[0]
    lines = [line for line in ax.lines if line.get_color() == "tab:red"]
    assert len(lines) == k * (n // k - 1)
    for line in lines:
        x, (y0, y1) = line.get_xdata()[0], sorted(line.get_ydata())
        inside = [t for t in ax.texts if abs(t.get_position()[0] - x) < 1e-9 and y0 < t.get_position()[1] < y1]
        assert not inside, [t.get_text() for t in inside]
