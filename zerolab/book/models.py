"""Small models and deterministic synthetic data for the book and the tests.

``TinyGPT`` is a GPT-2-shaped decoder (token + position embeddings, pre-norm
blocks of causal self-attention and a 4x MLP, tied output head) small enough
that a 4-rank training step takes milliseconds on a 2-core CPU. ``MLP`` is a
stack of linear blocks with opt-in edge cases (a frozen parameter, an unused
parameter, a buffer) for engine tests. Both keep their repeated units in
``.blocks`` (an ``nn.ModuleList``): the engines partition and gather one unit
at a time (chapter 6).

``synthetic_batch`` returns the same *global* batch for a given seed and step
on every process, and each rank's contiguous slice of it, so N-rank training
can be compared with single-process training on identical data (chapters 3-6).
Chapter 1 uses the presets to measure memory.
"""
from __future__ import annotations

import math

import torch
import torch.nn as nn
import torch.nn.functional as F

from zerolab.parallel.recompute import checkpoint

# name -> TinyGPT keyword arguments; parameter counts are tested
PRESETS = {
    "micro": dict(vocab=128, n_layer=2, n_head=2, d_model=32, seq_len=16),     # ~0.03M
    "tiny": dict(vocab=1536, n_layer=4, n_head=4, d_model=64, seq_len=32),     # ~0.30M
    "small": dict(vocab=2048, n_layer=4, n_head=4, d_model=256, seq_len=32),   # ~3.69M (the bench model)
    # the bench's scaling sweep (python -m zerolab bench --sweep): fp32 Adam on 4 ranks fits in 24 GB
    "medium": dict(vocab=2048, n_layer=8, n_head=8, d_model=512, seq_len=64),   # 26,301,440 (~26.3M)
    "large": dict(vocab=8192, n_layer=13, n_head=12, d_model=768, seq_len=64),  # 98,484,480 (~98.5M)
}


def _init_weights(module: nn.Module) -> None:
    """GPT-2 initialisation: N(0, 0.02) weights, zero biases, unit LayerNorm."""
    for m in module.modules():
        if isinstance(m, (nn.Linear, nn.Embedding)):
            nn.init.normal_(m.weight, mean=0.0, std=0.02)
        if isinstance(m, nn.Linear) and m.bias is not None:
            nn.init.zeros_(m.bias)


class Attention(nn.Module):
    """Causal multi-head self-attention: (B, T, C) -> (B, T, C).

    q, k and v are separate projections so the key bias can be left out: its
    true gradient is exactly zero (softmax ignores a per-query constant
    q.b_k added to every score), so under Adam it only amplifies rounding.
    ``recompute = "selective"`` (``zl.recompute``) runs ``core`` again in backward.
    """
    recompute_modes, recompute = ("selective",), "none"

    def __init__(self, d_model: int, n_head: int, bias: bool = True, key_bias: bool = True,
                 dropout: float = 0.0, flash_attention: bool = True):
        super().__init__()
        assert d_model % n_head == 0, f"d_model {d_model} not divisible by n_head {n_head}"
        self.n_head, self.dropout, self.flash_attention = n_head, dropout, flash_attention
        self.q = nn.Linear(d_model, d_model, bias=bias)
        self.k = nn.Linear(d_model, d_model, bias=bias and key_bias)
        self.v = nn.Linear(d_model, d_model, bias=bias)
        self.proj = nn.Linear(d_model, d_model, bias=bias)

    def core(self, q, k, v):
        """softmax(q kᵀ/√hs, causal) -> dropout -> · v on (B, nh, T, hs): what selective recomputation
        recomputes. ``flash_attention``: one fused kernel, no T x T tensor kept; otherwise the
        textbook tensors Korthikanti et al. count (scores' softmax, its dropout mask and output)."""
        p = self.dropout if self.training else 0.0
        if self.flash_attention:
            return F.scaled_dot_product_attention(q, k, v, dropout_p=p, is_causal=True)
        T = q.shape[-2]
        causal = torch.full((T, T), float("-inf"), device=q.device, dtype=q.dtype).triu(1)
        return dropout(((q @ k.transpose(-2, -1)) * q.shape[-1] ** -0.5 + causal).softmax(-1), p) @ v

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, T = x.shape[:2]
        # the head size from q's width: under tensor parallelism q, k, v hold n_head/tp heads (chapter 10)
        heads = lambda t: t.view(B, T, self.n_head, -1).transpose(1, 2)  # (B, nh, T, hs)
        q, k, v = heads(self.q(x)), heads(self.k(x)), heads(self.v(x))
        y = checkpoint(self.core, q, k, v) if self.recompute == "selective" else self.core(q, k, v)
        return dropout(self.proj(y.transpose(1, 2).reshape(B, T, -1)), self.dropout if self.training else 0.0)


def dropout(x: torch.Tensor, p: float) -> torch.Tensor:
    """Dropout keeping a 1-byte mask for backward, as GPU kernels do (torch's CPU F.dropout keeps a float one)."""
    return torch.native_dropout(x, p, True)[0] if p else x


class Block(nn.Module):
    """Pre-norm transformer block: x + attn(ln(x)), then x + mlp(ln(x)); 12 C^2 weights."""

    def __init__(self, d_model: int, n_head: int, bias: bool = True, key_bias: bool = True,
                 dropout: float = 0.0, flash_attention: bool = True):
        super().__init__()
        self.ln1 = nn.LayerNorm(d_model)
        self.attn = Attention(d_model, n_head, bias, key_bias, dropout, flash_attention)
        self.ln2 = nn.LayerNorm(d_model)
        self.fc = nn.Linear(d_model, 4 * d_model, bias=bias)
        self.out = nn.Linear(4 * d_model, d_model, bias=bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln1(x))
        return x + dropout(self.out(F.gelu(self.fc(self.ln2(x)))), self.attn.dropout if self.training else 0.0)


class TinyGPT(nn.Module):
    """GPT-2-shaped language model: (B, T) token ids -> (B, T, vocab) logits.

    ``tie_weights``: the output head reuses the token embedding (one
    parameter used twice — an edge case every sharded engine must handle).
    ``key_bias=False`` drops the attention key bias (see ``Attention``) so
    equivalence tests compare only parameters with real gradients. ``dropout``:
    attention and residual dropout (GPT-2's places); ``flash_attention=False``:
    the unfused attention. ``recompute = "full"`` (``zl.recompute``): blocks recomputed.
    Initialisation depends only on ``seed``, never on the global RNG.
    """
    recompute_modes, recompute = ("full",), "none"

    def __init__(self, vocab: int = 1536, n_layer: int = 4, n_head: int = 4, d_model: int = 64,
                 seq_len: int = 32, tie_weights: bool = True, bias: bool = True,
                 key_bias: bool = True, seed: int = 0, dropout: float = 0.0, flash_attention: bool = True):
        super().__init__()
        self.vocab, self.seq_len = vocab, seq_len
        self.wte = nn.Embedding(vocab, d_model)        # (vocab, C)
        self.wpe = nn.Embedding(seq_len, d_model)      # (T, C)
        self.blocks = nn.ModuleList(Block(d_model, n_head, bias, key_bias, dropout, flash_attention)
                                    for _ in range(n_layer))
        self.ln_f = nn.LayerNorm(d_model)
        self.head = nn.Linear(d_model, vocab, bias=False)
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            _init_weights(self)
            for name, p in self.named_parameters():    # GPT-2: scale residual projections by 1/sqrt(2L)
                if name.endswith(("attn.proj.weight", "out.weight")):
                    nn.init.normal_(p, mean=0.0, std=0.02 / math.sqrt(2 * n_layer))
        if tie_weights:
            self.head.weight = self.wte.weight

    @classmethod
    def preset(cls, name: str, **overrides) -> "TinyGPT":
        """``TinyGPT.preset("tiny")``; names in ``PRESETS``; keywords override."""
        if name not in PRESETS:
            raise ValueError(f"unknown preset {name!r}; choose one of {sorted(PRESETS)}")
        return cls(**{**PRESETS[name], **overrides})

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        B, T = idx.shape
        assert T <= self.seq_len, f"sequence length {T} > seq_len {self.seq_len}"
        pos = torch.arange(T, device=idx.device)
        x = self.wte(idx) + self.wpe(pos)              # (B, T, C)
        for block in self.blocks:
            x = checkpoint(block, x) if self.recompute == "full" else block(x)
        return self.head(self.ln_f(x))                 # (B, T, vocab)


class LoRALinear(nn.Module):
    """A frozen ``base`` Linear plus a trainable low-rank update (LoRA, Hu et al. 2021):
    ``y = base(x) + (alpha / r) · x Aᵀ Bᵀ`` with ``A`` (r, in) and ``B`` (out, r).

    ``B`` starts at zero (the model starts as the pretrained one) unless ``b_std`` > 0
    (tests: so that ``A`` gets a gradient from the first step)."""

    def __init__(self, base: nn.Linear, r: int = 4, alpha: float = 8.0, b_std: float = 0.0):
        super().__init__()
        self.base, self.r, self.scale, self.b_std = base, r, alpha / r, b_std
        for p in base.parameters():
            p.requires_grad_(False)
        w = base.weight
        self.lora_a = nn.Parameter(torch.empty(r, w.shape[1], device=w.device, dtype=w.dtype))
        self.lora_b = nn.Parameter(torch.empty(w.shape[0], r, device=w.device, dtype=w.dtype))
        if not w.is_meta:
            self.reset_parameters()

    def reset_parameters(self) -> None:
        """The adapters only (the base has its own): A ~ N(0, 1/in), B = 0 (or N(0, b_std))."""
        nn.init.normal_(self.lora_a, std=self.lora_a.shape[1] ** -0.5)
        nn.init.normal_(self.lora_b, std=self.b_std) if self.b_std else nn.init.zeros_(self.lora_b)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.base(x) + (x @ self.lora_a.t() @ self.lora_b.t()) * self.scale


def add_lora(model: nn.Module, r: int = 4, alpha: float = 8.0, targets=("q", "v"), b_std: float = 0.0,
             seed: int = 0) -> nn.Module:
    """Freeze every parameter of ``model`` and wrap each ``nn.Linear`` whose attribute name is
    in ``targets`` (TinyGPT: ``q``, ``k``, ``v``, ``proj``, ``fc``, ``out``, ``head``) in a
    ``LoRALinear``: the base stays frozen, only the adapters train. Returns ``model``."""
    for p in model.parameters():
        p.requires_grad_(False)
    found = [(parent, name, child) for parent in model.modules()
             for name, child in parent.named_children() if name in targets and isinstance(child, nn.Linear)]
    if not found:
        raise ValueError(f"add_lora: no nn.Linear named one of {list(targets)} in the model")
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        for parent, name, child in found:
            setattr(parent, name, LoRALinear(child, r, alpha, b_std))
    return model


class MLP(nn.Module):
    """Regression MLP: (B, d_in) -> (B, d_out); ``depth`` hidden blocks of ``width``.

    Edge cases for engine tests, each opt-in:
      ``frozen=True``  — ``blocks[0].scale`` (width,) has ``requires_grad=False``
                         (the block multiplies its output by it): a unit mixing
                         trainable and frozen parameters;
      ``unused=True``  — ``self.unused`` (7,) never takes part in forward: its
                         ``.grad`` stays None (odd size, so shards need padding);
      ``buffer=True``  — ``self.offset`` (d_in,) is a buffer subtracted from the input.
    """

    def __init__(self, d_in: int = 16, width: int = 32, depth: int = 3, d_out: int = 4,
                 frozen: bool = False, unused: bool = False, buffer: bool = False, seed: int = 0):
        super().__init__()
        self.d_in, self.d_out = d_in, d_out
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            self.blocks = nn.ModuleList(
                nn.Sequential(nn.Linear(d_in if i == 0 else width, width), nn.Tanh()) for i in range(depth))
            self.head = nn.Linear(width, d_out)
            if frozen:   # applied inside the block, where ZeRO-3 has gathered it
                self.blocks[0] = _Scaled(*self.blocks[0])
                self.blocks[0].register_parameter("scale", nn.Parameter(torch.rand(width) + 0.5, requires_grad=False))
            if unused:
                self.unused = nn.Parameter(torch.randn(7))
            if buffer:
                self.register_buffer("offset", 0.1 * torch.randn(d_in))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if hasattr(self, "offset"):
            x = x - self.offset
        for block in self.blocks:
            x = block(x)
        return self.head(x)


class _Scaled(nn.Sequential):
    """MLP(frozen=True)'s first block: its layers, then times its frozen ``scale``."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return super().forward(x) * self.scale


def loss_fn(output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """Mean loss over the batch: cross-entropy for token ids, MSE for real targets.

    A mean, so the average of N equal-sized rank losses equals the global-batch loss.
    """
    if target.dtype in (torch.int64, torch.int32):
        return F.cross_entropy(output.reshape(-1, output.shape[-1]).float(), target.reshape(-1))
    return F.mse_loss(output.float(), target.float())


def synthetic_batch(model, batch: int, seed: int = 0, step: int = 0,
                    rank: int | None = None, world_size: int | None = None):
    """Deterministic ``(inputs, targets)`` for ``model`` (an instance or a preset name / "mlp").

    The *global* batch of ``batch`` rows depends only on ``(seed, step)``;
    with ``rank`` and ``world_size`` you get rows
    ``[rank * batch/world_size, (rank+1) * batch/world_size)`` of it, so the
    ranks' slices concatenate to the global batch.

    GPT data is learnable: each row counts ``start, start+s, start+2s, ...``
    (mod vocab) with a random stride s in 1..4, so the loss falls as the model
    learns to read the stride. MLP targets come from a fixed random teacher
    network, ``tanh(x @ W1) @ W2`` (same for every step and seed).
    """
    if isinstance(model, str) and model in PRESETS:
        gpt = (PRESETS[model]["vocab"], PRESETS[model]["seq_len"])   # no need to build the model
    elif isinstance(model, TinyGPT):
        gpt = (model.vocab, model.seq_len)
    else:
        gpt = None
        model = MLP() if model == "mlp" else model
    g = torch.Generator().manual_seed(1_000_003 * seed + step)
    if gpt is not None:
        V, T = gpt
        start = torch.randint(0, V, (batch, 1), generator=g)
        stride = torch.randint(1, 5, (batch, 1), generator=g)
        tokens = (start + stride * torch.arange(T + 1)) % V           # (batch, T+1)
        x, y = tokens[:, :-1], tokens[:, 1:]                          # (batch, T) each
    elif isinstance(model, MLP):
        x = torch.randn(batch, model.d_in, generator=g)               # (batch, d_in)
        teacher = torch.Generator().manual_seed(12345)
        w1 = torch.randn(model.d_in, 2 * model.d_in, generator=teacher) / math.sqrt(model.d_in)
        w2 = torch.randn(2 * model.d_in, model.d_out, generator=teacher) / math.sqrt(2 * model.d_in)
        y = torch.tanh(x @ w1) @ w2                                   # (batch, d_out)
    else:
        raise TypeError(f"synthetic_batch knows TinyGPT, MLP, 'mlp' and {sorted(PRESETS)}; got {model!r:.60}")
    if rank is None and world_size is None:
        return x.contiguous(), y.contiguous()
    if rank is None or world_size is None:
        raise ValueError("give both rank and world_size, or neither")
    if not 0 <= rank < world_size or batch % world_size:
        raise ValueError(f"batch {batch} must split evenly over world_size {world_size} (rank {rank})")
    n = batch // world_size
    return x[rank * n:(rank + 1) * n].contiguous(), y[rank * n:(rank + 1) * n].contiguous()
