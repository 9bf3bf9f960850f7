"""Mutants of the book's figures (zerolab/book/figures*.py, plots.py): what a reader sees must say what ran."""
from mutants import Mutant

FIG = "tests/test_figures.py"

MUTANTS = [
    Mutant("figure-padding-unmarked", "zerolab/book/figures.py",
           "            if u.padded > u.numel:      # a few elements",
           "            if False:      # a few elements",
           (FIG + "::test_partition_figure_marks_the_padding_visibly",),
           "the partition picture draws the padding at its true width only: 1-2 elements of 30,000, invisible"),
    Mutant("timeline-colour-borrowed", "zerolab/book/plots.py",
           '               "grad reduction": "#C44E52", "param all-gather": "#DD8452"}',
           '               "grad reduction": "#55A868", "param all-gather": "#8172B3"}',
           (FIG + "::test_timeline_gives_every_kind_its_own_colour",),
           "the gradient reductions take backward's green and the gathers the optimizer's purple"),
    Mutant("bucket-path-per-bucket-at-stage-2", "zerolab/book/figures.py",
           "                 if keep_shard else op.replace(\"_\", \"-\"))",
           "                 if False else op.replace(\"_\", \"-\"))",
           (FIG + "::test_bucket_path_at_stage_2_says_unit_by_unit",),
           "the ZeRO-2 path draws one reduce-scatter per bucket, which the engine does not do"),
    Mutant("topology-line-through-boxes", "zerolab/book/figures_zeropp.py",
           "            ax.plot([b + 0.4] * 2, [-a * 1.6, -(a + 1) * 1.6 + 0.7], color=\"tab:red\", lw=1.5)",
           "            ax.plot([b + 0.4] * 2, [-a * 1.6 - 0.35, -(a + 1) * 1.6 - 0.35], color=\"tab:red\", lw=1.5)",
           ("tests/test_figures_zeropp.py::test_topology_lines_cross_no_rank_box",),
           "the inter-node line runs through the next node's rank box and its text"),
]
