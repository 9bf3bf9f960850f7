"""``tensor_parallel(..., check=True)`` (the default) proves each conversion on a tiny batch against a copy of
the plain model — outputs, every original parameter's gradient, every tie — or raises
``TensorParallelCheckError`` naming the tie, module or parameter and the plan entry; ``check=False`` skips it.
Parameters kept whole inside a split region (Qwen3's per-head q_norm/k_norm; a plan's "replicated_in_split")
get their gradients all-reduced over TP. Phi-3's fused gate|up and Gemma 2's scaled embedding. 2 gloo ranks."""
from __future__ import annotations

import pytest
import torch
from torch import nn

import zerolab as zl
from zerolab.book.models import TinyGPT
from zerolab.parallel import (GPT_PLAN, HF_LLAMA_PLAN, TensorParallelCheckError, replicated_in_split_params,
                              tensor_parallel)

pytest.importorskip("transformers")


class Scale(nn.Module):
    def __init__(self):
        super().__init__()
        self.s = nn.Parameter(torch.tensor([1.5]))

    def forward(self, x):
        return x * self.s


class ScaledMLP(nn.Module):
    """fc (column) -> a whole scalar scale inside the split -> out (row)."""
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.fc, self.scale, self.out = nn.Linear(8, 16), Scale(), nn.Linear(16, 8)

    def forward(self, x):
        return self.out(torch.relu(self.scale(self.fc(x))))


MLP_PLAN = {"fc": "colwise", "out": "rowwise"}


def hf(name, **over):
    import transformers
    small = dict(vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=4, max_position_embeddings=64, head_dim=8)
    torch.manual_seed(0)
    return getattr(transformers, f"{name}ForCausalLM")(getattr(transformers, f"{name}Config")(**{**small, **over}))


PHI3_PLAN = {"model.embed_tokens": "vocab",
             "model.layers.*.mlp.gate_up_proj": "colwise", "model.layers.*.mlp.down_proj": "rowwise",
             "lm_head": "colwise"}


def cases():
    tiny = dict(vocab=64, n_layer=1, n_head=2, d_model=16, seq_len=8)
    return {
        "untied": (lambda: TinyGPT(**tiny), {k: v for k, v in GPT_PLAN.items() if k != "wte"}, {}),
        "partial-grad": (ScaledMLP, MLP_PLAN, dict(example=torch.randn(2, 4, 8))),
        "partial-grad-marked": (ScaledMLP, {**MLP_PLAN, "scale": "replicated_in_split"},
                                dict(example=torch.randn(2, 4, 8))),
        "partial-grad-unchecked": (ScaledMLP, MLP_PLAN, dict(check=False)),
        "row-missing": (ScaledMLP, {"fc": "colwise"}, dict(example=torch.randn(2, 4, 8))),
        "phi3-gate-up-colwise": (lambda: hf("Phi3", pad_token_id=0), PHI3_PLAN, {}),
        "phi3-gate-up": (lambda: hf("Phi3", pad_token_id=0),
                         {**PHI3_PLAN, "model.layers.*.mlp.gate_up_proj": "colwise_gate_up"}, {}),
        "phi3-qkv": (lambda: hf("Phi3", pad_token_id=0),
                     {**PHI3_PLAN, "model.layers.*.mlp.gate_up_proj": "colwise_gate_up",
                      "model.layers.*.self_attn.qkv_proj": "colwise_qkv", "model.layers.*.self_attn.o_proj": "rowwise"},
                     {}),
        "qwen3": (lambda: hf("Qwen3", num_key_value_heads=2), HF_LLAMA_PLAN, {}),
        "gemma2": (lambda: hf("Gemma2", num_key_value_heads=2, tie_word_embeddings=True), HF_LLAMA_PLAN, {}),
    }


def _worker():
    mesh = zl.mesh(tp=2)
    out = {}
    for name, (build, plan, kw) in cases().items():
        try:
            model = tensor_parallel(build(), mesh, plan, **kw)
            out[name] = ("ok", replicated_in_split_params(model))
        except (TensorParallelCheckError, ValueError) as e:
            out[name] = (type(e).__name__, str(e))
    return out


@pytest.fixture(scope="module")
def verdicts():
    return zl.launch(_worker, 2, timeout=300, threads=1)


def test_check_names_what_differs(verdicts):
    for v in verdicts:
        kind, msg = v["untied"]
        assert kind == "TensorParallelCheckError" and "the tie ['wte.weight', 'head.weight']" in msg, msg
        assert "plan entry 'head': 'colwise'" in msg and "no plan entry converts it" in msg, msg
        kind, msg = v["partial-grad"]
        assert kind == "TensorParallelCheckError" and "gradient of 'scale.s' differs" in msg, msg
        assert "replicated_in_split" in msg, msg
        kind, msg = v["row-missing"]
        assert kind == "TensorParallelCheckError" and "fails in forward at 'out'" in msg, msg
        kind, msg = v["phi3-gate-up-colwise"]   # gate|up split as one: another function
        assert kind == "TensorParallelCheckError" and "model.layers.0.mlp" in msg, msg


def test_check_passes_correct_conversions_and_can_be_skipped(verdicts):
    for v in verdicts:
        assert v["partial-grad-marked"] == ("ok", ["scale.s"]), v["partial-grad-marked"]
        assert v["partial-grad-unchecked"] == ("ok", []), v["partial-grad-unchecked"]
        assert v["phi3-gate-up"] == ("ok", []), v["phi3-gate-up"]
        assert v["qwen3"][0] == "ok" and "model.layers.0.self_attn.q_norm.weight" in v["qwen3"][1], v["qwen3"]
        assert "model.layers.1.self_attn.k_norm.weight" in v["qwen3"][1], v["qwen3"]
        assert v["gemma2"][0] == "ok", v["gemma2"]


def test_phi3_fused_qkv_refused_by_name(verdicts):
    for v in verdicts:
        kind, msg = v["phi3-qkv"]
        assert kind == "ValueError" and "'colwise_qkv' on 'model.layers.0.self_attn.qkv_proj' is not supported" \
            in msg and "(Phi3Attention) slices its fused q|k|v" in msg, v["phi3-qkv"]
