"""Mutants of the book's and the bench's use of the replay (book/plots.py, book/replayed.py, bench/replay.py)."""
from mutants import Mutant

T = "tests/test_replay_book.py"
MUTANTS = [
    Mutant("timeline-drops-replayed-comm-lanes", "zerolab/book/plots.py",
           "        keep = [i for i in range(len(rows_in)) if ranks is None or i // per in ranks]",
           "        keep = [i for i in range(len(rows_in)) if (ranks is None or i // per in ranks) and i % per == 0]",
           (f"{T}::test_plot_timeline_draws_replayed_lanes_exactly_as_measured_lanes",),
           "plot_timeline draws a replay's compute lanes only: its all-gather and reduce-scatter lanes vanish"),
    Mutant("timeline-kind-colours-by-order", "zerolab/book/plots.py",
           "        colors[k] = KIND_COLORS.get(k, palette[i % len(palette)])",
           "        colors[k] = palette[i % len(palette)]",
           (f"{T}::test_the_same_kind_has_the_same_colour_measured_or_replayed",),
           "a kind's colour depends on which kinds a panel holds: measured and replayed panels disagree"),
    Mutant("replayed-wrong-cluster", "zerolab/book/replayed.py",
           "    return {name: replay(t, cluster, model=model) for name, t in traces.items()}",
           "    return {name: replay(t, \"dgx-h100\", model=model) for name, t in traces.items()}",
           (f"{T}::test_replay_all_replays_on_the_cluster_it_is_given",),
           "the chapters' helper replays every setting on one DGX H100 node whatever cluster it is given"),
    Mutant("lesson-wrong-cluster", "zerolab/book/replayed.py",
           "    return {c: replay_all(traces, c, model=model) for c in clusters}",
           "    return {c: replay_all(traces, clusters[0], model=model) for c in clusters}",
           (f"{T}::test_lesson_records_once_and_replays_on_every_named_cluster_at_the_target_size",),
           "a chapter's lesson labels the first cluster's replay with every cluster's name"),
    Mutant("lesson-ignores-target", "zerolab/book/replayed.py",
           "    traces = record({name: config(zero) for name, zero in settings.items()}, model=model, **record_kw)\n"
           "    return {c: replay_all(traces, c, model=model) for c in clusters}",
           "    traces = record({name: config(zero) for name, zero in settings.items()}, model=model, **record_kw)\n"
           "    return {c: replay_all(traces, c, model=TARGET) for c in clusters}",
           (f"{T}::test_lesson_records_once_and_replays_on_every_named_cluster_at_the_target_size",),
           "a chapter's lesson replays at the default target whatever model it was asked for"),
    Mutant("bench-replay-labelled-measured", "zerolab/bench/replay.py",
           "                                           source=\"modelled\"))",
           "                                           source=\"measured\"))",
           (f"{T}::test_bench_replay_traces_ours_and_labels_every_number_modelled",),
           "the bench's replayed rows are labelled measured"),
    Mutant("bench-replay-one-cluster", "zerolab/bench/replay.py",
           "                rep = replay(traces, c)",
           "                rep = replay(traces, clusters[0])",
           (f"{T}::test_bench_replay_traces_ours_and_labels_every_number_modelled",),
           "the bench replays every row on the first cluster named"),
]
