"""Mutants of tensor parallelism (zerolab/parallel): the cross-entropy's ignore_index, the check of a
conversion, gradients of whole parameters inside a split region, the dropout RNG tracker, GPT-2's Conv1D
layout in the gathered state, Gemma's scaled embedding, a TP model without its mesh."""
from __future__ import annotations

from mutants import Mutant

CE = "tests/test_tp_cross_entropy.py::test_vocab_parallel_ce_equals_torch_with_ignore_index_smoothing_reductions"
CE_RANGE = "tests/test_tp_cross_entropy.py::test_out_of_range_targets_and_ids_raise_on_every_rank"
CHECK_NAMES = "tests/test_tp_check.py::test_check_names_what_differs"
CHECK_PASSES = "tests/test_tp_check.py::test_check_passes_correct_conversions_and_can_be_skipped"
DROPOUT = "tests/test_tp_dropout.py"
GPT2_STATE = "tests/test_tp_gpt2_state.py"

MUTANTS = [
    Mutant("tp-ce-counts-ignored", "zerolab/parallel/cross_entropy.py",
           "    return loss.sum() / (target != ignore_index).sum()",
           "    return loss.sum() / target.numel()",
           (CE,), "the mean cross-entropy counts the ignore_index (-100) targets as tokens"),
    Mutant("tp-ce-ignored-get-gradient", "zerolab/parallel/cross_entropy.py",
           "        return g * (grad * keep).unsqueeze(-1), None, None, None, None, None",
           "        return g * grad.unsqueeze(-1), None, None, None, None, None",
           (CE,), "padded (ignore_index) positions get a gradient although they add nothing to the loss"),
    Mutant("tp-ce-smoothing-local-mean", "zerolab/parallel/cross_entropy.py",
           "total, zmean = sums[0], sums[1] / full",
           "total, zmean = sums[0], sums[1] / v",
           (CE,), "label smoothing averages the logits over this rank's slice of the vocabulary, not the whole"),
    Mutant("tp-embedding-id-unchecked", "zerolab/parallel/layers.py",
           "        if bool(((idx < 0) | (idx >= full)).any()):",
           "        if False:",
           (CE_RANGE,), "a token id outside the vocabulary looks up zeros instead of raising"),
    Mutant("tp-split-grad-not-reduced", "zerolab/parallel/regions.py",
           "                p.register_hook(all_reduce_grad(comm, \"tp-split-grad\"))",
           "                pass",
           (CHECK_PASSES,), "a whole parameter inside a split region (Qwen3's q_norm) keeps its partial gradient"),
    Mutant("tp-check-always-passes", "zerolab/parallel/check.py",
           "    if problem is not None or flag.item():",
           "    if False:",
           (CHECK_NAMES,), "tensor_parallel's check never raises: a wrong plan converts silently"),
    Mutant("tp-check-ties-unchecked", "zerolab/parallel/check.py",
           "        if any(h is None or h is not held[0] for h in held):",
           "        if False:",
           (CHECK_NAMES,), "the check misses a tie the plan broke (Gemma 2's embedding left whole, its head split)"),
    Mutant("tp-rng-split-same-seed", "zerolab/parallel/rng.py",
           '"split": seed + OFFSET + 1 + tp_rank}',
           '"split": seed + OFFSET + 1}',
           (DROPOUT,), "every TP rank's heads draw the same dropout mask (the split region seeded alike)"),
    Mutant("tp-rng-row-stays-split", "zerolab/parallel/rng.py",
           '            m.register_forward_pre_hook(lambda mod, a: tracker.enter("replicated"))',
           "            pass",
           (DROPOUT,), "after a row-parallel layer the replicated dropouts draw from the per-rank split state"),
    Mutant("tp-state-conv1d-transposed", "zerolab/engine/checkpoint/mesh_state.py",
           "            if name in flip and sd[name].dim() == 2:   # back to the original layout (GPT-2's Conv1D), at tp 1 too",
           "            if False:",
           (GPT2_STATE,), "full_state_dict under a mesh holds GPT-2's Conv1D weights transposed"),
    Mutant("tp-gather-conv1d-transposed", "zerolab/parallel/plan.py",
           "        if name in flip and out[name].dim() == 2:",
           "        if False:",
           (GPT2_STATE,), "gather_tp joins GPT-2's Conv1D weights in the converted (out x in) layout"),
    Mutant("tp-embed-scale-dropped", "zerolab/parallel/layers.py",
           "            out = out * self.embed_scale.to(out.dtype)",
           "            out = out",
           (CHECK_PASSES,), "Gemma's scaled embedding converted without its embed_scale"),
    Mutant("tp-model-without-mesh", "zerolab/engine/__init__.py",
           "        if tp > 1 and mesh is None:",
           "        if False:",
           ("tests/test_tp_refusals.py::test_tp_model_needs_its_mesh",),
           "a tensor-parallel model trained without its mesh: TP ranks as DP replicas"),
]
MUTANTS.append(Mutant(
    "tp-split-memo-by-freed-id", "zerolab/parallel/layers.py",
    "        memo[key] = (p, piece)\n    return memo[key][1]",
    "        memo[key] = (None, piece)\n    return memo[key][1]",
    ("tests/test_tensor_parallel.py::test_split_memo_never_hands_a_freed_parameters_slice_to_another",),
    "the split memo keyed by id() forgets the parameter: a freed temporary's id, and slice, goes to the next"))
