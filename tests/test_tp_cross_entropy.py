"""The vocabulary-parallel cross-entropy against ``F.cross_entropy`` on the gathered logits, on 2 gloo ranks:
``ignore_index`` (Hugging Face's -100 label padding), ``label_smoothing`` and every ``reduction``, values and
gradients; a target or token id outside the vocabulary raises ``IndexError`` on every TP rank, as torch does."""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

import zerolab as zl
from zerolab.parallel import VocabParallelEmbedding, vocab_parallel_cross_entropy

V = 16
CASES = [dict(), dict(ignore_index=-100), dict(reduction="sum"), dict(reduction="none"),
         dict(label_smoothing=0.1), dict(label_smoothing=0.2, reduction="sum"), dict(ignore_index=3),
         dict(label_smoothing=0.1, ignore_index=3, reduction="none")]


def _worker():
    mesh = zl.mesh(tp=2)
    comm = mesh.communicator("tp")
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(3, 4, V, generator=g) * 3
    target = torch.randint(0, V, (3, 4), generator=g)
    target[0, 1] = target[1, 2] = target[2, 0] = target[2, 3] = -100   # 4 of 12: label padding
    target[1, 0] = 3
    out = []
    for kw in CASES:
        t = target.masked_fill(target == -100, kw.get("ignore_index", -100))   # ignore_index=3: 5 of 12
        full = logits.clone().requires_grad_()
        want = F.cross_entropy(full.view(-1, V), t.view(-1), **kw)
        w = torch.randn(want.shape, generator=torch.Generator().manual_seed(1))
        (want * w).sum().backward()
        mine = logits.chunk(2, dim=-1)[mesh.tp_rank].clone().requires_grad_()
        got = vocab_parallel_cross_entropy(mine, t, mesh, **kw)
        (got * w.view(got.shape)).sum().backward()
        out.append((got.detach().reshape(want.shape), want.detach(), mine.grad,
                    full.grad.chunk(2, dim=-1)[mesh.tp_rank]))
    errors = []
    for bad in (V, -1, -7):
        t = target.clone()
        t[2, 2] = bad
        try:
            vocab_parallel_cross_entropy(logits.chunk(2, dim=-1)[mesh.tp_rank], t, mesh)
            errors.append(None)
        except IndexError as e:
            errors.append(str(e))
    torch.manual_seed(0)
    emb = VocabParallelEmbedding(nn.Embedding(V, 4), comm, name="wte")
    for bad in (V, -1):
        try:
            emb(torch.tensor([[1, bad, 2]]))
            errors.append(None)
        except IndexError as e:
            errors.append(str(e))
    try:
        vocab_parallel_cross_entropy(logits, target, mesh, reduction="avg")
        errors.append(None)
    except ValueError as e:
        errors.append(str(e))
    return out, errors


def test_vocab_parallel_ce_equals_torch_with_ignore_index_smoothing_reductions():
    results = zl.launch(_worker, 2, timeout=120, threads=1)
    for out, _ in results:
        for kw, (got, want, grad, want_grad) in zip(CASES, out):
            torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6, msg=lambda m: f"{kw}: {m}")
            torch.testing.assert_close(grad, want_grad, rtol=1e-6, atol=1e-6, msg=lambda m: f"{kw} grad: {m}")
        # the padded positions get no gradient
        assert out[0][2][0, 1].abs().max() == 0 and out[0][2][2, 3].abs().max() == 0


def test_out_of_range_targets_and_ids_raise_on_every_rank():
    results = zl.launch(_worker, 2, timeout=120, threads=1)
    for _, errors in results:
        assert all(e is not None for e in errors), errors
        assert f"target {V} out of range [0, {V})" in errors[0] and "target -1 out of range" in errors[1]
        assert "target -7 out of range" in errors[2]
        assert f"wte: token id {V} out of range [0, {V})" in errors[3] and "wte: token id -1 out of range" in errors[4]
        assert "reduction='avg'" in errors[5] and "'mean', 'sum', 'none'" in errors[5]
