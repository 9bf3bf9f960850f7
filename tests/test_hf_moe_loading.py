"""Mixture-of-experts models from their own ``save_pretrained`` files (bigmodel/hf_names.py).

Transformers 5 fuses the experts in memory (``mlp.experts.gate_up_proj``: one 3-D tensor) and writes
them per expert on disk (``mlp.experts.3.gate_proj.weight``; Mixtral's under ``block_sparse_moe``).
A model built on the meta device at ZeRO-3 (2 ranks) loads that file strictly through
``engine.load_state_dict`` and then holds exactly the saved model's parameters: Mixtral, Qwen2-MoE,
DeepSeek-V3 and OLMoE, tiny random configs (Mixtral with 12 experts: the 10th stacks after the 9th).
"""
from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

import zerolab as zl

FAMILIES = ("mixtral", "qwen2_moe", "deepseek_v3", "olmoe")


def build(family, meta=False):
    import transformers as tf
    small = dict(vocab_size=96, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2, max_position_embeddings=64)
    cls, cfg = {
        "mixtral": (tf.MixtralForCausalLM, lambda: tf.MixtralConfig(**small, num_local_experts=12, num_experts_per_tok=2)),
        "qwen2_moe": (tf.Qwen2MoeForCausalLM, lambda: tf.Qwen2MoeConfig(
            **small, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=16, shared_expert_intermediate_size=32)),
        "deepseek_v3": (tf.DeepseekV3ForCausalLM, lambda: tf.DeepseekV3Config(
            **{**small, "num_key_value_heads": 4}, moe_intermediate_size=16, first_k_dense_replace=1, n_routed_experts=4,
            num_experts_per_tok=2, n_shared_experts=1, q_lora_rank=16, kv_lora_rank=16, qk_rope_head_dim=8,
            qk_nope_head_dim=8, v_head_dim=8, n_group=1, topk_group=1)),
        "olmoe": (tf.OlmoeForCausalLM, lambda: tf.OlmoeConfig(**small, num_experts=4, num_experts_per_tok=2)),
    }[family]
    torch.manual_seed(0)
    if meta:
        with torch.device("meta"):
            return cls(cfg())
    return cls(cfg())


def _load_worker(paths, strict):
    out = {}
    for family, path in paths.items():
        engine = zl.initialize(build(family, meta=True), {"train_micro_batch_size_per_gpu": 1,
                                                          "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
                                                          "zero_optimization": {"stage": 3}})
        try:
            engine.load_state_dict(path, strict=strict)
        except ValueError as e:
            out[family] = str(e)[:300]
            continue
        sd = engine.full_state_dict()
        out[family] = sd if dist.get_rank() == 0 else None
        engine.close()
    return out


def test_moe_models_load_their_own_save_pretrained_files(tmp_path):
    paths, want = {}, {}
    for family in FAMILIES:
        model = build(family)
        model.save_pretrained(tmp_path / family)
        paths[family] = str(tmp_path / family)
        want[family] = model.state_dict()
    got = zl.launch(_load_worker, world_size=2, args=(paths, True), timeout=300, threads=1)[0]
    report = {}
    for family in FAMILIES:
        if isinstance(got[family], str):
            report[family] = got[family]
            continue
        assert sorted(got[family]) == sorted(want[family])
        report[family] = max((got[family][k].float() - want[family][k].float()).abs().max().item()
                             for k in want[family])
    assert report == {f: 0.0 for f in FAMILIES}, report
    assert any("experts.gate_up_proj" in k and v.dim() == 3 for k, v in want["mixtral"].items())   # fused in memory
