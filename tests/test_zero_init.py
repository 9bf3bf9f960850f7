"""``zl.zero_init()``: a model built partitioned keeps the values its own constructor gives, at every stage.

The constructor below does what no ``reset_parameters`` hook can redo: a custom
parameter set in ``__init__``, a Linear re-initialised by its parent, a buffer
computed from the arguments. Built under ``zl.zero_init()`` on 2 ranks with
*different* seeds, every parameter is on the meta device afterwards with this
rank's piece only, and ``initialize`` must give exactly the model rank 0's
constructor built (rank 0's values win), then train exactly like it.
"""
from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from torch import nn

import zerolab as zl


class Custom(nn.Module):
    def __init__(self, d=6):
        super().__init__()
        inp = nn.Linear(d, d)
        nn.init.normal_(inp.weight, std=0.7)             # the parent re-initialises its child, then attaches it
        self.inp = inp
        self.blocks = nn.ModuleList([nn.Linear(d, d) for _ in range(2)])
        self.scale = nn.Parameter(torch.full((d,), 0.5))  # a custom parameter, no reset_parameters
        self.register_buffer("freq", torch.arange(d, dtype=torch.float32) / d, persistent=False)
        self.out = nn.Linear(d, 3)

    def forward(self, x):
        h = self.inp(x) * self.scale + self.freq
        for b in self.blocks:
            h = torch.tanh(b(h))
        return self.out(h)


OPT = {"type": "AdamW", "params": {"lr": 1e-2, "weight_decay": 0.01}}


def data(step):
    g = torch.Generator().manual_seed(step)
    return torch.randn(4, 6, generator=g), torch.randint(0, 3, (4,), generator=g)


def worker(stages):
    rank = dist.get_rank()
    out = {}
    for stage in stages:
        torch.manual_seed(100 + rank)   # different on each rank: rank 0's values must win
        with zl.zero_init():
            model = Custom()
        metas = all(p.is_meta for p in model.parameters())
        pieces = {n: p._zl_piece.numel() for n, p in model.named_parameters()}
        engine = zl.initialize(model, {"optimizer": OPT, "zero_optimization": {
            "stage": stage, "stage3_param_persistence_threshold": 0}})
        start = engine.full_state_dict()
        x, y = data(rank)
        for step in range(3):
            x, y = data(10 * step + rank)
            engine.backward(nn.functional.cross_entropy(engine(x), y))
            engine.step()
        out[stage] = (metas, pieces, start, engine.full_state_dict(), model.freq.clone())
        engine.close()
    return out


def reference():
    torch.manual_seed(100)
    model = Custom()
    start = {k: v.detach().clone() for k, v in model.state_dict().items()}
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.01)
    for step in range(3):
        opt.zero_grad()
        loss = sum(nn.functional.cross_entropy(model(x), y) for x, y in (data(10 * step), data(10 * step + 1))) / 2
        loss.backward()
        opt.step()
    return start, model.state_dict(), model.freq


def test_zero_init_keeps_the_constructors_values_at_every_stage():
    got = zl.launch(worker, world_size=2, args=((0, 1, 2, 3),), timeout=120, threads=1)
    start, end, freq = reference()
    numels = {n: p.numel() for n, p in Custom().named_parameters()}
    for stage in range(4):
        for rank in range(2):
            metas, pieces, s, e, f = got[rank][stage]
            assert metas, "after the block every parameter is on the meta device"
            assert pieces == {n: -(-k // 2) for n, k in numels.items()}, pieces   # this rank's piece only
            for k in start:
                assert torch.equal(s[k], start[k]), (stage, rank, k)            # the constructor's, rank 0's
                assert torch.allclose(e[k], end[k], atol=1e-6, rtol=0), (stage, k, (e[k] - end[k]).abs().max())
            assert torch.equal(f, freq)


def hf_worker():
    transformers = pytest.importorskip("transformers")
    cfg = transformers.LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=32)
    torch.manual_seed(0)
    with zl.zero_init():
        model = transformers.LlamaForCausalLM(cfg)
    engine = zl.initialize(model, {"optimizer": OPT, "zero_optimization": {
        "stage": 3, "stage3_param_persistence_threshold": 0}})
    ids = torch.randint(0, 64, (2, 8), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        logits = engine(input_ids=ids).logits
    return engine.full_state_dict(), logits, model.model.rotary_emb.inv_freq.clone()


def test_zero_init_hugging_face_llama_gets_its_own_initialisation():
    """Its constructor's buffers (RoPE's inv_freq) as built, and what post_init gives: projections
    ~ N(0, initializer_range), norms one — not nn.Linear's defaults."""
    transformers = pytest.importorskip("transformers")
    sd, logits, inv_freq = zl.launch(hf_worker, world_size=2, timeout=120, threads=1)[0]
    cfg = transformers.LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=32)
    normal = transformers.LlamaForCausalLM(cfg)
    assert torch.equal(inv_freq, normal.model.rotary_emb.inv_freq)
    assert torch.isfinite(logits).all()
    for k, v in sd.items():
        if k.endswith("norm.weight"):
            assert torch.equal(v, torch.ones_like(v)), k
        elif k.endswith("proj.weight"):
            assert 0.5 * cfg.initializer_range < v.std() < 1.5 * cfg.initializer_range, (k, v.std())


def test_zero_init_from_pretrained_kernelizes_for_the_device_the_pieces_are_on(tmp_path):
    """transformers picks hub kernels for ``model.device`` when ``from_pretrained`` ends (5.25 with the
    ``kernels`` package); that is the first parameter's device, here a meta placeholder, which it
    refuses. A model built partitioned names the pieces' device instead, as DeepSpeed's placeholders
    (empty tensors on the accelerator) do by themselves."""
    transformers = pytest.importorskip("transformers")
    cfg = transformers.LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=1,
                                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=32)
    transformers.LlamaForCausalLM(cfg).save_pretrained(tmp_path)
    with zl.zero_init():
        model = transformers.LlamaForCausalLM.from_pretrained(tmp_path)
    assert all(p.is_meta for p in model.parameters())
    assert model._kernels_device == "cpu"
    pytest.importorskip("kernels")
    model.set_use_kernels(True)   # what from_pretrained does by default; refused "meta" before
