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
