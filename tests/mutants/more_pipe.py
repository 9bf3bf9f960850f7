"""Mutants for the modern pipeline schedules: interleaved 1F1B, ZB-H1's B/W split, the bubble arithmetic."""
from __future__ import annotations

from mutants import Mutant

T = "tests/test_pipeline_schedules.py"
TRAIN_INTERLEAVED = T + "::test_trains_to_single_process_parameters[interleaved-2]"
TRAIN_ZB = T + "::test_trains_to_single_process_parameters[zb-h1-1]"
IDLE = T + "::test_idle_slots_counted_equal_the_formula"

MUTANTS = [
    Mutant("interleaved-wrong-virtual-stage", "zerolab/parallel/pipeline_interleaved.py",
           "    return [[((c * p + r) * q, (c * p + r + 1) * q) for c in range(v)] for r in range(p)]",
           "    return [[((r * v + c) * q, (r * v + c + 1) * q) for c in range(v)] for r in range(p)]",
           (TRAIN_INTERLEAVED,),
           "chunk c of rank r holds virtual stage r*v + c (contiguous per rank), not c*pp + r: the blocks run out of order"),
    Mutant("interleaved-backward-chunks-not-reversed", "zerolab/parallel/pipeline_interleaved.py",
           '        return op, (k // (p * v)) * p + k % p, (c if op == "F" else v - 1 - c)',
           '        return op, (k // (p * v)) * p + k % p, c',
           (IDLE + "[1-1-1-interleaved-2]",),
           "backwards walk the chunks in forward order: a chunk waits for a gradient its own rank has not made (deadlock)"),
    Mutant("zb-w-dropped", "zerolab/parallel/pipeline_run.py",
           "rec.weight_passes += run_w(stores.pop((i, c)))",
           "rec.weight_passes += len(stores.pop((i, c)))",
           (TRAIN_ZB,),
           "the W pass never runs (though it counts its passes): the Linear weights never get their gradients"),
    Mutant("zb-bias-grad-dropped", "zerolab/parallel/pipeline_zb.py",
           "    if bias is not None and bias.requires_grad:",
           "    if False:",
           (T + "::test_b_then_w_gives_autograd_gradients_bit_for_bit",),
           "W accumulates the weight's gradient but forgets the bias's"),
    Mutant("zb-w-on-a-copy", "zerolab/parallel/pipeline_zb.py",
           "        ctx.store.append(functools.partial(_linear_w, *ctx.params.pair, x, g))",
           "        ctx.store.append(functools.partial(_linear_w, weight, ctx.params.pair[1], x, g))",
           (TRAIN_ZB,),
           "W accumulates into the tensor forward received (another object under a saved-tensor hook), not the Parameter"),
    Mutant("zb-h1-w-not-deferred", "zerolab/parallel/pipeline_zb.py",
           '        for op, i in (("F", x), ("B", x - (p - 1 - s)), ("W", x - (p - 1))):',
           '        for op, i in (("F", x), ("B", x - (p - 1 - s)), ("W", x - (p - 1 - s))):',
           (IDLE + "[1-1-1-zb-h1-1]",),
           "every stage runs W right after B (1F1B with a split backward): the bubble stays 1F1B's"),
    Mutant("bubble-interleaved-not-divided", "zerolab/theory/bubble.py",
           "        return (p - 1) * (f + b + w) / v",
           "        return (p - 1) * (f + b + w)",
           (IDLE + "[1-1-1-interleaved-2]",),
           "the interleaved formula forgets the division by v"),
    Mutant("zb-forward-not-split", "zerolab/parallel/pipeline_run.py",
           "            deferring = split_linears(stores.setdefault((i, c), [])) if split else contextlib.nullcontext()",
           "            deferring = contextlib.nullcontext(stores.setdefault((i, c), []))",
           (TRAIN_ZB,),
           "ZB-H1's forward runs without the split: B does the whole backward and W has nothing left (the bubble stays)"),
    Mutant("recorder-split-releases-at-b", "zerolab/parallel/pipeline_stats.py",
           '            if kind == ("W" if self.split else "B"):',
           '            if kind == "B":',
           (T + "::test_measured_bubble_orders_as_the_formulas",),
           "with a split backward the recorder frees a micro-batch at B, though W still holds its activations"),
]
