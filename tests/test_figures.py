"""The book's conceptual figures (zerolab.book.figures) and alt text on every shown image (issue 15, point 3).

Headless, in tests/test_widgets.py's style: the data a figure draws is checked against the
engine's layout, changing the input changes the picture, and every image the chapters
display carries alt text in the HTML that nbconvert renders.
"""
import hashlib

import pytest
import torch

from zerolab.book import figures, plots
from zerolab.book.models import TinyGPT
from zerolab.engine.buckets import group_units
from zerolab.engine.flat import FlatParams


def layout(n):
    return FlatParams(TinyGPT.preset("micro", seed=1), world_size=n, rank=0, dtype=torch.float32, device="cpu")


def digest(fig) -> str:
    return hashlib.sha256(plots.figure_png(fig)).hexdigest()


def test_sharded_categories_come_from_the_estimate():
    assert [figures.sharded(s) for s in range(4)] == [(), ("optimizer",), ("grads", "optimizer"),
                                                      ("params", "grads", "optimizer")]


@pytest.mark.parametrize("n", [2, 3, 4])
@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_holdings_match_the_engine_layout(n, stage):
    """Sharded: the ranks' pieces tile every padded unit exactly once, and a rank holds the engine's
    shard_numel elements. Replicated: every rank holds every real element."""
    flat = layout(n)
    held = figures.holdings(flat, stage)
    for cat, per_rank in held.items():
        assert len(per_rank) == n
        if cat in figures.sharded(stage):
            for u_i, u in enumerate(flat.units):
                pieces = sorted(per_rank[r][u_i] for r in range(n))
                assert pieces[0][0] == u.offset and pieces[-1][1] == u.offset + u.padded
                assert all(a[1] == b[0] for a, b in zip(pieces, pieces[1:]))
            for r in range(n):
                assert sum(b - a for a, b in per_rank[r]) == flat.shard_numel == flat.padded // n
        else:
            assert all(per_rank[r] == [(u.offset, u.offset + u.numel) for u in flat.units] for r in range(n))


def test_planted_wrong_stage_is_caught():
    """A holdings that ignored the stage would draw ZeRO-2 like DDP: the check above must see it."""
    flat = layout(3)
    assert figures.holdings(flat, 2)["grads"] != figures.holdings(flat, 0)["grads"]
    assert figures.holdings(flat, 1)["grads"] == figures.holdings(flat, 0)["grads"]


def test_partition_figure_draws_each_stage_and_says_so():
    fig, alt = figures.partition_figure(layout(3))
    assert len(fig.axes) == 4 and "ZeRO-3 every rank holds 1/3 of the params" in alt
    assert digest(fig) != digest(figures.partition_figure(layout(2))[0])        # N changes the picture


def test_bucket_path_follows_group_units():
    flat = layout(2)
    for limit in (1, 20_000, 10**9):
        fig, alt = figures.bucket_path_figure(flat, limit, op="reduce_scatter", gather_bucket=10**9)
        buckets = group_units(flat.units, limit)
        assert f"form {len(buckets)} bucket(s)" in alt and "reduce-scatter" in alt and "all-gather" in alt
        for i, b in enumerate(buckets):
            assert f"bucket {i}: {' + '.join(u.name for u in b)}" in alt
    assert digest(figures.bucket_path_figure(flat, 1)[0]) != digest(figures.bucket_path_figure(flat, 10**9)[0])


def test_activation_figure_reports_the_model():
    from zerolab.theory import activation_memory
    shape = dict(layers=36, hidden=4096, heads=32, seq_len=2048, micro_batch=1)
    fig, alt = figures.activation_figure(shape, seq_lens=(1024, 2048))
    flash = activation_memory(**{**shape, "seq_len": 2048}, flash_attention=True) / 1e9
    assert f"FlashAttention, linear in s, {flash:.0f} GB" in alt and len(fig.axes[0].lines) == 3


def test_show_gives_every_image_alt_text(monkeypatch):
    shown = []
    monkeypatch.setattr("IPython.display.display", lambda obj, raw=False: shown.append((obj, raw)))
    ax = plots.comm_bars([{"all_reduce": 8}], expected=8, title="bytes sent")
    plots.show(ax.figure)                                           # no alt given: the titles
    fig, alt = figures.partition_figure(layout(2), stages=(0,))
    plots.show(fig, alt=alt)
    (first, raw1), (second, raw2) = shown
    assert raw1 and raw2
    assert first["text/html"].startswith('<img alt="Figure: bytes sent"') and first["image/png"]
    assert 'alt="Partition picture for 2 ranks' in second["text/html"]


def test_nbconvert_finds_no_image_without_alt(tmp_path):
    """Render a notebook holding show()'s output with nbconvert's HTML exporter: no missing-alt warning."""
    nbformat = pytest.importorskip("nbformat")
    nbconvert = pytest.importorskip("nbconvert")
    fig, alt = figures.partition_figure(layout(2), stages=(0,))
    bundle = plots.image_bundle(plots.figure_png(fig), alt)
    nb = nbformat.v4.new_notebook(cells=[nbformat.v4.new_code_cell("show()", outputs=[
        nbformat.v4.new_output("display_data", data=bundle)])])
    html, _ = nbconvert.HTMLExporter().from_notebook_node(nb)
    assert "No description has been provided" not in html and f'alt="{alt[:40]}' in html


def test_partition_figure_marks_the_padding_visibly():
    """The padding is 1-2 elements of ~30,000 (invisible at its true width): each padded unit gets a
    marker per rank, and the legend and alt text count it; an even split marks nothing."""
    flat = layout(3)
    fig, alt = figures.partition_figure(flat, stages=(0, 1))
    pads = [u for u in flat.units if u.padded > u.numel]
    assert pads
    for ax in fig.axes:
        marks = [line for line in ax.lines if line.get_gid() == "padding"]
        assert sorted(float(line.get_xdata()[0]) for line in marks) == sorted(u.offset + u.numel for u in pads)
        assert all(len(line.get_xdata()) == 3 for line in marks)                  # one per rank
    assert "Padding, marked by a triangle: rest 2, wpe 1" in alt
    even_fig, even_alt = figures.partition_figure(layout(2), stages=(0,))
    assert not [line for line in even_fig.axes[0].lines if line.get_gid() == "padding"] and "No padding" in even_alt


def test_timeline_gives_every_kind_its_own_colour():
    """book.runs' rows ('grad reduction', 'param all-gather') and kinds nobody named must not borrow a
    colour another kind in the same figure has (backward and grad reduction were both green)."""
    import matplotlib.colors as mcolors
    kinds = ["forward", "backward", "optimizer step", "grad reduction", "param all-gather", "odd-1", "odd-2"]
    ax = plots.plot_timeline([[(k, i, i + 0.5) for i, k in enumerate(kinds)]])
    legend = ax.get_legend()
    def face(handle):
        fc = handle.get_facecolor()
        return mcolors.to_hex(fc[0] if hasattr(fc[0], "__len__") else fc)
    faces = {t.get_text(): face(h) for t, h in zip(legend.get_texts(), legend.legend_handles)}
    assert sorted(faces) == sorted(kinds) and len(set(faces.values())) == len(kinds), faces
    assert faces["grad reduction"] == plots.KIND_COLORS["reduce-scatter"].lower()


def test_bucket_path_at_stage_2_says_unit_by_unit():
    """ZeRO-2 reduces each unit as soon as it is complete (Stage2Engine.grad_arrived), not a bucket at a
    time: the figure and its alt text say so; DDP's all-reduce stays one per bucket."""
    flat = layout(2)
    fig, alt = figures.bucket_path_figure(flat, 20_000, op="reduce_scatter", gather_bucket=10**9, keep_shard=True)
    texts = [t.get_text() for t in fig.axes[0].texts]
    buckets = group_units(flat.units, 20_000)
    assert [t for t in texts if "x reduce-scatter: each unit's" in t] == [
        f"{i + 1}. {len(b)} x reduce-scatter: each unit's\nas soon as it is complete,\nkeep own 1/N, free it"
        for i, b in enumerate(buckets)]
    assert "each unit is reduced by its own reduce-scatter as soon as the unit is complete" in alt
    _, ddp_alt = figures.bucket_path_figure(flat, 20_000, op="all_reduce")
    assert "each reduced by one all-reduce as soon as it is complete, in bucket order" in ddp_alt
