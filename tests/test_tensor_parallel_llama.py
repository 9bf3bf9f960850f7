"""Tensor parallelism for Hugging Face's Llama family (HF_LLAMA_PLAN): grouped-query attention (4 query
heads, 2 key/value heads), RoPE, SwiGLU, RMSNorm, tied and untied heads; Mistral and Qwen2 (biased q, k, v)
share the module names. Tiny random configs (nothing downloaded) on 2 gloo ranks: logits, loss and every
gradient equal the unconverted model's; ZeRO over DP x TP=2 on 4 ranks trains to single-process AdamW's
parameters; sizes tp does not divide are named."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import zerolab as zl
from tp_util import assert_named, conversion_errors
from zerolab.parallel import (HF_LLAMA_PLAN, gather_from_tp, gather_tp, tensor_parallel, tp_dims,
                              vocab_parallel_cross_entropy)

pytest.importorskip("transformers")
TOL = 1e-6   # as the GPT-2 test (tests/test_tensor_parallel.py)
SMALL = dict(vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, max_position_embeddings=64)


def build(family="llama", seed=0, **over):
    import transformers
    name = {"llama": "Llama", "mistral": "Mistral", "qwen2": "Qwen2", "qwen3": "Qwen3"}[family]
    more = {"head_dim": 8} if family == "qwen3" else {}   # Qwen3: per-head q_norm/k_norm inside the split
    config = getattr(transformers, f"{name}Config")(**{**SMALL, **more, **over})
    torch.manual_seed(seed)
    return getattr(transformers, f"{name}ForCausalLM")(config)


def ce(logits, y):
    return F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), y.reshape(-1))


def close(a, b):
    assert a.shape == b.shape, (a.shape, b.shape)
    return (a - b).abs().max().item()


def _equal_worker(cases):
    """Per case (family, tied head?, attention kernel, padding token, config changes): max |difference|
    of logits, loss and every gradient."""
    mesh = zl.mesh(tp=2)
    out = []
    for family, tie, attn, pad, more in cases:
        g = torch.Generator().manual_seed(4)
        x, y = torch.randint(0, 128, (2, 16), generator=g), torch.randint(0, 128, (2, 16), generator=g)
        if pad is not None:
            x[0, 3] = pad   # the padding row (rank 1's) is looked up: its gradient must stay zero
        over = dict(tie_word_embeddings=tie, attn_implementation=attn, pad_token_id=pad, **more)
        plain = build(family, **over)
        ref_logits = plain(input_ids=x, use_cache=False).logits
        ref_loss = ce(ref_logits, y)
        ref_loss.backward()
        model = tensor_parallel(build(family, **over), mesh, HF_LLAMA_PLAN)
        logits = model(input_ids=x, use_cache=False).logits
        loss = vocab_parallel_cross_entropy(logits, y, mesh)
        loss.backward()
        dims = tp_dims(model)
        grads = gather_tp({n: p.grad for n, p in model.named_parameters(remove_duplicate=False)}, dims, mesh)
        attn_m = model.model.layers[0].self_attn
        with torch.no_grad():
            whole = gather_from_tp(logits, mesh.communicator("tp"))
        out.append({
            "logits": close(whole, ref_logits.detach()), "loss": close(loss, ref_loss.detach()),
            "grads": {n: close(grads[n], p.grad) for n, p in plain.named_parameters(remove_duplicate=False)},
            "names": sorted(grads) == sorted(n for n, _ in plain.named_parameters(remove_duplicate=False)),
            "tied": model.lm_head.weight is model.model.embed_tokens.weight,
            "groups": attn_m.num_key_value_groups, "head_dim": attn_m.head_dim,
            "shapes": {k: tuple(getattr(attn_m, k).weight.shape) for k in ("q_proj", "k_proj", "o_proj")},
            "head_dims": dims["lm_head.weight"], "local_vocab": logits.shape[-1],
            "pad_grad": None if pad is None else grads["model.embed_tokens.weight"][pad].abs().max().item()})
    return out


# the last: 8 query and 4 key/value heads of head_dim 4, so each rank holds 2 key/value heads, each shared
# by 2 of its 4 query heads
CASES = [("llama", False, "eager", 70, {}), ("llama", True, "sdpa", None, {}), ("mistral", False, "sdpa", None, {}),
         ("qwen2", True, "eager", None, {}), ("qwen3", False, "eager", None, {}), ("llama", False, "eager", None, dict(num_attention_heads=8,
                                                                                  num_key_value_heads=4))]


def test_hf_llama_converted_matches_plain():
    results = zl.launch(_equal_worker, 2, args=(CASES,), timeout=180, threads=1)
    for res in results:
        for case, r in zip(CASES, res):
            assert r["names"] and r["tied"] == case[1], case
            # 2 query and 1 key/value head per rank, head_dim 8 (or 4 and 2 of head_dim 4): the groups
            # (query heads per key/value head, 2) and head_dim unchanged
            assert r["groups"] == 2 and r["head_dim"] == 32 // case[4].get("num_attention_heads", 4)
            assert r["shapes"] == {"q_proj": (16, 32), "k_proj": (8, 32), "o_proj": (32, 16)}
            assert r["head_dims"] == (0, 1) and r["local_vocab"] == 64
            assert r["pad_grad"] in (None, 0.0), case   # untied: the padding row's gradient is exactly zero
            assert r["logits"] <= TOL and r["loss"] <= TOL, (case, r["logits"], r["loss"])
            bad = {k: v for k, v in r["grads"].items() if not v <= TOL}
            assert not bad, (case, bad)


STEPS, ROWS, DP = 3, 2, 2   # ROWS sequences per DP rank and step
ADAMW = {"lr": 2e-3, "weight_decay": 0.01, "eps": 1e-6}
# (ZeRO stage, tied head, gradient clipping, family); Qwen3: q_norm/k_norm's gradients all-reduced over TP
TRAIN = [(1, False, 0.0, "llama"), (3, True, 0.0, "llama"), (2, False, 0.3, "llama"), (2, False, 0.0, "qwen3")]


def data(step):
    g = torch.Generator().manual_seed(100 + step)
    return torch.randint(0, 128, (DP * ROWS, 16), generator=g), torch.randint(0, 128, (DP * ROWS, 16), generator=g)


def reference(tie, clip, family="llama"):
    """Single process, torch.optim.AdamW(fused=True), the unsplit model, the whole global batch at once."""
    model = build(family, tie_word_embeddings=tie)
    opt = torch.optim.AdamW(model.parameters(), fused=True, **ADAMW)
    clipped = 0
    for step in range(STEPS):
        x, y = data(step)
        opt.zero_grad()
        ce(model(input_ids=x, use_cache=False).logits, y).backward()
        if clip:
            clipped += bool(torch.nn.utils.clip_grad_norm_(model.parameters(), clip) > clip)
        opt.step()
    assert clipped == (STEPS if clip else 0), "the clipping threshold does not bind on every step"
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def _train_worker(cases):
    mesh = zl.mesh(dp=DP, tp=2)
    out = []
    for stage, tie, clip, family in cases:
        model = tensor_parallel(build(family, tie_word_embeddings=tie), mesh, HF_LLAMA_PLAN)
        dims = tp_dims(model)
        engine = zl.initialize(model, {"optimizer": {"type": "AdamW", "params": ADAMW}, "gradient_clipping": clip,
                                       "zero_optimization": {"stage": stage, "reduce_bucket_size": 3000,
                                                             "stage3_param_persistence_threshold": 0}}, mesh=mesh)
        for step in range(STEPS):
            x, y = data(step)
            lo = mesh.dp_rank * ROWS   # this DP rank's rows; both TP ranks of a DP rank read the same rows
            out_ = engine(input_ids=x[lo:lo + ROWS], use_cache=False)
            engine.backward(vocab_parallel_cross_entropy(out_.logits, y[lo:lo + ROWS], mesh))
            engine.step()
        sd = gather_tp(engine.full_state_dict(), dims, mesh)
        out.append({k: v.clone() for k, v in sd.items()})
    return out


@pytest.fixture(scope="module")
def trained():
    return zl.launch(_train_worker, 2 * DP, args=(TRAIN,), timeout=300, threads=1)


@pytest.mark.parametrize("ci", range(len(TRAIN)), ids=[f"stage{s}-tied{t}-clip{c}-{f}" for s, t, c, f in TRAIN])
def test_tp2_dp2_llama_trains_like_single_process(trained, ci):
    stage, tie, clip, family = TRAIN[ci]
    want = reference(tie, clip, family)
    got = trained[0][ci]
    assert set(got) <= set(want) and set(want) - set(got) <= ({"lm_head.weight"} if tie else set()), \
        sorted(set(got) ^ set(want))
    for name, t in got.items():
        assert t.shape == want[name].shape, name
        torch.testing.assert_close(t, want[name], rtol=1e-4, atol=1e-5, msg=lambda m: f"stage {stage} {name}: {m}")
    for r in range(1, 2 * DP):   # every rank holds the same whole model
        for name, t in got.items():
            assert torch.equal(trained[r][ci][name], t), (r, name)


def _bad_worker():
    mesh = zl.mesh(tp=2)
    cases = [(dict(num_attention_heads=4, num_key_value_heads=1), False),   # k_proj: 8 features, 1 head
             (dict(hidden_size=48, num_attention_heads=3, num_key_value_heads=3), False),
             (dict(intermediate_size=63), False), (dict(vocab_size=127), False), ({}, True)]
    return conversion_errors([(lambda over=over: build(**over), HF_LLAMA_PLAN, sp) for over, sp in cases], mesh)


def test_sizes_tp_does_not_divide_are_named():
    errors = zl.launch(_bad_worker, 2, timeout=120, threads=1)[0]
    wants = ["tp=2 does not divide config.num_key_value_heads=1 of 'model.layers.0.self_attn'",
             "tp=2 does not divide config.num_attention_heads=3 of 'model.layers.0.self_attn'",
             "tp=2 does not divide intermediate_size=63 of 'model.layers.0.mlp'",
             "model.embed_tokens: tp=2 does not divide the vocabulary (num_embeddings)=127",
             "sequence_parallel=True does not support the attention 'model.layers.0.self_attn (LlamaAttention)'"]
    assert_named(errors, wants)
