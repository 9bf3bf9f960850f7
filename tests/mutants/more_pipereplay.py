"""Mutants of the pipeline replay (theory/replay_pipe.py) and of the bubble formulas it is checked against."""
from mutants import Mutant

P = "tests/test_replay_pipeline.py"
MUTANTS = [
    Mutant("pipe-p2p-free-across-nodes", "zerolab/theory/replay_pipe.py",
           "    if a // ranks_per_node == b // ranks_per_node:\n        return node.intra",
           "    if True:\n        return node.intra",
           (f"{P}::test_free_p2p_gives_the_formula_and_crossing_nodes_pays_the_nic",),
           "a send between stages on two nodes runs at NVLink speed instead of the GPU's NIC share"),
    Mutant("pipe-recv-not-waiting", "zerolab/theory/replay_pipe.py",
           "                    if arrive[key] > t[r]:",
           "                    if False:",
           (f"{P}::test_planted_receive_that_does_not_wait_is_caught",
            f"{P}::test_hand_computed_two_stages_two_micro_batches_1f1b_to_the_microsecond"),
           "a receive lets its rank's compute go on before the matching send has arrived"),
    Mutant("bubble-formula-off-by-one", "zerolab/theory/bubble.py",
           "    if kind in (\"gpipe\", \"1f1b\"):\n        return (p - 1) * (f + b + w)",
           "    if kind in (\"gpipe\", \"1f1b\"):\n        return p * (f + b + w)",
           (f"{P}::test_each_schedule_replayed_at_llama_size_gives_its_formula_when_p2p_is_free",),
           "GPipe's and 1F1B's bubble counted over p stages instead of p - 1: above what the schedule idles"),
    Mutant("pipe-trace-loses-weight-grad", "zerolab/parallel/pipeline_trace.py",
           'from zerolab.theory.replay_pipe import PHASES   # "F" -> "forward", ...: the names the replay reads back',
           'PHASES = {"F": "forward", "B": "backward", "W": "backward"}',
           ("tests/test_replay_pipeline_traced.py",),
           "ZB's deferred weight-gradient pass recorded as a second backward: the trace no longer names W"),
]
