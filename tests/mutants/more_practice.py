"""Mutants of chapter 12's replayed lessons (book/replayed_practice.py) and of the plan they check (theory/plan.py)."""
from mutants import Mutant

T = "tests/test_replay_practice.py"
MUTANTS = [
    Mutant("practice-loss-inverted", "zerolab/book/replayed_practice.py",
           "    return 1 - base.step_seconds / zero3.step_seconds",
           "    return 1 - zero3.step_seconds / base.step_seconds",
           (f"{T}::test_zero3_loss_grows_as_the_fabric_slows",),
           "ZeRO-3's throughput loss computed as ZeRO-2's slowdown against ZeRO-3 (the sign and scale flipped)"),
    Mutant("practice-ib-all-nics", "zerolab/book/replayed_practice.py",
           "node=a100.node.with_nics(1))",
           "node=a100.node)",
           (f"{T}::test_the_three_fabrics_are_the_claims", f"{T}::test_zero3_loss_grows_as_the_fabric_slows"),
           "the 200 Gb/s InfiniBand fabric given the DGX A100's eight NICs per node, not one"),
    Mutant("practice-control-counted-as-model", "zerolab/book/replayed_practice.py",
           "\"issued\": sum(1 for i in issued if not i[\"control\"])",
           "\"issued\": len(issued)",
           (f"{T}::test_plan_times_equal_the_replay_up_to_what_each_counts[3-100 GbE]",),
           "the engine's flag all-reduces counted as model collectives (and their latency twice)"),
    Mutant("plan-comm-fp32-bytes", "zerolab/theory/plan.py",
           "t = step_comm_time(psi, n_gpus, stage, grad_accum=grad_accum, dtype_bytes=dtype, **net)",
           "t = step_comm_time(psi, n_gpus, stage, grad_accum=grad_accum, dtype_bytes=4, **net)",
           (f"{T}::test_plan_times_equal_the_replay_up_to_what_each_counts[2-NVLink]",),
           "plan.times charges mixed-precision collectives 4 bytes per element"),
    Mutant("practice-persistence-any-threshold", "zerolab/book/replayed_practice.py",
           "    if not s.hidden <= threshold < smallest_matrix:",
           "    if not threshold < smallest_matrix:",
           (f"{T}::test_a_persistence_threshold_is_chosen_by_the_target",),
           "a persistence threshold below the target's norms accepted: it keeps nothing whole at the target"),
]
