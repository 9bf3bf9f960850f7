"""Mutants for activation recomputation: what is kept, the random state, the FLOP formula, stage 3's hooks."""
from __future__ import annotations

from mutants import Mutant

T = "tests/test_recompute.py"
BYTES = T + "::test_bytes_kept_per_layer_equal_korthikanti"
SAME = T + "::test_recomputation_trains_bit_identically_with_dropout"
FLOPS = T + "::test_flops_counted_equal_the_formula"
ZERO = T + "::test_recomputation_under_zero2_and_zero3_on_two_ranks_matches_no_recomputation"

MUTANTS = [
    Mutant("recompute-selective-keeps-the-scores", "zerolab/book/models.py",
           'y = checkpoint(self.core, q, k, v) if self.recompute == "selective" else self.core(q, k, v)',
           'y = self.core(q, k, v)',
           (BYTES + "[fp32-dropout]", FLOPS + "[unfused]"),
           "selective recomputation runs attention's core normally: the s x s scores, mask and probabilities are kept"),
    Mutant("recompute-rng-not-restored", "zerolab/parallel/recompute.py",
           "use_reentrant=False, preserve_rng_state=True)",
           "use_reentrant=False, preserve_rng_state=False)",
           (SAME,),
           "the recomputation draws fresh dropout masks: the gradient belongs to another mask than the forward"),
    Mutant("recompute-flops-miss-the-forward", "zerolab/parallel/recompute.py",
           'return layers * {"none": 0, "selective": attention_core, "full": block}[mode]',
           'return layers * {"none": 0, "selective": attention_core, "full": attention_core}[mode]',
           (FLOPS + "[unfused]",),
           "the FLOP formula counts only attention's core for full recomputation, not the block's whole forward"),
    Mutant("recompute-early-stop-left-on", "zerolab/parallel/recompute.py",
           "    with torch.utils.checkpoint.set_checkpoint_early_stop(False):\n",
           "    with torch.utils.checkpoint.set_checkpoint_early_stop(True):\n",
           (FLOPS + "[unfused]",),
           "torch stops the recomputation early: the weighted sum is never recomputed, the cost differs from the formula"),
    Mutant("recompute-full-keeps-everything", "zerolab/book/models.py",
           'x = checkpoint(block, x) if self.recompute == "full" else block(x)',
           'x = block(x)',
           (BYTES + "[bf16-dropout]",),
           "full recomputation runs the blocks normally: every activation is kept"),
    Mutant("stage3-recomputation-releases-its-unit", "zerolab/engine/stage3.py",
           "and i not in self._pinned and not self._in_backward:",
           "and i not in self._pinned:",
           (ZERO,),
           "ZeRO-3 releases a unit after its recomputed forward, before the backward that needs its weights"),
]
