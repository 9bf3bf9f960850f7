"""Hugging Face models built on the meta device, HF's own files, PEFT adapters and buffers set after
``initialize`` (issue 25, deliverables 1, 5 and 7), on 2 gloo ranks at stages 0-3.

The reference is the same model built normally and trained in one process
(``hf_util.reference``). Most cases here are broken today and marked
``xfail(strict=True)``: the mark goes when the fix lands. A stage that raises is caught and
reported (both ranks raise at the same point), so a failure lists every stage.
"""
from __future__ import annotations

import contextlib

import pytest
import torch
import torch.distributed as dist

import zerolab as zl
from hf_util import STEPS, batch, build, engine_config, loss_of, max_diff, reference

TOL = 1e-5
STAGES = (0, 1, 2, 3)


def meta_worker(family, src, strict, meta=True, stages=STAGES):
    """Build ``family`` on meta (``meta=False``: normally, from another seed than the file's),
    initialize, ``engine.load_state_dict(src, strict)``, train; rank 0 returns {stage: final state
    dict, or the error it raised}."""
    rank, n = dist.get_rank(), dist.get_world_size()
    out = {}
    for stage in stages:
        try:
            engine = zl.initialize(build(family, seed=0 if meta else 1, meta=meta), engine_config(stage))
            engine.load_state_dict(src, strict=strict)
            for step in range(STEPS):
                kw, y = batch(family, step, rank, n)
                engine.backward(loss_of(engine(**kw), y))
                engine.step()
        except (RuntimeError, ValueError) as e:
            out[stage] = f"{type(e).__name__}: {str(e)[:200]}"
            continue
        sd = engine.full_state_dict()
        out[stage] = sd if rank == 0 else None
    return out


def check_meta(family, src, strict=True, meta=True):
    got = zl.launch(meta_worker, world_size=2, args=(family, src, strict, meta), timeout=300, threads=1)[0]
    want = reference(family)
    report = {s: r if isinstance(r, str) else "max diff %.3g (%s)" % max_diff(r, want) for s, r in got.items()}
    print(f"{family} {'built on meta' if meta else 'built'}, loaded:", report)
    assert all(not isinstance(r, str) and max_diff(r, want)[0] <= TOL for r in got.values()), report


def saved(family, directory):
    """``save_pretrained`` of the family's model (seed 0, what ``reference`` starts from): the file."""
    build(family).save_pretrained(directory)
    return str(directory / "model.safetensors")


def test_meta_llama_from_its_save_pretrained_file_trains_like_the_built_model(tmp_path):
    check_meta("llama", saved("llama", tmp_path))


def test_gpt2_save_pretrained_file_loads_with_strict_default(tmp_path):
    path = saved("gpt2", tmp_path)
    from zerolab.engine.bigmodel.load import read_safetensors
    assert "lm_head.weight" not in read_safetensors(path)   # the premise: HF leaves the alias out
    check_meta("gpt2", path)


def test_tied_weight_under_its_second_name_only_is_loaded():
    sd = {k: v for k, v in build("gpt2").state_dict().items() if k != "transformer.wte.weight"}
    assert "lm_head.weight" in sd
    check_meta("gpt2", sd, strict=False)


# ---------------------------------------------------------------- PEFT
def lora_gpt2(meta):
    """LoRA on GPT-2's fused attention projection (a Conv1D), built on meta or normally."""
    from peft import LoraConfig, get_peft_model
    base = build("gpt2", meta=meta)
    with torch.device("meta") if meta else contextlib.nullcontext():
        return get_peft_model(base, LoraConfig(r=4, lora_alpha=8, target_modules=["c_attn"], fan_in_fan_out=True,
                                               lora_dropout=0.0))


def lora_meta_worker(base_sd, stages=STAGES):
    """A meta-built LoRA model, its base weights loaded from the base model's state dict (PEFT's
    names); rank 0 returns {stage: (lora_B's max |value|, logits before any step, or the error)}."""
    rank, n = dist.get_rank(), dist.get_world_size()
    out = {}
    for stage in stages:
        model = lora_gpt2(meta=True)
        prefix = "base_model.model."
        names = set(model.state_dict())
        sd = {}
        for k, v in base_sd.items():   # PEFT's names: base_model.model.<name>, .base_layer. where adapted
            k2 = prefix + k.replace("c_attn.", "c_attn.base_layer.")
            sd[k2 if k2 in names else prefix + k] = v
        assert set(sd) <= names, sorted(set(sd) - names)
        engine = zl.initialize(model, engine_config(stage))
        engine.load_state_dict(sd, strict=False)
        full = engine.full_state_dict()
        lora_b = max(v.abs().max().item() for k, v in full.items() if "lora_B" in k)
        try:
            with torch.no_grad():
                logits = engine(**batch("gpt2", 0, rank, n)[0]).logits
        except RuntimeError as e:
            logits = f"RuntimeError: {str(e)[:200]}"
        out[stage] = (lora_b, logits)
    return out if rank == 0 else None


def test_peft_lora_built_on_meta_starts_as_its_base_model():
    base = build("gpt2")
    with torch.no_grad():
        want = base(**batch("gpt2", 0, 0, 2)[0]).logits
    got = zl.launch(lora_meta_worker, world_size=2, args=(base.state_dict(),), timeout=300, threads=1)[0]
    report = {s: (b, lg if isinstance(lg, str) else "logits max diff %.3g" % (lg - want).abs().max().item())
              for s, (b, lg) in got.items()}
    print("LoRA on meta: (max |lora_B|, forward):", report)
    assert all(b == 0.0 and not isinstance(lg, str) and torch.allclose(lg, want, atol=1e-6)
               for b, lg in got.values()), report


def peft_count_worker(stages=STAGES):
    """PEFT's own counts (``get_nb_trainable_parameters``) of a LoRA model inside each stage's engine,
    and whether every parameter carries ds_numel / ds_shape at its true size."""
    out = {}
    for stage in stages:
        model = build("lora")
        shapes = {n: tuple(p.shape) for n, p in model.named_parameters()}
        zl.initialize(model, engine_config(stage))
        ds = all(getattr(p, "ds_numel", p.numel()) == torch.Size(shapes[n]).numel() and
                 tuple(getattr(p, "ds_shape", p.shape)) == shapes[n] for n, p in model.named_parameters())
        out[stage] = (model.get_nb_trainable_parameters(), ds)
    return out


@pytest.fixture(scope="module")
def peft_counts():
    want = build("lora").get_nb_trainable_parameters()
    got = zl.launch(peft_count_worker, world_size=2, timeout=300, threads=1)[0]
    print("PEFT (trainable, all) per stage:", got, "single process:", want)
    return got, want


def test_peft_counts_parameters_at_stages_0_2(peft_counts):
    got, want = peft_counts
    assert want[0] < want[1] and all(got[s] == (want, True) for s in (0, 1, 2)), (got, want)


def test_peft_counts_parameters_at_stage3(peft_counts):
    got, want = peft_counts
    assert got[3] == (want, True), (got[3], want)


# ---------------------------------------------------------------- buffers set after initialize
class Scaled(torch.nn.Module):
    """A Linear times a non-persistent buffer (absent from every state dict, like RoPE's inv_freq)."""

    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(4, 4)
        self.register_buffer("scale", torch.full((4,), 2.0), persistent=False)

    def forward(self, x):
        return self.lin(x) * self.scale


def buffer_worker(meta, stages=STAGES):
    """Set ``scale`` after initialize in place (3.0) then by assignment (5.0); after each, the
    forward must use it. Rank 0 returns {stage: [max error after each, or the error raised]}."""
    x = torch.randn(3, 4, generator=torch.Generator().manual_seed(0))
    out = {}
    for stage in stages:
        torch.manual_seed(0)
        if meta:
            with torch.device("meta"):
                model = Scaled()
        else:
            model = Scaled()
        engine = zl.initialize(model, {"optimizer": {"type": "SGD", "params": {"lr": 0.1}},
                                       "zero_optimization": {"stage": stage,
                                                             "stage3_param_persistence_threshold": 0}})
        sd = engine.full_state_dict()
        errs = []
        for how, value in (("in place", 3.0), ("assigned", 5.0)):
            if how == "in place":
                model.scale.copy_(torch.full((4,), value))
            else:
                model.scale = torch.full((4,), value)
            want = torch.nn.functional.linear(x, sd["lin.weight"], sd["lin.bias"]) * value
            try:
                with torch.no_grad():
                    errs.append((engine(x) - want).abs().max().item())
            except RuntimeError as e:
                errs.append(f"{how}: RuntimeError: {str(e)[:120]}")
        out[stage] = errs
    return out if dist.get_rank() == 0 else None


@pytest.mark.parametrize("meta", [
    False,
    True,
])
def test_buffer_set_after_initialize_is_used(meta):
    got = zl.launch(buffer_worker, world_size=2, args=(meta,), timeout=120, threads=1)[0]
    print(f"buffer set after initialize (meta={meta}):", got)
    assert all(not isinstance(e, str) and e <= 1e-6 for errs in got.values() for e in errs), got


# ---------------------------------------------------------------- a meta model's own initialisation, HF's files
def own_init_worker(stages=STAGES):
    """A meta-built Llama, no file: rank 0 returns {stage: (norm weights all 1, std of the Linear
    weights, rotary inv_freq, whether a forward runs)} or the error raised."""
    out = {}
    for stage in stages:
        model = build("llama", meta=True)
        engine = zl.initialize(model, engine_config(stage))
        full = engine.full_state_dict()
        norms = all(bool((v == 1).all()) for k, v in full.items() if k.endswith("norm.weight"))
        std = torch.cat([v.flatten() for k, v in full.items() if k.endswith("proj.weight")]).std().item()
        try:
            with torch.no_grad():
                engine(**batch("llama", 0, dist.get_rank(), 2)[0])
            ran = True
        except RuntimeError as e:
            ran = f"RuntimeError: {str(e)[:160]}"
        out[stage] = (norms, std, model.model.rotary_emb.inv_freq.clone(), ran)
    return out if dist.get_rank() == 0 else None


def test_meta_llama_without_a_file_gets_its_own_initialisation():
    """HF's _init_weights: Linear weights N(0, initializer_range = 0.02), norm weights 1; the
    rotary frequencies computed in __init__ (measured: nn.Linear's kaiming init gives std ~0.1)."""
    built = build("llama")
    got = zl.launch(own_init_worker, world_size=2, timeout=300, threads=1)[0]
    report = {s: (norms, round(std, 4), torch.equal(inv, built.model.rotary_emb.inv_freq), ran)
              for s, (norms, std, inv, ran) in got.items()}
    print("meta Llama, own initialisation (norms 1, proj std, inv_freq right, forward):", report)
    assert all(r[0] and 0.017 < r[1] < 0.023 and r[2] and r[3] is True for r in report.values()), report


def test_sharded_save_pretrained_loads_through_its_index(tmp_path):
    """save_pretrained(max_shard_size=...) writes several files and an index naming them; pointing
    load_state_dict at the index loads them all (a model built normally from another seed, so the
    meta-device fixes are not needed here)."""
    build("llama").save_pretrained(tmp_path, max_shard_size="40KB")
    assert len(list(tmp_path.glob("model-*.safetensors"))) > 1
    check_meta("llama", str(tmp_path / "model.safetensors.index.json"), meta=False)


def adapter_worker(path, stages=STAGES):
    """A fresh LoRA model in each stage's engine loads PEFT's adapter file (``adapter_model.safetensors``,
    names without the adapter's name ``default``); rank 0 returns {stage: its LoRA weights or the error}."""
    out = {}
    for stage in stages:
        engine = zl.initialize(build("lora", seed=1), engine_config(stage))
        try:
            engine.load_state_dict(path, strict=False)
        except (RuntimeError, ValueError) as e:
            out[stage] = f"{type(e).__name__}: {str(e)[:160]}"
            continue
        full = engine.full_state_dict()
        out[stage] = {k: v for k, v in full.items() if "lora_" in k}
    return out if dist.get_rank() == 0 else None


def test_peft_adapter_file_loads(tmp_path):
    trained = build("lora")
    opt = torch.optim.AdamW(trained.parameters(), lr=1e-2)
    for step in range(2):   # so lora_B is no longer zero
        kw, y = batch("lora", step)
        opt.zero_grad()
        loss_of(trained(**kw), y).backward()
        opt.step()
    trained.save_pretrained(tmp_path)
    want = {k: v for k, v in trained.state_dict().items() if "lora_" in k}
    assert all(v.abs().max() > 0 for v in want.values())
    got = zl.launch(adapter_worker, world_size=2, args=(str(tmp_path / "adapter_model.safetensors"),),
                    timeout=300, threads=1)[0]
    report = {s: r if isinstance(r, str) else "max diff %.3g (%s)" % max_diff(r, want) for s, r in got.items()}
    print("PEFT adapter file:", report)
    assert all(not isinstance(r, str) and max_diff(r, want)[0] == 0.0 for r in got.values()), report


# ---------------------------------------------------------------- a buffer computed in __init__ (Gemma 2's embed_scale)
def gemma2(meta=False):
    from transformers import Gemma2Config, Gemma2ForCausalLM
    cfg = Gemma2Config(vocab_size=96, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                       num_key_value_heads=2, head_dim=8, max_position_embeddings=64)
    torch.manual_seed(0)
    if meta:
        with torch.device("meta"):
            return Gemma2ForCausalLM(cfg)
    return Gemma2ForCausalLM(cfg)


class ComputedBuffer(torch.nn.Module):
    """A Linear and a buffer its __init__ computes; reset_parameters() leaves the buffer alone."""

    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(4, 4)
        self.register_buffer("scale", torch.arange(4.0), persistent=False)

    def forward(self, x):
        return self.lin(x) * self.scale


def gemma_worker(src, stages=(0, 3)):
    ids = torch.randint(0, 96, (2, 6), generator=torch.Generator().manual_seed(1))
    out = {}
    for stage in stages:
        try:
            engine = zl.initialize(gemma2(meta=True), engine_config(stage))
            engine.load_state_dict(src)   # the file holds no embed_scale (persistent=False)
            with torch.no_grad():
                out[stage] = engine(input_ids=ids).logits.float()
        except RuntimeError as e:
            out[stage] = f"RuntimeError: {str(e)[:300]}"
    with torch.device("meta"):
        model = ComputedBuffer()
    engine = zl.initialize(model, engine_config(0))
    try:
        engine(torch.ones(1, 4))
    except RuntimeError as e:
        out["refused"] = str(e)
    return out


def test_gemma2_built_on_meta_computes_its_embed_scale(tmp_path):
    model = gemma2()
    model.save_pretrained(tmp_path)
    got = zl.launch(gemma_worker, world_size=2, args=(str(tmp_path),), timeout=300, threads=1)
    ids = torch.randint(0, 96, (2, 6), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        want = model(input_ids=ids).logits
    for r in got:
        for stage in (0, 3):
            assert not isinstance(r[stage], str), r[stage]
            torch.testing.assert_close(r[stage], want, rtol=1e-5, atol=1e-5)
        # a buffer nothing sets again is refused with the true reason
        assert "['scale']" in r["refused"] and "a buffer: its module computed it in __init__" in r["refused"]
