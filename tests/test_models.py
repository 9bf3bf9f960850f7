"""zerolab.book.models: parameter counts, shapes, determinism, rank slices, a fast 4-rank step."""
import statistics
import time

import pytest
import torch

from zerolab.book.models import MLP, PRESETS, TinyGPT, loss_fn, synthetic_batch


def gpt_params(vocab, n_layer, d_model, seq_len, n_head=None, bias=True, key_bias=True, tie=True):
    """Hand count: per block 12 C^2 weights, 13 C biases/LayerNorm (9 C biases + 4 C LayerNorm)."""
    C = d_model
    block = 12 * C * C + 4 * C + (9 * C if bias else 0) - (C if bias and not key_bias else 0)
    return vocab * C + seq_len * C + n_layer * block + 2 * C + (0 if tie else vocab * C)


@pytest.mark.parametrize("name", sorted(PRESETS))
def test_preset_parameter_counts(name):
    m = TinyGPT.preset(name)
    n = sum(p.numel() for p in m.parameters())  # tied head counted once
    assert n == gpt_params(**PRESETS[name])
    assert len(m.blocks) == PRESETS[name]["n_layer"] and isinstance(m.blocks, torch.nn.ModuleList)


def test_preset_sizes_match_the_book():
    assert sum(p.numel() for p in TinyGPT.preset("tiny").parameters()) == 300_416          # ~0.3M
    assert sum(p.numel() for p in TinyGPT.preset("small").parameters()) == 3_692_032       # 3.69M, the bench model
    # the sweep's sizes (python -m zerolab bench --sweep), counted without building them
    assert gpt_params(**PRESETS["medium"]) == 26_301_440                                  # ~26.3M
    assert gpt_params(**PRESETS["large"]) == 98_484_480                                   # ~98.5M


def test_key_bias_and_untied_head():
    spec = PRESETS["tiny"]
    m = TinyGPT.preset("tiny", key_bias=False, tie_weights=False)
    assert sum(p.numel() for p in m.parameters()) == gpt_params(**spec, key_bias=False, tie=False)
    assert all(b.attn.k.bias is None and b.attn.q.bias is not None for b in m.blocks)
    tied = TinyGPT.preset("tiny")
    assert tied.head.weight is tied.wte.weight
    with pytest.raises(ValueError, match="unknown preset"):
        TinyGPT.preset("huge")


def test_key_bias_gradient_is_zero():
    m = TinyGPT.preset("micro")
    x, y = synthetic_batch(m, 4, seed=1)
    loss_fn(m(x), y).backward()
    for b in m.blocks:
        assert b.attn.k.bias.grad.abs().max() < 1e-7   # exactly zero up to rounding
        assert b.attn.q.bias.grad.abs().max() > 1e-5


def test_forward_shapes():
    m = TinyGPT.preset("micro")
    x, y = synthetic_batch(m, 3)
    assert x.shape == y.shape == (3, 16) and x.dtype == torch.int64
    assert m(x).shape == (3, 16, 128)
    assert m(x[:, :5]).shape == (3, 5, 128)
    mlp = MLP(d_in=5, width=11, depth=2, d_out=3)
    xm, ym = synthetic_batch(mlp, 6)
    assert xm.shape == (6, 5) and ym.shape == (6, 3) and mlp(xm).shape == (6, 3)


def test_init_depends_only_on_seed():
    torch.manual_seed(123)
    a = TinyGPT.preset("micro")
    state = torch.get_rng_state()
    torch.manual_seed(999)
    b = TinyGPT.preset("micro")
    assert torch.equal(torch.get_rng_state(), torch.get_rng_state())
    for (na, pa), (nb, pb) in zip(a.named_parameters(), b.named_parameters()):
        assert na == nb and torch.equal(pa, pb)
    torch.manual_seed(123)
    TinyGPT.preset("micro")
    assert torch.equal(torch.get_rng_state(), state)   # global RNG untouched
    c = TinyGPT.preset("micro", seed=1)
    assert not torch.equal(a.wte.weight, c.wte.weight)


def test_data_is_deterministic_and_learnable():
    m = TinyGPT.preset("micro")
    x1, y1 = synthetic_batch(m, 8, seed=3, step=5)
    x2, y2 = synthetic_batch("micro", 8, seed=3, step=5)
    assert torch.equal(x1, x2) and torch.equal(y1, y2)
    assert not torch.equal(x1, synthetic_batch(m, 8, seed=3, step=6)[0])
    assert not torch.equal(x1, synthetic_batch(m, 8, seed=4, step=5)[0])
    assert torch.equal(x1[:, 1:], y1[:, :-1])                   # targets are inputs shifted by one
    stride = (x1[:, 1] - x1[:, 0]) % 128
    assert torch.equal((x1[:, 2:] - x1[:, 1:-1]) % 128, stride[:, None].expand(-1, 14))
    xm1, ym1 = synthetic_batch("mlp", 4, seed=0)
    xm2, ym2 = synthetic_batch(MLP(), 4, seed=0)
    assert torch.equal(xm1, xm2) and torch.equal(ym1, ym2)


@pytest.mark.parametrize("kind", ["tiny", "mlp"])
@pytest.mark.parametrize("world", [1, 2, 4])
def test_rank_slices_concatenate_to_global_batch(kind, world):
    gx, gy = synthetic_batch(kind, 8, seed=7, step=2)
    parts = [synthetic_batch(kind, 8, seed=7, step=2, rank=r, world_size=world) for r in range(world)]
    assert torch.equal(torch.cat([p[0] for p in parts]), gx)
    assert torch.equal(torch.cat([p[1] for p in parts]), gy)
    assert all(p[0].shape[0] == 8 // world for p in parts)


def test_bad_slicing_is_rejected():
    with pytest.raises(ValueError, match="split evenly"):
        synthetic_batch("micro", 6, rank=0, world_size=4)
    with pytest.raises(ValueError, match="both"):
        synthetic_batch("micro", 8, rank=0)
    with pytest.raises(TypeError):
        synthetic_batch(torch.nn.Linear(2, 2), 4)
    with pytest.raises(TypeError):
        synthetic_batch("huge", 4)


def test_mean_loss_of_rank_slices_equals_global_loss():
    m = TinyGPT.preset("micro")
    gx, gy = synthetic_batch(m, 8, seed=2)
    whole = loss_fn(m(gx), gy)
    parts = [loss_fn(m(x), y) for x, y in (synthetic_batch(m, 8, seed=2, rank=r, world_size=4) for r in range(4))]
    assert torch.allclose(torch.stack(parts).mean(), whole, atol=1e-6)


def test_mlp_edge_cases():
    m = MLP(frozen=True, unused=True, buffer=True)
    named = dict(m.named_parameters())
    assert named["blocks.0.scale"].requires_grad is False
    assert named["unused"].numel() == 7
    assert "offset" in dict(m.named_buffers()) and "offset" not in named
    x, y = synthetic_batch(m, 4)
    loss_fn(m(x), y).backward()
    assert m.unused.grad is None and m.blocks[0].scale.grad is None
    assert m.blocks[0][0].weight.grad is not None
    plain = MLP()
    assert sum(p.numel() for p in plain.parameters()) == (16 * 32 + 32) + 2 * (32 * 32 + 32) + (32 * 4 + 4)
    # the buffer and the frozen scale change the function
    assert not torch.allclose(MLP(buffer=True)(x), plain(x))


def _four_rank_step(steps):
    import torch.distributed as dist
    r, n = dist.get_rank(), dist.get_world_size()
    m = TinyGPT.preset("tiny")
    opt = torch.optim.Adam(m.parameters(), 1e-3)
    times = []
    for s in range(steps):
        x, y = synthetic_batch(m, 8, step=s, rank=r, world_size=n)
        t0 = time.perf_counter()
        loss_fn(m(x), y).backward()
        grads = [p.grad for p in m.parameters()]
        flat = torch.cat([g.reshape(-1) for g in grads])          # one bucket, as DDP would
        dist.all_reduce(flat)
        for g, f in zip(grads, torch._utils._unflatten_dense_tensors(flat / n, grads)):
            g.copy_(f)
        opt.step()
        opt.zero_grad()
        times.append(time.perf_counter() - t0)
    return statistics.median(times[1:])


@pytest.mark.timeout(60)
def test_four_rank_tiny_step_is_well_under_a_second():
    import zerolab as zl
    # the first torch.optim constructor in a process imports torch._dynamo (~2 s);
    # pay it once here so the forked ranks inherit it instead of paying it 4 times
    torch.optim.Adam([torch.zeros(1, requires_grad=True)])
    medians = zl.launch(_four_rank_step, world_size=4, args=(6,))
    assert max(medians) < 0.5, medians
