"""The book's replayed timing lessons: plot_timeline draws replayed lanes as it draws measured ones; the
chapters' helper (zerolab.book.replayed) records a real traced run and replays it on the named cluster;
``python -m zerolab bench --replay`` replays the bench's own traces, labelled modelled."""
from __future__ import annotations

import json
import os

import pytest

import zerolab as zl
from zerolab.book import plots, replayed
from zerolab.engine import events as ev
from zerolab.theory.replay import get_cluster, replay
from zerolab.theory.shapes import ModelShape


def _meta(rank):
    return ("trace-meta", -1, 0.0, {"rank": rank, "world": 2, "ranks_per_node": 2, "stage": 3, "dp": 2, "tp": 1,
                                    "pp": 1, "units": [("rest", 1000, 1000), ("blocks.0", 1000, 1000)],
                                    "param_collective": "all_gather", "master": False, "dtype_bytes": 2,
                                    "offload": "none", "gas": 1})


def _hand_trace():
    """Gather (waited), forward, backward with a reduce-scatter in flight, the optimizer: on both ranks."""
    def rank(r):
        return [_meta(r), ("coll-issued", 1, 0.0, {"op": "all_gather", "nbytes": 2_000_000, "members": (0, 1),
                                                   "group": None, "tag": "g", "control": False}),
                ("coll-waited", 1, 0.0), ("compute", 1, 0.0, {"phase": "forward", "flops": 4e9, "start": 0.0}),
                ("coll-issued", 2, 0.0, {"op": "reduce_scatter", "nbytes": 4_000_000, "members": (0, 1),
                                         "group": None, "tag": "r", "control": False}),
                ("compute", 1, 0.0, {"phase": "backward", "flops": 8e9, "start": 0.0}),
                ("coll-waited", 2, 0.0), ("optimizer", -1, 0.0, {"numel": 1000})]
    return [rank(0), rank(1)]


def _boxes(ax):
    """Every drawn box: (row, start ms, width ms, colour)."""
    out = []
    for coll in ax.collections:
        color = tuple(round(c, 4) for c in coll.get_facecolor()[0])
        for path in coll.get_paths():
            x, y = path.vertices[:, 0], path.vertices[:, 1]
            out.append((round(float(y.min() + 0.35)), round(float(x.min()), 9),
                        round(float(x.max() - x.min()), 9), color))
    return sorted(out)


def _measured_events(rep, r):
    """A measured run's engine events with exactly rank ``r``'s replayed spans (starting at 0)."""
    start = {"forward": ev.UNIT_FWD_START, "backward": ev.UNIT_BWD_START, "optimizer step": ev.STEP_START,
             "all-gather": ev.GATHER_ISSUED, "reduce-scatter": ev.REDUCE_ISSUED}
    out = []
    for i, (kind, s, e, _) in enumerate(rep.spans[r]):
        out += [(start[kind], i, s), (ev.PAIRS[start[kind]][0], i, e)]
    return sorted(out, key=lambda x: x[2])


def test_plot_timeline_draws_replayed_lanes_exactly_as_measured_lanes():
    rep = replay(_hand_trace(), "dgx-h100")
    rows, labels = rep.lanes()
    kinds = {k for row in rows for k, _, _ in row}
    assert {"all-gather", "reduce-scatter", "forward", "backward", "optimizer step"} <= kinds
    drawn = plots.plot_timeline(rep)
    assert [t.get_text() for t in drawn.get_yticklabels()] == labels == [
        f"rank {r} {lane}" for r in (0, 1) for lane in ("compute", "all-gather", "reduce-scatter")]
    assert "modelled" in drawn.get_xlabel() and "(ms)" in drawn.get_xlabel()
    assert str(rep.cluster) in drawn.get_title() and "modelled" in drawn.get_title()
    # every replayed span is a box, comm lanes included: 5 per rank
    assert len(_boxes(drawn)) == sum(len(s) for s in rep.spans) == 10
    # a measured run with the same spans, through events.lanes, draws the same boxes in the same colours
    measured_rows, measured_labels = ev.lanes([_measured_events(rep, 0), _measured_events(rep, 1)])
    assert measured_labels == labels
    assert _boxes(plots.plot_timeline(measured_rows, labels=measured_labels)) == _boxes(drawn)
    # one rank's rows only
    one = plots.plot_timeline(rep, ranks=[1])
    assert [t.get_text() for t in one.get_yticklabels()] == labels[3:]
    assert [b[1:] for b in _boxes(one)] == [b[1:] for b in _boxes(drawn) if b[0] >= 3]


def test_the_same_kind_has_the_same_colour_measured_or_replayed():
    from matplotlib.colors import to_rgba
    a = plots.plot_timeline([[("all-gather", 0, 1)], [("forward", 0, 1)]])
    b = plots.plot_timeline([[("forward", 0, 1), ("reduce-scatter", 1, 2)], [("all-gather", 0, 1)]])
    colour = {t.get_text(): to_rgba(h.get_facecolor()) for ax in (a, b)
              for t, h in zip(ax.get_legend().get_texts(), ax.get_legend().legend_handles)}
    for kind in ("all-gather", "forward", "reduce-scatter"):
        assert colour[kind] == pytest.approx(to_rgba(plots.KIND_COLORS[kind]))


# ---------------------------------------------------------------- the chapters' helper, on real ranks
FOUR = ModelShape("4-layer 7B-wide", 4096, 4, 32, 32, 11008, 32000, seq=4096)


@pytest.fixture(scope="module")
def four_layer():
    settings = {"overlap off": replayed.config({"stage": 2, "overlap_comm": False}),
                "overlap on": replayed.config({"stage": 2, "overlap_comm": True})}
    return replayed.record(settings, model=FOUR)


@pytest.mark.slow
def test_record_traces_every_setting_with_the_targets_layer_count(four_layer):
    assert list(four_layer) == ["overlap off", "overlap on"]
    for traces in four_layer.values():
        assert len(traces) == 2
        meta = next(e.info for e in traces[0] if e[0] == "trace-meta")
        assert meta["stage"] == 2 and meta["dtype_bytes"] == 2            # bf16, as the config says
        assert sum(1 for name, *_ in meta["units"] if name.startswith("blocks.")) == 4


@pytest.mark.slow
def test_replay_all_replays_on_the_cluster_it_is_given(four_layer):
    one = replayed.replay_all(four_layer, "dgx-h100", model=FOUR)
    two = replayed.replay_all(four_layer, "cloud-100gbe:2", model=FOUR)
    for reps, cluster in ((one, "dgx-h100"), (two, "cloud-100gbe:2")):
        for name, rep in reps.items():
            assert rep.cluster == get_cluster(cluster)
            want = replay(four_layer[name], cluster, model=FOUR)
            assert rep.step_seconds == want.step_seconds and rep.flops == pytest.approx(FOUR.step_flops())
    assert two["overlap off"].step_seconds > one["overlap off"].step_seconds      # 100 Gb/s is slower than NVLink
    for reps in (one, two):                                            # the lesson the chapters draw
        assert reps["overlap on"].step_seconds < reps["overlap off"].step_seconds
    text = replayed.table({"dgx-h100": one})
    assert "modelled" in text and f"{one['overlap on'].step_seconds:.3f}" in text
    fig = replayed.plot_replays({"dgx-h100": one, "cloud-100gbe:2": two}, names=["overlap on"])
    titles = [ax.get_title() for ax in fig.axes]
    assert len(titles) == 2 and all("overlap on" in t and "modelled" in t for t in titles)
    assert str(get_cluster("dgx-h100")) in titles[0] and str(get_cluster("cloud-100gbe:2")) in titles[1]
    assert [t.get_text() for t in fig.axes[0].get_yticklabels()] == [
        "rank 0 compute", "rank 0 all-gather", "rank 0 reduce-scatter"]


@pytest.mark.slow
def test_lesson_records_once_and_replays_on_every_named_cluster_at_the_target_size():
    two = ModelShape("2-layer 7B-wide", 4096, 2, 32, 32, 11008, 32000, seq=4096)
    got = replayed.lesson({"ZeRO-3": {"stage": 3}}, clusters=("cloud-100gbe:2", "dgx-h100"), model=two)
    assert list(got) == ["cloud-100gbe:2", "dgx-h100"]
    for cluster, reps in got.items():
        rep = reps["ZeRO-3"]
        assert rep.cluster == get_cluster(cluster) and rep.flops == pytest.approx(two.step_flops())
        assert any(k == "all-gather" for k, *_ in rep.spans[0])
    assert got["cloud-100gbe:2"]["ZeRO-3"].step_seconds > got["dgx-h100"]["ZeRO-3"].step_seconds


# ---------------------------------------------------------------- the bench's replay
@pytest.mark.slow
@pytest.mark.timeout(300)
def test_bench_replay_traces_ours_and_labels_every_number_modelled(tmp_path):
    from zerolab.bench import replay as br
    from zerolab.cli import main
    (tmp_path / "bench.md").write_text("measured tables\n")
    assert main(["bench", "--replay", "dgx-h100", "dgx-h100:2", "--stages", "0", "3", "--world-sizes", "2",
                 "--model", "tiny", "--batch", "4", "--out", str(tmp_path)]) == 0
    with open(os.path.join(tmp_path, "replay.json")) as f:
        result = json.load(f)
    assert result["mode"] == "replay" and "modelled" in result["source"] and "not measured" in result["source"]
    rows = {(r["stage"], r["cluster"]): r for r in result["rows"]}
    assert set(rows) == {(s, c) for s in (0, 3) for c in ("dgx-h100", "dgx-h100:2")}
    assert all(r["source"] == "modelled" and r["step_ms"] > 0 for r in rows.values())
    assert rows[0, "dgx-h100:2"]["gpus"] == 16 and rows[0, "dgx-h100"]["gpus"] == 8
    assert rows[0, "dgx-h100:2"]["step_ms"] > rows[0, "dgx-h100"]["step_ms"]     # across nodes is slower
    with open(os.path.join(tmp_path, "replay.md")) as f:
        md = f.read()
    with open(os.path.join(tmp_path, "bench.md")) as f:
        assert f.read() == br.into_bench_md("measured tables\n", md)    # the timed run's file gets the section
    assert md == br.markdown(result) and "modelled" in md.splitlines()[0]
    assert f"{rows[3, 'dgx-h100']['step_ms']:.3f}" in md


def test_the_replay_table_goes_into_bench_md_once_labelled_and_replaced_next_time():
    from zerolab.bench import replay as br
    measured = "| stage | peer | 2 ranks |\n|---|---|---|\n| 0 | torch DDP | 0.98 (1.00) |\n"
    once = br.into_bench_md(measured, "Replayed (modelled)\n| 0 | 0.179 |\n")
    assert once.startswith(measured) and once.count(br.START) == 1 and "0.179" in once
    twice = br.into_bench_md(once, "Replayed (modelled)\n| 0 | 0.5 |\n")
    assert twice.startswith(measured) and twice.count(br.START) == 1 and "0.5 |" in twice and "0.179" not in twice


def test_bench_replay_refuses_an_unknown_cluster_by_name(tmp_path, capsys):
    from zerolab.cli import main
    assert main(["bench", "--replay", "dgx-z", "--out", str(tmp_path)]) != 0     # before any rank starts
    assert "unknown cluster 'dgx-z'; presets:" in capsys.readouterr().err
    assert not os.listdir(tmp_path)


# ---------------------------------------------------------------- ZeRO++ against its published figure
# DeepSpeed's ZeRO++ blog (June 2023) and paper (Wang et al., 2023, arXiv:2306.10209): "up to 2.2x" the
# throughput of ZeRO-3 on a 100 Gb/s network (the paper: up to 2.16x at 384 GPUs). "Up to": the gain
# depends on how much compute each step has to hide the traffic behind, i.e. the tokens per GPU.
ZEROPP_PUBLISHED = 2.2


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_zeropp_over_zero3_at_100gbe_brackets_the_published_2_2x_by_tokens_per_gpu():
    """Replayed on 2 nodes of one 100 Gb/s NIC each at Llama-2-7B's size: with 2,048 tokens per GPU the
    gain is above the published 2.2x, with 4,096 below it (and still above 1.5x); the gap to a single
    figure is the batch, which the blog does not pin to ours. On 2 DGX H100 nodes (8 x 400 Gb/s) ZeRO-3's
    traffic already hides: ZeRO++ gains nothing (within 10 %)."""
    settings = {"ZeRO-3": replayed.config({"stage": 3}),
                "ZeRO++": replayed.config({"stage": 3, "zero_quantized_weights": True, "zero_hpz_partition_size": 2,
                                           "zero_quantized_gradients": True})}
    traces = replayed.record(settings, world_size=4, ranks_per_node=2)
    shape = zl.theory.get_shape("llama-2-7b")

    def gain(cluster, seq):
        reps = replayed.replay_all(traces, cluster, model=shape.with_(seq=seq))
        return reps["ZeRO-3"].step_seconds / reps["ZeRO++"].step_seconds
    long, short = gain("cloud-100gbe:2", 4096), gain("cloud-100gbe:2", 2048)
    assert 1.5 < long < ZEROPP_PUBLISHED < short < 1.5 * ZEROPP_PUBLISHED, (long, short)
    assert 0.9 < gain("dgx-h100:2", 4096) < 1.1
