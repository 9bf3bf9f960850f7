"""Tensor parallelism (zerolab/parallel): each layer against the plain layer it replaces, forward
and gradients in fp32 on 2 gloo ranks; TinyGPT converted by the default plan; bad plans named."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import zerolab as zl
from tp_util import assert_named, conversion_errors
from zerolab.book.models import TinyGPT, loss_fn, synthetic_batch
from zerolab.parallel import (ColumnParallelLinear, RowParallelLinear, VocabParallelEmbedding, gather_tp,
                              tensor_parallel, tp_dims, vocab_parallel_cross_entropy)

TOL = 1e-6


def close(a, b):
    """Largest absolute difference, for a readable report (checked against TOL by the test)."""
    assert a.shape == b.shape, (a.shape, b.shape)
    return (a - b).abs().max().item()


def piece(t, dim, mesh):
    return t.chunk(mesh.tp, dim=dim)[mesh.tp_rank]


def _layers_worker():
    """Inside a rank: max |difference| for every compared tensor, by name."""
    mesh = zl.mesh(tp=2)
    g = torch.Generator().manual_seed(0)
    out = {}
    # column-parallel: the output's slice, W and b's slices, the input's full gradient (f)
    for gather in (False, True):
        plain = nn.Linear(8, 12)
        x = torch.randn(3, 5, 8, generator=g, requires_grad=True)
        w = torch.randn(3, 5, 12, generator=g)
        (plain(x) * w).sum().backward()
        col = ColumnParallelLinear(plain, mesh.communicator("tp"), gather_output=gather)
        xt = x.detach().clone().requires_grad_()
        y = col(xt)
        (y * (w if gather else piece(w, -1, mesh))).sum().backward()
        ref = plain(x).detach()
        tag = "col_gather" if gather else "col"
        out[f"{tag}.y"] = close(y, ref if gather else piece(ref, -1, mesh))
        out[f"{tag}.dW"] = close(col.weight.grad, piece(plain.weight.grad, 0, mesh))
        out[f"{tag}.db"] = close(col.bias.grad, piece(plain.bias.grad, 0, mesh))
        out[f"{tag}.dx"] = close(xt.grad, x.grad)
    # row-parallel: input split, output whole (g), bias whole
    plain = nn.Linear(12, 8)
    x = torch.randn(3, 5, 12, generator=g, requires_grad=True)
    w = torch.randn(3, 5, 8, generator=g)
    (plain(x) * w).sum().backward()
    row = RowParallelLinear(plain, mesh.communicator("tp"))
    xt = piece(x.detach(), -1, mesh).clone().requires_grad_()
    y = row(xt)
    (y * w).sum().backward()
    out["row.y"] = close(y, plain(x).detach())
    out["row.dW"] = close(row.weight.grad, piece(plain.weight.grad, 1, mesh))
    out["row.db"] = close(row.bias.grad, plain.bias.grad)
    out["row.dx"] = close(xt.grad, piece(x.grad, -1, mesh))
    # vocabulary-parallel embedding
    plain = nn.Embedding(16, 6)
    idx = torch.randint(0, 16, (4, 7), generator=g)
    w = torch.randn(4, 7, 6, generator=g)
    (plain(idx) * w).sum().backward()
    emb = VocabParallelEmbedding(plain, mesh.communicator("tp"))
    y = emb(idx)
    (y * w).sum().backward()
    out["emb.y"] = close(y, plain(idx).detach())
    out["emb.dW"] = close(emb.weight.grad, piece(plain.weight.grad, 0, mesh))
    # vocabulary-parallel cross-entropy
    logits = torch.randn(4, 7, 16, generator=g, requires_grad=True)
    target = torch.randint(0, 16, (4, 7), generator=g)
    ref = F.cross_entropy(logits.view(-1, 16), target.view(-1))
    ref.backward()
    lt = piece(logits.detach(), -1, mesh).clone().requires_grad_()
    loss = vocab_parallel_cross_entropy(lt, target, mesh)
    loss.backward()
    out["ce.loss"] = close(loss, ref.detach())
    out["ce.dlogits"] = close(lt.grad, piece(logits.grad, -1, mesh))
    out["tp_bytes"] = mesh.ledger.total_bytes(group="tp")
    return out


def test_layers_match_plain_layers():
    results = zl.launch(_layers_worker, 2, timeout=120, threads=1)
    for res in results:
        assert res.pop("tp_bytes") > 0
        bad = {k: v for k, v in res.items() if not v <= TOL}
        assert not bad, bad


def _gpt_worker():
    """TinyGPT converted by the default plan: logits, loss and every gradient against the plain model."""
    mesh = zl.mesh(tp=2)
    plain = TinyGPT.preset("micro", key_bias=False, seed=1)
    x, y = synthetic_batch(plain, 4, seed=3)
    ref_logits = plain(x)
    ref_loss = loss_fn(ref_logits, y)
    ref_loss.backward()
    ref_grads = {n: p.grad for n, p in plain.named_parameters(remove_duplicate=False)}
    model = tensor_parallel(TinyGPT.preset("micro", key_bias=False, seed=1), mesh)
    dims = tp_dims(model)
    mesh.ledger.reset()
    logits = model(x)
    forward_bytes = mesh.ledger.total_bytes(group="tp")
    loss = vocab_parallel_cross_entropy(logits, y, mesh)
    loss.backward()
    grads = gather_tp({n: p.grad for n, p in model.named_parameters(remove_duplicate=False)}, dims, mesh)
    params = gather_tp(dict(model.named_parameters(remove_duplicate=False)), dims, mesh)
    return {"logits": close(logits, piece(ref_logits.detach(), -1, mesh)), "loss": close(loss, ref_loss.detach()),
            "grads": {n: close(grads[n], g) for n, g in ref_grads.items()},
            "params": {n: close(params[n], p.detach()) for n, p in plain.named_parameters(remove_duplicate=False)},
            "names": sorted(grads) == sorted(ref_grads), "tied": model.head.weight is model.wte.weight,
            "heads": [b.attn.n_head for b in model.blocks], "dims": dims,
            "local_shapes": {n: tuple(p.shape) for n, p in model.named_parameters()},
            "forward_bytes": forward_bytes}


def test_tinygpt_default_plan_matches_plain_model():
    results = zl.launch(_gpt_worker, 2, timeout=120, threads=1)
    for res in results:
        assert res["names"] and res["tied"] and res["heads"] == [1, 1]
        assert res["logits"] <= TOL and res["loss"] <= TOL
        diffs = {**{f"grad {k}": v for k, v in res["grads"].items()}, **{f"param {k}": v for k, v in res["params"].items()}}
        bad = {k: v for k, v in diffs.items() if not v <= TOL}
        assert not bad, bad
        assert res["dims"]["blocks.0.attn.q.weight"] == (0, 1) and res["dims"]["blocks.0.out.weight"] == (1, 1)
        assert "blocks.0.out.bias" not in res["dims"] and "blocks.0.ln1.weight" not in res["dims"]
        shapes = res["local_shapes"]   # micro: vocab 128, d_model 32
        assert shapes["wte.weight"] == (64, 32) and shapes["blocks.0.fc.weight"] == (64, 32)
        assert shapes["blocks.0.out.weight"] == (32, 64) and shapes["blocks.0.out.bias"] == (32,)
        # forward: g after the embedding, after proj and after out in each of 2 blocks: 5 all-reduces
        # of B*T*C = 4*16*32 fp32 over 2 ranks (ring: 2 (n-1)/n of the bytes)
        assert res["forward_bytes"] == 5 * 4 * 16 * 32 * 4


def _bad_worker():
    mesh = zl.mesh(tp=2)
    return conversion_errors([(lambda: TinyGPT(vocab=128, n_head=3, d_model=48, n_layer=1, seq_len=8), None, False),
                              (lambda: TinyGPT(vocab=127, n_head=2, d_model=32, n_layer=1, seq_len=8), None, False),
                              (lambda: nn.Sequential(nn.Linear(4, 7)), {"0": "colwise"}, False),
                              (lambda: nn.Sequential(nn.Linear(4, 8)), {"*.up": "colwise"}, False),
                              (lambda: nn.Sequential(nn.Linear(4, 8)), {"0": "diagonal"}, False),
                              (lambda: nn.Sequential(nn.ReLU()), {"0": "rowwise"}, False)], mesh)


def test_bad_plans_are_named():
    errors = zl.launch(_bad_worker, 2, timeout=60, threads=1)[0]
    wants = ["tp=2 does not divide n_head=3 of 'blocks.0.attn'",
             "wte: tp=2 does not divide the vocabulary (num_embeddings)=127",
             "0: tp=2 does not divide out_features=7",
             "glob(s) ['*.up'] match no module",
             "unknown style(s) {'0': 'diagonal'}",
             "'rowwise' applies to an nn.Linear; '0' is a ReLU"]
    assert_named(errors, wants)


def _hf_gpt2_worker():
    """Hugging Face's GPT2LMHeadModel (tiny random config, nothing downloaded) converted by
    HF_GPT2_PLAN: logits, loss and every gradient against the unconverted model."""
    from transformers import GPT2Config, GPT2LMHeadModel
    from zerolab.parallel import HF_GPT2_PLAN
    mesh = zl.mesh(tp=2)
    cfg = GPT2Config(vocab_size=128, n_positions=16, n_embd=32, n_layer=2, n_head=4, resid_pdrop=0.0,
                     bos_token_id=0, eos_token_id=0,
                     embd_pdrop=0.0, attn_pdrop=0.0, attn_implementation="eager")

    def build():
        torch.manual_seed(0)
        return GPT2LMHeadModel(cfg)
    plain = build()
    x = torch.randint(0, 128, (2, 16), generator=torch.Generator().manual_seed(4))
    ref_logits = plain(x).logits
    ref_loss = loss_fn(ref_logits[:, :-1], x[:, 1:])
    ref_loss.backward()
    model = tensor_parallel(build(), mesh, HF_GPT2_PLAN)
    logits = model(x).logits
    loss = vocab_parallel_cross_entropy(logits[:, :-1], x[:, 1:], mesh)
    loss.backward()
    dims = tp_dims(model)
    # Conv1D weights are stored (in, out), the converted layers hold (out, in): gather_tp gives the original's
    grads = gather_tp({n: p.grad for n, p in model.named_parameters(remove_duplicate=False)}, dims, mesh)
    attn = model.transformer.h[0].attn
    return {"logits": close(logits, piece(ref_logits.detach(), -1, mesh)), "loss": close(loss, ref_loss.detach()),
            "grads": {n: close(grads[n], p.grad) for n, p in
                      plain.named_parameters(remove_duplicate=False)},
            "heads": (attn.num_heads, attn.split_size), "tied": model.lm_head.weight is model.transformer.wte.weight,
            "qkv_dims": dims["transformer.h.0.attn.c_attn.weight"]}


def test_hf_gpt2_converted_matches_plain():
    pytest.importorskip("transformers")
    results = zl.launch(_hf_gpt2_worker, 2, timeout=180, threads=1)
    for res in results:
        assert res["heads"] == (2, 16) and res["tied"] and res["qkv_dims"] == (0, 3)
        assert res["logits"] <= TOL and res["loss"] <= TOL, res
        bad = {k: v for k, v in res["grads"].items() if not v <= TOL}
        assert not bad, bad


def test_split_memo_never_hands_a_freed_parameters_slice_to_another():
    """The memo of split parameters is keyed by id(): a temporary (as_linear's transposed Conv1D weight) freed
    before the next layer is split must not pass its id, and so its slice, on (GPT-2's mlp.c_proj once got
    attn.c_proj's slice that way, now and then)."""
    import torch
    from torch import nn
    from zerolab.parallel.layers import _split_param
    from zerolab.runtime.comm import Communicator
    comm, memo = Communicator(), {}
    slices = [_split_param(nn.Parameter(torch.full((4, 2), float(k))), 0, comm, memo) for k in range(20)]
    assert [float(s[0, 0]) for s in slices] == [float(k) for k in range(20)]
