"""Dropout under tensor parallelism (zerolab/parallel/rng.py): Hugging Face GPT-2 with dropout 0.1 under
HF_GPT2_PLAN on tp=2, each rank seeded differently (torch.manual_seed(rank)), trains several steps and the TP
ranks' replicated parameters stay bit-equal (the replicated regions drew the same masks); the attention's
dropout on each rank's heads (a split region) draws different masks on the two ranks; the user's global
random state is left as it was by the model's forward. 2 gloo ranks."""
from __future__ import annotations

import pytest
import torch

import zerolab as zl
from zerolab.parallel import HF_GPT2_PLAN, tensor_parallel, vocab_parallel_cross_entropy

pytest.importorskip("transformers")
STEPS = 4


def _worker():
    from transformers import GPT2Config, GPT2LMHeadModel
    mesh = zl.mesh(tp=2)
    cfg = GPT2Config(vocab_size=128, n_positions=16, n_embd=32, n_layer=2, n_head=4, resid_pdrop=0.1,
                     embd_pdrop=0.1, attn_pdrop=0.1, bos_token_id=0, eos_token_id=0, attn_implementation="eager")
    torch.manual_seed(0)
    model = tensor_parallel(GPT2LMHeadModel(cfg), mesh, HF_GPT2_PLAN)
    torch.manual_seed(mesh.rank)   # each rank its own seed, as a user might
    masks = {"split": [], "replicated": []}
    attn = model.transformer.h[0].attn
    # the eager attention returns its weights after dropout (functional, inside the split region): this rank's heads
    attn.register_forward_hook(lambda m, a, o: masks["split"].append((o[1] == 0).clone()))
    attn.resid_dropout.register_forward_hook(lambda m, a, o: masks["replicated"].append((o == 0).clone()))
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    g = torch.Generator().manual_seed(5)
    user = []
    for _ in range(STEPS):
        x = torch.randint(0, 128, (2, 16), generator=g)
        before = torch.get_rng_state()
        logits = model(input_ids=x).logits
        user.append(torch.equal(before, torch.get_rng_state()))
        opt.zero_grad()
        vocab_parallel_cross_entropy(logits[:, :-1], x[:, 1:], mesh).backward()
        opt.step()
    replicated = {n: p.detach().clone() for n, p in model.named_parameters()
                  if not getattr(p, "tensor_parallel", False)}
    return {"replicated": replicated, "masks": masks, "user_state_kept": all(user)}


def test_tp_dropout_replicated_equal_split_different():
    r0, r1 = zl.launch(_worker, 2, timeout=180, threads=1)
    assert r0["user_state_kept"] and r1["user_state_kept"]
    assert r0["replicated"].keys() == r1["replicated"].keys() and len(r0["replicated"]) > 5
    for name, t in r0["replicated"].items():
        assert torch.equal(t, r1["replicated"][name]), f"replicated {name} differs across TP ranks"
    for a, b in zip(r0["masks"]["replicated"], r1["masks"]["replicated"]):
        assert torch.equal(a, b)   # the same mask on every TP rank
    split = list(zip(r0["masks"]["split"], r1["masks"]["split"]))
    assert len(split) == STEPS and all(a.any() and b.any() for a, b in split)   # dropout did drop
    assert not any(torch.equal(a, b) for a, b in split), "the TP ranks' heads got the same dropout mask"
    assert not torch.equal(r0["masks"]["split"][0], r0["masks"]["split"][1])   # fresh masks each step
