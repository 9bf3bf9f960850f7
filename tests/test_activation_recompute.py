"""activation_memory's recomputation, tensor/sequence/context/pipeline parallelism and logits (chapter 1).

Checked against independent counts: Korthikanti et al. 2022's Table 2 forms at d = 2 (written out here
as the paper prints them, with exact fractions), a tensor-by-tensor listing at d = 4, and the terms the
module docstring derives for CP, 1F1B and the logits.
"""
from fractions import Fraction as F

import pytest

import zerolab as zl
from zerolab.theory import activation_memory
from zerolab.theory.activations import activation_terms

GPT3 = dict(layers=96, hidden=12288, heads=96, seq_len=2048, micro_batch=1)   # GPT-3 175B (Table 2.1)


def table2(t, sp, mode, L=96, h=12288, a=96, s=2048, b=1):
    """Korthikanti et al. 2022, Table 2 (bytes, 16-bit), per layer times L; 'full' adds one layer's set."""
    sbh = F(s * b * h)
    scores = F(5 * a * s, h * t)
    linear = F(34, t) if sp else 10 + F(24, t)
    if mode == "none":
        return L * sbh * (linear + scores)
    if mode == "selective":
        return L * sbh * linear
    return L * sbh * (F(2, t) if sp else 2) + sbh * (linear + scores)


@pytest.mark.parametrize("t", [1, 2, 4, 8])
@pytest.mark.parametrize("sp", [False, True])
@pytest.mark.parametrize("mode", ["none", "selective", "full"])
def test_korthikanti_table2(t, sp, mode):
    got = activation_memory(**GPT3, recompute=mode, tp=t, sp=sp)
    assert got == table2(t, sp, mode)


def test_tensor_by_tensor_count_at_d4():
    """Each kept tensor listed (fp32 values, 1-byte masks), with TP t = 4 and no SP."""
    L, h, a, s, b, t, d = 3, 256, 8, 64, 2, 4, 4
    sbh = s * b * h
    replicated = [2 * d * sbh,            # two LayerNorm inputs
                  d * sbh, d * sbh,       # the QKV input and the MLP's input (LayerNorm outputs)
                  sbh, sbh]               # two dropout masks, 1 byte each
    split = [3 * d * sbh, d * sbh, 4 * d * sbh, 4 * d * sbh]   # Q K V, projection input, GeLU in, GeLU out
    scores = [2 * d * a * s * s * b, a * s * s * b]            # softmax and its dropout; the 1-byte mask
    kw = dict(layers=L, hidden=h, heads=a, seq_len=s, micro_batch=b, dtype_bytes=d, tp=t)
    per_layer = sum(replicated) + sum(split) // t + sum(scores) // t
    assert activation_memory(**kw) == L * per_layer
    assert activation_memory(**kw, recompute="selective") == L * (sum(replicated) + sum(split) // t)
    assert activation_memory(**kw, recompute="full") == L * d * sbh + per_layer


def test_selective_keeps_no_quadratic_term_and_equals_flash_linear_part():
    sel = [activation_memory(**{**GPT3, "seq_len": s}, recompute="selective") for s in (1024, 2048, 4096)]
    assert sel[1] == 2 * sel[0] and sel[2] == 2 * sel[1]                       # linear in s
    flash = activation_memory(**GPT3, flash_attention=True)
    L, h, a, s, b = 96, 12288, 96, 2048, 1
    assert sel[1] == L * 34 * s * b * h == flash - L * 4 * a * s * b
    assert activation_memory(**GPT3, recompute="selective", flash_attention=True) == sel[1]


def test_checkpointing_is_an_alias_of_full_and_conflicts_are_named():
    assert activation_memory(**GPT3, checkpointing=True) == activation_memory(**GPT3, recompute="full")
    assert activation_memory(**GPT3, checkpointing=True, recompute="full") == activation_memory(**GPT3, recompute="full")
    with pytest.raises(ValueError, match="conflicting arguments: checkpointing=True"):
        activation_memory(**GPT3, checkpointing=True, recompute="selective")
    with pytest.raises(ValueError, match=r"recompute='some'.*\('none', 'selective', 'full'\)"):
        activation_memory(**GPT3, recompute="some")


def test_context_parallel_holds_s_over_cp_queries():
    L, h, a, s, b, cp = 96, 12288, 96, 2048, 1, 4
    q = s // cp
    # without a fused kernel: the rank's s/cp queries scored against all s keys, kept for backward
    assert activation_memory(**GPT3, cp=cp) == L * (34 * q * b * h + 5 * a * q * s * b)
    # FlashAttention keeps only the log-sum-exp: everything is linear, exactly a sequence of s/cp
    assert activation_memory(**GPT3, cp=cp, flash_attention=True) == \
        activation_memory(**{**GPT3, "seq_len": q}, flash_attention=True)
    with pytest.raises(ValueError, match="cp=3 must divide seq_len"):
        activation_memory(**GPT3, cp=3)


def test_pipeline_1f1b_first_stage_keeps_pp_micro_batches():
    one = activation_memory(**GPT3)
    assert activation_memory(**GPT3, pp=8) == one                            # 96/8 layers x 8 in flight
    t = activation_terms(**GPT3, pp=8)
    assert (t["stage"], t["in_flight"], t["layers"]) == ("first", 8, 12 * 8 * t["per_layer"])
    # the last stage: one micro-batch of its 12 layers, plus the logits; binding when the vocabulary is huge
    small = dict(layers=4, hidden=256, heads=4, seq_len=1024, micro_batch=1)
    last = activation_terms(**small, pp=4, vocab=250_000)
    assert last["stage"] == "last" and last["in_flight"] == 1
    assert last["total"] == last["per_layer"] + 2 * 4 * 1024 * 250_000
    first = activation_terms(**small, pp=4, vocab=1000)
    assert first["stage"] == "first" and first["logits"] == 0 and first["total"] == 4 * first["per_layer"]
    with pytest.raises(ValueError, match="pp=5 exceeds layers"):
        activation_memory(**small, pp=5)


def test_logits_two_fp32_copies():
    s, V = 4096, 50257
    kw = dict(layers=1, hidden=4096, heads=32, seq_len=s, micro_batch=1)
    per_copy = s * V * 4                                                     # fp32, one 4k-token sequence
    assert round(per_copy / 1e9, 2) == 0.82
    assert activation_memory(**kw, vocab=V) - activation_memory(**kw) == 2 * per_copy
    assert activation_memory(**kw, vocab=V, tp=4) - activation_memory(**kw, tp=4) == 2 * s * 4 * -(-V // 4)
    assert activation_memory(**kw, vocab=V, cp=2) - activation_memory(**kw, cp=2) == per_copy
    with pytest.raises(ValueError, match="vocab must be an integer >= 1"):
        activation_memory(**kw, vocab=0)


def test_bad_parallel_arguments_are_named():
    with pytest.raises(ValueError, match="tp=5 must divide heads"):
        activation_memory(**GPT3, tp=5)
    with pytest.raises(ValueError, match="sp must be True or False"):
        activation_memory(**GPT3, sp="yes")
    with pytest.raises(ValueError, match="tp must be an integer >= 1"):
        activation_memory(**GPT3, tp=0)


# ---- estimate: context and expert parallelism ----

def test_estimate_cp_shards_like_dp_and_ep_splits_experts():
    psi, n = 70e9, 64
    assert zl.estimate(psi, n, 3, tp=4, cp=2) == zl.estimate(psi, n, 3, tp=4)   # ZeRO over dp·cp = 16
    with pytest.raises(ValueError, match=r"ep=16 must divide dp = n_gpus/\(tp\*pp\*cp\) = 8"):
        zl.estimate(psi, n, 3, tp=4, cp=2, ep=16, expert_params=60e9)
    # Mixtral-8x7B's shape: 45.1B of its 46.7B are experts; ep = 8 over 64 GPUs, ZeRO-1
    shape = zl.theory.get_shape("mixtral-8x7b")
    P, E = shape.params, shape.expert_params
    est = zl.estimate(P, n, 1, ep=8, expert_params=E)
    dense_shard, expert_shard = -(-(P - E) // 64), -(-(E // 8) // 8)      # experts: 1/8 each, ZeRO over 8
    assert est.params == 2 * (P - E) + 2 * (E // 8)
    assert est.optimizer == 12 * dense_shard + 12 * expert_shard
    assert est.psi == P and est.total < zl.estimate(P, n, 1).total
    with pytest.raises(ValueError, match="ep=8 needs expert_params > 0"):
        zl.estimate(P, n, 1, ep=8)
