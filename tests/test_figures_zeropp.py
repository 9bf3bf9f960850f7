"""zerolab.book.figures_zeropp (chapter 9): the topology figure shows the runtime's own groups."""
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
