"""Mutants of FP8 as an axis (chapter 1): the FP8 weights' bytes in ``estimate``, the FP8 all-gathers, the
Memory Explorer's FP8 control and the "measure it" button's refusal."""
from __future__ import annotations

from mutants import Mutant

T = "tests/test_fp8_estimate.py"

MUTANTS = [
    Mutant("fp8-weights-two-bytes", "zerolab/theory/memory.py",
           "p = FP8_WEIGHT_BYTES if fp8 else p",
           "p = 2 if fp8 else p",
           (T + "::test_bytes_per_gpu_equal_the_hand_table",), "FP8 weights counted at 2 bytes, as bf16"),
    Mutant("fp8-weights-not-sharded", "zerolab/theory/memory.py",
           "params = p * (shard if stage >= 3 else psi) + frozen_bytes",
           "params = p * (shard if stage >= 3 and not fp8 else psi) + frozen_bytes",
           (T + "::test_bytes_per_gpu_equal_the_hand_table",), "ZeRO-3 keeps the FP8 weights whole"),
    Mutant("fp8-allgather-not-halved", "zerolab/theory/fp8.py",
           "return [w if g.what.startswith(\"params\") else g for g, w in zip(grads, weights)]",
           "return grads",
           (T + "::test_fp8_all_gathers_move_half_the_bf16_bytes",), "the FP8 weights gathered at 2 bytes each"),
    Mutant("fp8-grads-halved-too", "zerolab/theory/fp8.py",
           "grads = comm_breakdown(psi, n_gpus, stage, GRAD_REDUCE_BYTES, grad_accum, gpus_per_node)",
           "grads = comm_breakdown(psi, n_gpus, stage, FP8_WEIGHT_BYTES, grad_accum, gpus_per_node)",
           (T + "::test_fp8_all_gathers_move_half_the_bf16_bytes",), "the gradient reductions in FP8 as well"),
    Mutant("fp8-explorer-ignored", "zerolab/book/explorer_model.py",
           "fp8=fp8,\n                              **mesh)",
           "fp8=False,\n                              **mesh)",
           (T + "::test_explorer_fp8_changes_the_total_by_the_weights_byte",),
           "the explorer's FP8 control does not reach estimate"),
    Mutant("fp8-measured-anyway", "zerolab/book/explorer_model.py",
           "    if fp8:\n        return (\"fp8=True: ",
           "    if False:\n        return (\"fp8=True: ",
           (T + "::test_measure_refuses_fp8_by_name",), "the measure button runs bf16 when FP8 is asked for"),
]
