"""Transformer shapes: parameters and FLOPs per layer, the presets the replay scales to (chapters 1, 11).

A decoder layer with hidden size h, ``heads`` query heads and ``kv_heads`` key/value heads of
h/heads each, an MLP of ``ffn`` (gated: three matrices, as Llama; plain: two, as GPT-2):

    parameters per layer   h·(h + 2·kv·h/heads) + h·h  (q, k, v, o)  +  (3 or 2)·h·ffn   (+ norms, biases)
    forward FLOPs / token  2 x the matrices' parameters  +  4·s·h  (scores QKᵀ and their product with V,
                           counted whole, as Megatron-LM and torchtitan count them)
    backward               2 x the matrices' forward, 2.5 x the attention's (flash attention recomputes
                           the scores: five products of s·s·h, as torch.utils.flop_counter counts them)

and outside the layers the embedding (V·h) and the head (V·h more unless tied; 2·V·h FLOPs a token).
A mixture of experts (``experts`` > 1, Mixtral's) has ``experts`` MLPs and a router (h·experts) per
layer; a token runs ``top_k`` of them, so the FLOPs count ``top_k`` MLPs and the parameters all of them
(``expert_params``: the experts' share of ``params``, what expert parallelism splits).
"""
from __future__ import annotations

from dataclasses import dataclass, replace


@dataclass(frozen=True)
class ModelShape:
    """A decoder-only transformer's shape and one micro-batch's size (sequences of ``seq`` tokens)."""
    name: str
    hidden: int
    layers: int
    heads: int
    kv_heads: int
    ffn: int
    vocab: int
    seq: int = 2048
    micro_batch: int = 1
    gated: bool = True          # Llama's SwiGLU MLP (3 matrices); False: GPT's (2)
    tied: bool = False          # head = embedding
    gpt: bool = False           # GPT-2's layer: biases, LayerNorms (weight and bias), learned positions
    experts: int = 1            # MLPs per layer (a mixture of experts when > 1)
    top_k: int = 1              # experts each token runs

    def __post_init__(self):
        for key in ("hidden", "layers", "heads", "kv_heads", "ffn", "vocab", "seq", "micro_batch", "experts",
                    "top_k"):
            v = getattr(self, key)
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ValueError(f"ModelShape {key} must be an integer >= 1, got {v!r}")
        if self.hidden % self.heads or self.heads % self.kv_heads:
            raise ValueError(f"ModelShape: heads ({self.heads}) must divide hidden ({self.hidden}) and kv_heads "
                             f"({self.kv_heads}) must divide heads")
        if self.top_k > self.experts:
            raise ValueError(f"ModelShape: top_k ({self.top_k}) cannot exceed experts ({self.experts})")

    @property
    def mlp_params(self) -> int:
        """One MLP's weights (one expert's)."""
        return (2 if self.gpt or not self.gated else 3) * self.hidden * self.ffn

    def _matmuls(self, mlps: int) -> int:
        h, kv = self.hidden, self.kv_heads * self.hidden // self.heads
        router = h * self.experts if self.experts > 1 else 0
        return h * (h + 2 * kv) + h * h + mlps * self.mlp_params + router

    @property
    def matmul_params(self) -> int:
        """The weights of one layer's matrix products (q, k, v, o, the MLPs and a router)."""
        return self._matmuls(self.experts)

    @property
    def expert_params(self) -> int:
        """The experts' weights in ``params`` (0 for a dense model)."""
        return self.layers * self.experts * self.mlp_params if self.experts > 1 else 0

    @property
    def layer_params(self) -> int:
        h, kv = self.hidden, self.kv_heads * self.hidden // self.heads
        if self.gpt:   # + biases of q, k, v, o and the MLP, two LayerNorms of weight and bias
            return self.matmul_params + 2 * h + 2 * kv + self.ffn + h + 4 * h
        return self.matmul_params + 2 * h   # two RMSNorm weights

    @property
    def rest_params(self) -> int:
        """Embedding (and GPT's positions), final norm and (untied) head."""
        h = self.hidden
        extra = self.seq * h + 2 * h if self.gpt else h
        return self.vocab * h * (1 if self.tied else 2) + extra

    @property
    def params(self) -> int:
        return self.layers * self.layer_params + self.rest_params

    @property
    def tokens(self) -> int:
        """Tokens in one micro-batch."""
        return self.seq * self.micro_batch

    def layer_flops(self, phase: str = "forward") -> float:
        """FLOPs of one layer over one micro-batch."""
        matmuls, attention = 2 * self._matmuls(self.top_k), 4 * self.seq * self.hidden
        return self.tokens * (matmuls * _PHASE[phase] + attention * _ATTENTION[phase])

    def rest_flops(self, phase: str = "forward") -> float:
        """FLOPs of the head over one micro-batch (the embedding is a lookup)."""
        return self.tokens * 2 * self.vocab * self.hidden * _PHASE[phase]

    def step_flops(self) -> float:
        """Forward and backward FLOPs of one micro-batch (what MFU divides)."""
        return sum(self.layers * self.layer_flops(p) + self.rest_flops(p) for p in _PHASE)

    def with_(self, **changes) -> "ModelShape":
        return replace(self, **changes)


_PHASE = {"forward": 1, "backward": 2}
_ATTENTION = {"forward": 1, "backward": 2.5}   # flash attention's backward recomputes QKᵀ (torch's count)

# Published configurations (each model's config.json on its model card / paper table).
SHAPES = {
    "llama-2-7b": ModelShape("Llama-2-7B", 4096, 32, 32, 32, 11008, 32000, seq=4096),
    "llama-2-13b": ModelShape("Llama-2-13B", 5120, 40, 40, 40, 13824, 32000, seq=4096),
    "llama-2-70b": ModelShape("Llama-2-70B", 8192, 80, 64, 8, 28672, 32000, seq=4096),
    "llama-3-8b": ModelShape("Llama-3-8B", 4096, 32, 32, 8, 14336, 128256, seq=8192),
    "llama-3-70b": ModelShape("Llama-3-70B", 8192, 80, 64, 8, 28672, 128256, seq=8192),
    # meta-llama/Llama-3.1-405B config.json (and the Llama 3 paper, Table 3): 126 layers, h 16384,
    # 128 heads, 8 KV heads, FFN 53248, vocabulary 128256
    "llama-3.1-405b": ModelShape("Llama-3.1-405B", 16384, 126, 128, 8, 53248, 128256, seq=8192),
    # mistralai/Mixtral-8x7B-v0.1 config.json: h 4096, 32 layers, 32 heads, 8 KV heads, FFN 14336,
    # vocabulary 32000, 8 experts, 2 per token (46.7B parameters, 12.9B active: Mixtral paper, section 2)
    "mixtral-8x7b": ModelShape("Mixtral-8x7B", 4096, 32, 32, 8, 14336, 32000, seq=4096, experts=8, top_k=2),
    # GPT-3 paper (Brown et al. 2020), Table 2.1: 175B = 96 layers, d_model 12288, 96 heads of 128;
    # 13B = 40 layers, 40 heads of 128 (the table prints d_model 5140; 40 x 128 = 5120); context 2048,
    # GPT-2's vocabulary of 50257, tied embedding and head
    "gpt-3-175b": ModelShape("GPT-3 175B", 12288, 96, 96, 96, 4 * 12288, 50257, seq=2048, gated=False,
                             tied=True, gpt=True),
    "gpt-3-13b": ModelShape("GPT-3 13B", 5120, 40, 40, 40, 4 * 5120, 50257, seq=2048, gated=False, tied=True,
                            gpt=True),
    # the ZeRO paper's 7.5B (its Table 1 gives only Ψ): the GPT shape chapter 1 uses for it, 36 layers of
    # h 4096 and 32 heads (12·L·h² = 7.25B in the layers; the book's choice, not a published model)
    "gpt-7.5b": ModelShape("GPT 7.5B", 4096, 36, 32, 32, 4 * 4096, 50257, seq=2048, gated=False, tied=True,
                           gpt=True),
}


def get_shape(shape) -> ModelShape:
    """A ``ModelShape``, or a preset name from ``SHAPES`` (case-insensitive)."""
    if isinstance(shape, ModelShape):
        return shape
    try:
        return SHAPES[str(shape).lower()]
    except KeyError:
        raise ValueError(f"unknown model shape {shape!r}; presets: {sorted(SHAPES)} "
                         f"(or pass a zerolab.theory.ModelShape)") from None
