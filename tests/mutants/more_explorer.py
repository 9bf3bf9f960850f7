"""Mutants of the activation formula (recomputation, TP, logits, CP, 1F1B), estimate's expert
parallelism and the Memory Explorer's verdict (chapter 1)."""
from __future__ import annotations

from mutants import Mutant

ACT = "zerolab/theory/activations.py"
REC = "tests/test_activation_recompute.py"
AXES = "tests/test_explorer_axes.py::test_verdict_names_the_binding_term"

MUTANTS = [
    Mutant("act-selective-keeps-scores", ACT,
           '"selective": linear, "full"',
           '"selective": full_set, "full"',
           (REC + "::test_korthikanti_table2",), "selective recomputation still keeps the s^2 scores"),
    Mutant("act-logits-bf16", ACT,
           "logits = LOGITS_COPIES * 4 * s * b",
           "logits = LOGITS_COPIES * 2 * s * b",
           (REC + "::test_logits_two_fp32_copies",), "the logits counted in 16-bit, not the loss's fp32"),
    Mutant("act-tp-not-dividing-24", ACT,
           "linear = sbh * (4 * d + 2) + 12 * d * sbh // t",
           "linear = sbh * (4 * d + 2) + 12 * d * sbh",
           (REC + "::test_korthikanti_table2",), "tensor parallelism does not divide Q, K, V, the GeLU's (24 sbh)"),
    Mutant("act-sp-not-dividing-replicated", ACT,
           "linear = sbh * (16 * d + 2) // t",
           "linear = sbh * (4 * d + 2) + 12 * d * sbh // t",
           (REC + "::test_korthikanti_table2",), "sequence parallelism leaves the LayerNorm/dropout part whole"),
    Mutant("act-full-no-working-set", ACT,
           'working = full_set if mode == "full" else 0',
           "working = 0",
           (REC + "::test_korthikanti_table2",), "full recomputation forgets the one layer rebuilt in backward"),
    Mutant("act-cp-scores-local-keys", ACT,
           "keys = seq_len                                # each rank's",
           "keys = s                                # each rank's",
           (REC + "::test_context_parallel_holds_s_over_cp_queries",),
           "context parallelism's kept scores counted against s/cp keys, not all s"),
    Mutant("act-1f1b-one-in-flight", ACT,
           'first = {"layers": stage_layers * pp * per_layer',
           'first = {"layers": stage_layers * per_layer',
           (REC + "::test_pipeline_1f1b_first_stage_keeps_pp_micro_batches",),
           "1F1B's first stage keeps one micro-batch, not pp"),
    Mutant("act-checkpointing-ignored", ACT,
           'return "full" if checkpointing else "none"',
           'return "none"',
           (REC + "::test_checkpointing_is_an_alias_of_full_and_conflicts_are_named",),
           "checkpointing=True no longer means recompute='full'"),
    Mutant("estimate-experts-not-split-by-ep", "zerolab/theory/memory.py",
           "slice_, n_edp = mesh_share(experts, n, tp, pp * ep)",
           "slice_, n_edp = mesh_share(experts, n, tp, pp)",
           (REC + "::test_estimate_cp_shards_like_dp_and_ep_splits_experts",),
           "expert parallelism does not split the experts across ranks"),
    Mutant("explorer-verdict-smallest-term", "zerolab/book/explorer_model.py",
           "binding = max(terms, key=terms.get)",
           "binding = max((k for k in terms if k != 'logits'), key=terms.get)",
           (AXES,), "the verdict never names the logits as the binding term"),
    Mutant("explorer-verdict-states-first", "zerolab/book/explorer_model.py",
           'terms = {"params": data["params"][stage] - data["hpz"][stage], "grads": data["grads"][stage],',
           'terms = {"params": data["params"][0] - data["hpz"][stage], "grads": data["grads"][stage],',
           (AXES,), "the verdict reads DDP's parameters whatever the stage"),
]
