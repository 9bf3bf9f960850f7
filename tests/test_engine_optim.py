"""ShardedOptimizer (zerolab/engine/optim.py) against torch.optim, bit for bit, one process:
the fused kernel path equals torch.optim.Adam/AdamW(fused=True), the flat-ops fallback equals
the default (foreach) torch.optim."""
import pytest
import torch

import zerolab.engine.optim as optim

LRS = [1e-3, 5e-3, 2e-3]          # a schedule: a different lr at every step
SCALE = 0.5 * 0.7                 # 1/N x clip factor, as the engine passes it


def ours(kind, wd, p0, grads):
    targets = [p0[:3000].clone(), p0[3000:].clone()]     # two units of one flat shard
    opt = optim.ShardedOptimizer(kind, {"lr": LRS[0], "weight_decay": wd, "betas": (0.8, 0.99)}, targets)
    for lr, g in zip(LRS, grads):
        opt.step([g[:3000].clone(), g[3000:].clone()], lr, SCALE)
    return torch.cat(targets), opt


def reference(kind, wd, p0, grads, fused):
    q = torch.nn.Parameter(p0.clone())
    cls = torch.optim.Adam if kind == "adam" else torch.optim.AdamW
    opt = cls([q], lr=LRS[0], weight_decay=wd, betas=(0.8, 0.99), fused=fused)
    for lr, g in zip(LRS, grads):
        opt.param_groups[0]["lr"] = lr
        q.grad = g * SCALE
        opt.step()
    return q.detach()


@pytest.mark.parametrize("kind,wd", [("adam", 0.0), ("adam", 0.1), ("adamw", 0.1)])
def test_fused_and_fallback_match_torch_bit_for_bit(kind, wd, monkeypatch):
    torch.manual_seed(0)
    p0 = torch.randn(20000)
    grads = [torch.randn(20000) for _ in LRS]
    got, opt = ours(kind, wd, p0, grads)
    assert opt.step_count == len(LRS)
    assert opt.nbytes() == 2 * 20000 * 4          # m and v only: the fused step counter is not state
    assert torch.equal(got, reference(kind, wd, p0, grads, fused=True))
    assert not torch.equal(got, reference(kind, wd, p0, grads, fused=False))  # the fused path really ran
    monkeypatch.setattr(optim, "FUSED_ADAM", {"adam": None, "adamw": None})
    fallback, _ = ours(kind, wd, p0, grads)
    assert torch.equal(fallback, reference(kind, wd, p0, grads, fused=False))
