"""Tiny Hugging Face models from random configs (no downloads), their batches, and single-process
training — shared by tests/test_hf_models.py and tests/test_hf_loading.py (issue 25).

Every family is built from a seed (``torch.manual_seed`` then the constructor), so the ranks, torch
DDP and the single-process reference start from the same values. Dropout and the Switch router's
jitter are off, so the only differences left are float summation order.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from transformers import (GPT2Config, GPT2LMHeadModel, LlamaConfig, LlamaForCausalLM, Qwen2Config,
                          Qwen2ForCausalLM, SwitchTransformersConfig, SwitchTransformersForConditionalGeneration)

VOCAB, STEPS, T = 96, 3, 6
ROWS = {"switch": 1}        # sequences per rank per step (Switch: few tokens, so experts go unused)
ADAMW = {"lr": 2e-3, "weight_decay": 0.01, "eps": 1e-6}
NUM_EXPERTS = 4             # the last one is never routed to (its router bias is -1e3)


def config_of(family):
    small = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                 num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
    if family in ("llama", "lora"):
        return LlamaConfig(**small)
    if family == "qwen2":
        return Qwen2Config(**small)
    if family == "gpt2":   # tied: lm_head.weight is transformer.wte.weight
        return GPT2Config(vocab_size=VOCAB, n_embd=32, n_layer=2, n_head=4, n_positions=64,
                          resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=0, eos_token_id=0)
    if family == "switch":  # one sparse layer in the encoder, one in the decoder; capacity never binds
        return SwitchTransformersConfig(vocab_size=VOCAB, d_model=32, d_kv=8, d_ff=48, num_layers=2,
                                        num_decoder_layers=2, num_heads=4, num_experts=NUM_EXPERTS,
                                        encoder_sparse_step=2, decoder_sparse_step=2, expert_capacity=64,
                                        router_bias=True, router_jitter_noise=0.0, dropout_rate=0.0,
                                        relative_attention_num_buckets=8, decoder_start_token_id=0)
    raise ValueError(family)


CLASSES = {"llama": LlamaForCausalLM, "lora": LlamaForCausalLM, "qwen2": Qwen2ForCausalLM,
           "gpt2": GPT2LMHeadModel, "switch": SwitchTransformersForConditionalGeneration}


def build(family, seed=0, meta=False):
    """The family's tiny model; ``meta``: built under ``torch.device("meta")`` (values come later)."""
    torch.manual_seed(seed)
    if meta:
        with torch.device("meta"):
            model = CLASSES[family](config_of(family))
    else:
        model = CLASSES[family](config_of(family))
    if family == "switch":   # route nothing to the last expert, on any rank (softmax gives it exactly 0)
        with torch.no_grad():
            for m in model.modules():
                if type(m).__name__ == "SwitchTransformersTop1Router" and not m.classifier.bias.is_meta:
                    m.classifier.bias.zero_()
                    m.classifier.bias[-1] = -1e3
    if family == "lora":
        from peft import LoraConfig, get_peft_model
        model = get_peft_model(model, LoraConfig(r=4, lora_alpha=8, lora_dropout=0.0,
                                                 target_modules=["q_proj", "v_proj"]))
    return model


def batch(family, step, rank=0, world_size=1):
    """Rank ``rank``'s rows of step ``step``'s global batch (world_size=1: all of it): (kwargs, labels)."""
    rows = ROWS.get(family, 2)
    g = torch.Generator().manual_seed(1000 + step)
    n = rows * 2   # the global batch is always 2 ranks' worth; world_size 1 takes it all
    x = torch.randint(VOCAB, (n, T), generator=g)
    y = torch.randint(VOCAB, (n, T), generator=g)
    d = torch.randint(VOCAB, (n, T), generator=g)
    lo, hi = (rank * rows, (rank + 1) * rows) if world_size > 1 else (0, n)
    kw = {"input_ids": x[lo:hi], "use_cache": False}
    if family == "switch":
        kw["decoder_input_ids"] = d[lo:hi]
    return kw, y[lo:hi]


def loss_of(out, y):
    """Mean token cross-entropy (every rank has as many tokens, so the mean of the ranks' means is
    the global mean)."""
    logits = out.logits.float()
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), y.reshape(-1))


# stage 3 partitions every parameter (DeepSpeed's default threshold, 1e5 elements, would keep all
# of these tiny models' parameters whole and gather nothing); Switch: each expert its own unit (gathered and reduced on its own), the rest of the model one unit
UNITS = {"switch": ["SwitchTransformersDenseActDense"]}


def engine_config(stage, adamw=None, family=None, **zero):
    cfg = {"optimizer": {"type": "AdamW", "params": dict(adamw or ADAMW)},
           "zero_optimization": {"stage": stage, "reduce_bucket_size": 3000,
                                 "stage3_param_persistence_threshold": 0, **zero}}
    if family in UNITS:
        cfg["zerolab"] = {"units": UNITS[family]}
    return cfg


def reference(family, steps=STEPS, model=None, adamw=None):
    """Single process: torch.optim.AdamW(fused=True) — the kernel the engines run — on the whole
    global batch; a parameter that gets no gradient keeps ``grad=None`` and is skipped."""
    model = model or build(family)
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], fused=True, **(adamw or ADAMW))
    for step in range(steps):
        kw, y = batch(family, step)
        opt.zero_grad(set_to_none=True)
        loss_of(model(**kw), y).backward()
        opt.step()
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def max_diff(got: dict, want: dict) -> tuple[float, str]:
    """The largest |got - want| over the names both hold, and where it is."""
    missing = set(want) - set(got)
    assert set(got) <= set(want) and not [k for k in missing if not k.endswith("lm_head.weight")], \
        sorted(set(got) ^ set(want))[:5]
    worst, where = 0.0, None
    for k, v in got.items():
        d = (v.float() - want[k].float()).abs().max().item() if v.numel() else 0.0
        if where is None or d > worst:
            worst, where = d, k
    return worst, where
