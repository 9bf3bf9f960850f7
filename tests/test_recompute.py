"""Activation recomputation (``zl.recompute``): the same training, fewer bytes kept, more FLOPs — all measured.

* Bytes: what autograd saves for backward, measured with ``saved_tensors_hooks`` (each storage once,
  parameters left out) on TinyGPT; per layer = (a 4-layer model's bytes - a 2-layer model's) / 2, so the
  embeddings, final LayerNorm and head drop out. Checked against Korthikanti et al.'s formula, written out
  below and through the shared ``activation_memory(..., recompute=)``, plus the one
  thing TinyGPT keeps that the formula leaves out: each LayerNorm's mean and 1/std, one value per token.
* Math: parameters after a few Adam steps with dropout on are bit-identical to no recomputation, in one
  process and under 2-rank ZeRO-2 and ZeRO-3 engines (a recomputation drawing a new dropout mask fails).
* FLOPs: counted with ``FlopCounterMode`` over forward + backward; the extra is ``recompute_flops``.
"""
from __future__ import annotations

import pytest
import torch
from torch.utils.flop_counter import FlopCounterMode

import zerolab as zl
from zerolab.book.models import MLP, TinyGPT, loss_fn, synthetic_batch
from zerolab.parallel.recompute import recompute_flops, saved_bytes
from zerolab.theory.activations import activation_memory

SHAPE = dict(vocab=64, n_head=2, d_model=32, seq_len=16)   # s = 16, h = 32, a = 2
S, H, A, B = 16, 32, 2, 2                                  # and micro-batch b = 2
MODES = ("none", "selective", "full")


def gpt(layers=2, dropout=0.1, flash_attention=False, dtype=torch.float32, mode="none", seed=0):
    model = TinyGPT(n_layer=layers, dropout=dropout, flash_attention=flash_attention, key_bias=False, seed=seed,
                    **SHAPE).to(dtype)
    return zl.recompute(model, mode)


def kept_per_layer(mode, dtype, dropout, flash):
    """Measured: bytes autograd keeps for backward per transformer layer."""
    kept = {}
    for layers in (2, 4):
        model = gpt(layers, dropout, flash, dtype, mode)
        kept[layers], _ = saved_bytes(model, synthetic_batch(model, B)[0], exclude=list(model.parameters()))
    assert (kept[4] - kept[2]) % 2 == 0
    return (kept[4] - kept[2]) // 2


def korthikanti(mode, s, b, h, a, d, dropout, flash):
    """Korthikanti et al. 2022, per layer, adapted to TinyGPT's tensors: d bytes a value; the dropout masks
    (2 sbh-sized, 1 byte each, and with unfused attention one a·s²·b) only when dropout is on; a fused
    (flash) kernel keeps one fp32 log-sum-exp per head and token instead of the s x s tensors."""
    masks = 2 * s * b * h if dropout else 0
    linear = 16 * d * s * b * h + masks                                     # sbh(16d + 2)
    scores = 4 * a * s * b if flash else a * s * s * b * (2 * d + (1 if dropout else 0))   # as²b(2d + 1)
    return {"none": linear + scores, "selective": linear, "full": d * s * b * h}[mode]


def layernorm_stats(s, b, d):
    """Not in the formula: two LayerNorms each keep a mean and 1/std per token (in the compute dtype)."""
    return 2 * 2 * s * b * d


CASES = [(torch.float32, 4, 0.1, False), (torch.bfloat16, 2, 0.1, False), (torch.float32, 4, 0.0, True)]


@pytest.mark.parametrize("dtype,d,dropout,flash", CASES, ids=["fp32-dropout", "bf16-dropout", "fp32-flash"])
def test_bytes_kept_per_layer_equal_korthikanti(dtype, d, dropout, flash):
    got = {m: kept_per_layer(m, dtype, dropout, flash) for m in MODES}
    want = {m: korthikanti(m, S, B, H, A, d, dropout, flash) + (0 if m == "full" else layernorm_stats(S, B, d))
            for m in MODES}
    print(f"{dtype}, dropout {dropout}, flash {flash}: measured {got}, formula {want}")
    assert got == want
    if not flash:   # the numbers the formula's d = 2 form gives: sbh(34 + 5as/h) without recomputation
        assert got["selective"] < got["none"] and got["full"] * 8 < got["selective"]
    # the shared formula, directly: zl.activation_memory(..., recompute=mode), one layer (full: the kept input
    # per layer, the difference between 4 and 2 layers); less its two 1-byte sbh masks without dropout
    masks = 0 if dropout else 2 * S * B * H
    one = {m: activation_memory(1, H, A, S, B, dtype_bytes=d, flash_attention=flash, recompute=m) - masks
           for m in ("none", "selective")}
    assert {m: got[m] - layernorm_stats(S, B, d) for m in one} == one
    full = [activation_memory(n, H, A, S, B, dtype_bytes=d, flash_attention=flash, recompute="full") for n in (2, 4)]
    assert (full[1] - full[0]) // 2 == got["full"]


def test_the_formula_at_d2_is_34_and_5():
    s, b, h, a = 2048, 1, 4096, 32
    assert korthikanti("none", s, b, h, a, 2, 0.1, False) == s * b * h * (34 + 5 * a * s // h)
    assert korthikanti("selective", s, b, h, a, 2, 0.1, False) == 34 * s * b * h


def counted_flops(mode, flash=False, layers=2):
    model = gpt(layers, 0.1, flash, mode=mode)
    x, y = synthetic_batch(model, B)
    with FlopCounterMode(display=False) as counter:
        loss_fn(model(x), y).backward()
    return counter.get_total_flops()


@pytest.mark.parametrize("flash", [False, True], ids=["unfused", "flash"])
def test_flops_counted_equal_the_formula(flash):
    L, V = 2, SHAPE["vocab"]
    forward = L * (24 * B * S * H * H + 4 * B * S * S * H) + 2 * B * S * H * V   # blocks, then the head
    base = counted_flops("none", flash, L)
    assert base == 3 * forward                       # backward = 2 x forward
    extra = {m: counted_flops(m, flash, L) - base for m in ("selective", "full")}
    print(f"forward {forward}, extra counted {extra}")
    assert extra == {"selective": L * 2 * 2 * B * S * S * H, "full": L * (24 * B * S * H * H + 4 * B * S * S * H)}
    assert extra == {m: recompute_flops(L, H, S, B, m) for m in extra}
    assert recompute_flops(L, H, S, B, "none") == 0


def train_in_process(mode, steps=3, seed=11):
    torch.manual_seed(seed)
    model = gpt(mode=mode)
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    for step in range(steps):
        x, y = synthetic_batch(model, 4, seed=5, step=step)
        opt.zero_grad()
        loss_fn(model(x), y).backward()
        opt.step()
    return {n: p.detach().clone() for n, p in model.named_parameters()}


def max_diff(a, b):
    return max((a[k] - b[k]).abs().max().item() for k in a)


def test_recomputation_trains_bit_identically_with_dropout():
    ref = train_in_process("none")
    diffs = {m: max_diff(train_in_process(m), ref) for m in ("selective", "full")}
    print(f"max |parameter difference| vs recompute='none' after 3 Adam steps: {diffs}")
    assert diffs == {"selective": 0.0, "full": 0.0}
    assert max_diff(train_in_process("none", seed=12), ref) > 1e-4    # the dropout masks matter


def _engine_worker(steps):
    rank = torch.distributed.get_rank()
    out = {}
    for stage in (2, 3):
        for mode in MODES:
            torch.manual_seed(100 + rank)                  # each rank its own masks, the same in every mode
            model = gpt(mode=mode)
            engine = zl.initialize(model, {"optimizer": {"type": "Adam", "params": {"lr": 1e-2}},
                                           "zero_optimization": {"stage": stage, "reduce_bucket_size": 4000,
                                                                 "stage3_param_persistence_threshold": 0}})
            for step in range(steps):
                x, y = synthetic_batch(model, 4, seed=5, step=step, rank=rank, world_size=2)
                engine.backward(loss_fn(engine(x), y))
                engine.step()
            out[stage, mode] = engine.full_state_dict()
            engine.close()
    return out


def test_recomputation_under_zero2_and_zero3_on_two_ranks_matches_no_recomputation():
    for res in zl.launch(_engine_worker, 2, args=(3,), timeout=300, threads=1):
        for stage in (2, 3):
            ref = res[stage, "none"]
            diffs = {m: max_diff(res[stage, m], ref) for m in ("selective", "full")}
            print(f"ZeRO-{stage}, 2 ranks: max |parameter difference| vs recompute='none': {diffs}")
            assert max(diffs.values()) <= 1e-6, (stage, diffs)
        assert max_diff(res[2, "none"], res[3, "none"]) <= 1e-5


def test_bad_input_is_named():
    with pytest.raises(ValueError, match=r"mode must be one of \('none', 'selective', 'full'\), got 'some'"):
        zl.recompute(gpt(), "some")
    with pytest.raises(ValueError, match="MLP has no module that can recompute 'full'.*recompute_modes"):
        zl.recompute(MLP(), "full")
    assert zl.recompute(MLP(), "none") is not None
    with pytest.raises(TypeError, match="expected a torch.nn.Module"):
        zl.recompute("TinyGPT", "full")
    with pytest.raises(ValueError, match="mode must be one of"):
        recompute_flops(2, 32, 16, 2, "partial")


def test_modes_set_and_unset_the_hooks():
    model = gpt(mode="selective")
    assert model.recompute == "none" and {b.attn.recompute for b in model.blocks} == {"selective"}
    zl.recompute(model, "full")
    assert model.recompute == "full" and {b.attn.recompute for b in model.blocks} == {"none"}
    zl.recompute(model, "none")
    assert model.recompute == "none" and {b.attn.recompute for b in model.blocks} == {"none"}


# ---------------------------------------------------------------- exercise 10: graded, wrong answers rejected
EXERCISE = "11_recompute_budget"


def _answer(name, *edits):
    from zerolab.grading import exercises as ex
    nb = ex.read(ex.solution_path(EXERCISE))
    src = next(c.source for c in nb.cells if ex.meta(c).get("answer") == name)
    for old, new in edits:
        assert old in src, f"{name}: {old!r} not in the solution"
        src = src.replace(old, new)
    return {name: src}


@pytest.mark.slow
def test_exercise_grader_passes_the_solution_and_rejects_wrong_answers():
    from zerolab.grading import exercises as ex
    from zerolab.grading import grader
    wrong = {   # label: (answers, the checks that must fail)
        "full forgets the layer being recomputed": (
            _answer("kept_bytes", ("return L * d * sbh + layer", "return L * d * sbh")),
            {"Korthikanti's bytes per mode", "every choice fits and follows the rules"}),
        "selective keeps the scores too": (
            _answer("kept_bytes", ("return L * sbh * (16 * d + 2)", "return L * layer")),
            {"your formula against what TinyGPT keeps", "every choice fits and follows the rules"}),
        "most recomputation first": (
            _answer("choose_recompute", ("for mode, b in largest.items():", "for mode, b in reversed(largest.items()):")),
            {"the least recomputation that reaches the target"}),
    }
    nb = ex.read(ex.solution_path(EXERCISE))
    stubs = {ex.meta(c)["answer"]: ex.meta(c)["stub"] for c in nb.cells if ex.ANSWER in ex.tags(c)}
    reports = grader.grade_variants(EXERCISE, {"solution": {}, "stub": stubs,
                                               **{k: a for k, (a, _) in wrong.items()}})
    assert reports["solution"].passed and len(reports["solution"].checks) >= 4, reports["solution"].text()
    assert not any(c.passed for c in reports["stub"].checks), reports["stub"].text()
    for label, (_, must_fail) in wrong.items():
        rep = reports[label]
        assert not rep.passed, f"wrong answer {label!r} passed:\n{rep.text()}"
        assert must_fail <= rep.failed_checks(), (label, sorted(rep.failed_checks()))


def test_deepspeeds_activation_checkpointing_section_points_to_recompute():
    cfg = zl.Config.from_deepspeed({"activation_checkpointing": {"partition_activations": True}})
    assert cfg.ignored == ("activation_checkpointing",)
    assert any("zl.recompute(model" in n for n in cfg.notes), cfg.notes
    assert not any("zl.recompute" in n for n in zl.Config.from_deepspeed({}).notes)


def _hf_zero3_worker(steps):
    from hf_util import build, batch, loss_of
    rank, out = torch.distributed.get_rank(), {}
    for mode in ("none", "full"):
        model = zl.recompute(build("gpt2"), mode)
        engine = zl.initialize(model, {"optimizer": {"type": "Adam", "params": {"lr": 1e-2}}, "zero_optimization": {
            "stage": 3, "stage3_param_persistence_threshold": 0, "reduce_bucket_size": 4000}})
        for step in range(steps):
            kw, y = batch("gpt2", step, rank, 2)
            engine.backward(loss_of(engine(**kw), y))
            engine.step()
        out[mode] = engine.full_state_dict()
        engine.close()
    return out


def test_hugging_face_full_recomputation_one_process_and_under_zero3():
    pytest.importorskip("transformers")
    from hf_util import batch, build, loss_of
    kept, grads = {}, {}
    for mode in ("none", "full"):
        model = zl.recompute(build("gpt2"), mode)
        kw, y = batch("gpt2", 0)
        kept[mode], out = saved_bytes(lambda: model(**kw), exclude=list(model.parameters()))
        loss_of(out, y).backward()
        grads[mode] = {n: p.grad for n, p in model.named_parameters()}
    print(f"Hugging Face GPT-2 (2 layers): bytes kept for backward {kept}")
    assert kept["full"] * 5 < kept["none"] and max_diff(grads["full"], grads["none"]) == 0.0
    assert zl.recompute(model, "none").is_activation_checkpointing is False
    with pytest.raises(ValueError, match="GPT2LMHeadModel has no module that can recompute 'selective'"):
        zl.recompute(model, "selective")
    for res in zl.launch(_hf_zero3_worker, 2, args=(2,), timeout=300, threads=1):
        diff = max_diff(res["full"], res["none"])
        print(f"Hugging Face GPT-2, ZeRO-3 on 2 ranks: max |parameter difference| full vs none: {diff}")
        assert diff <= 1e-6
