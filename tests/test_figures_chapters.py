"""Chapter 2 and 7 figures (zerolab.book.figures_comm / figures_offload) show the package's real state.

Each check compares what a figure draws with the source it claims to draw from, and a planted
wrong source (a different N, K, or cost model) must change the picture or its alt text.
"""
import pytest

import zerolab as zl
from zerolab.book import figures_comm, figures_offload
from zerolab.book.ring import ring_allreduce_states
from zerolab.runtime.nodes import inter_fraction
from zerolab.theory import offload as cost


@pytest.mark.parametrize("n", [2, 3, 4, 5])
def test_ring_figure_draws_every_state_and_names_the_finished_chunks(n):
    fig, alt = figures_comm.ring_figure(n)
    states = ring_allreduce_states(n)
    assert len(fig.axes) == 2 * (n - 1) + 1
    for ax, state in zip(fig.axes, states):          # the grid drawn is the simulation's
        drawn = ax.images[0].get_array()
        assert [[round(float(drawn[r][c]) * n) for c in range(n)] for r in range(n)] == \
            [[len(state[r][c]) for c in range(n)] for r in range(n)]
    assert all(f"rank {r}: chunk {(r + 1) % n}" in alt for r in range(n))
    assert f"{n - 1} reduce-scatter steps" in alt


@pytest.mark.parametrize("n,k", [(4, 2), (8, 4), (6, 2), (4, 4)])
def test_node_ring_figure_states_the_ledger_rule(n, k):
    fig, alt = figures_comm.node_ring_figure(n, k)
    crossing = sum(1 for r in range(n) if r // k != ((r + 1) % n) // k)
    share = inter_fraction("all_reduce", list(range(n)), 0, k)
    assert share == crossing / n
    assert f"{crossing} of the {n} ring links" in alt and f"books {share:g} of every rank" in alt
    assert len(fig.axes[0].texts) >= n


def test_planted_wrong_node_size_changes_the_figure():
    assert figures_comm.node_ring_figure(8, 4)[1] != figures_comm.node_ring_figure(8, 2)[1]


@pytest.mark.parametrize("psi,n", [(7e9, 8), (7.5e9, 64), (1e6, 3)])
def test_tier_figure_draws_the_estimate(psi, n):
    fig, alt = figures_offload.tier_figure(psi, n)
    ax = fig.axes[0]
    rows = figures_offload.tiers(psi, n)
    for (stage, oo, op), row in zip(figures_offload.SETTINGS, rows):
        e = zl.estimate(psi, n, stage, offload_optimizer=oo, offload_param=op)
        assert (row["total"], row["host"], row["nvme"]) == (e.total, e.host, e.nvme)
    heights = [p.get_height() for p in ax.patches]
    m = len(rows)
    assert heights == pytest.approx([r[t] / 1e9 for t in figures_offload.TIERS for r in rows])
    assert len(heights) == 3 * m and f"device {rows[3]['total'] / 1e9:.2f} GB" in alt


def test_path_bytes_are_the_cost_models():
    assert figures_offload.path_bytes() == pytest.approx({"pcie": 4, "host": 30, "nvme": 24})
    fig, alt = figures_offload.offload_path_figure()
    assert "moves 30 B through host memory" in alt and "read (12 B)" in alt


def test_planted_different_cost_model_changes_the_path(monkeypatch):
    real = cost.offload_seconds

    def doubled(*a, **kw):
        return {k: 2 * v for k, v in real(*a, **kw).items()}
    monkeypatch.setattr(cost, "offload_seconds", doubled)
    assert figures_offload.path_bytes()["nvme"] == pytest.approx(48)
