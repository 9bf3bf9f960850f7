"""What passes between pipeline stages (zerolab/parallel/pipeline_schedule.py's P2P, pipeline_run.py).

The header carries the dtype and any number of dimensions: a 5-D activation, and a stage of a bf16
engine that returns fp32, arrive as they were sent. A stage may return a tuple (floating tensors get
gradients back, an integer one travels along), an input the next stage leaves unused gets a zero
gradient; gradients equal single-process training's. ``eval_batch`` (``zerolab.deepspeed``'s
PipelineModule) casts its inputs under bf16 as ``train_batch`` does, and its loss is the mean over
the DP ranks too (dp2 x pp2, the ranks' data far apart so a rank's own mean cannot pass).
"""
from __future__ import annotations

import pytest
import torch
from torch import nn

import zerolab as zl
from zerolab.parallel import pipeline_stage, train_batch

M = 2   # micro-batches


class Lin(nn.Module):
    """A Linear over the last dimension of an input of any number of dimensions."""

    def __init__(self, d, seed):
        super().__init__()
        g = torch.Generator().manual_seed(seed)
        self.weight = nn.Parameter(torch.randn(d, d, generator=g) / d ** 0.5)

    def forward(self, x):
        return torch.tanh(x @ self.weight.to(x.dtype))


class Fork(nn.Module):
    """Returns a tuple: the activation, a second floating tensor the next stage ignores, and an int tensor."""

    def __init__(self, d):
        super().__init__()
        self.lin = Lin(d, 5)

    def forward(self, x):
        h = self.lin(x)
        return h, h * 2, torch.arange(x.shape[-1]).expand(x.shape[:-1] + (x.shape[-1],)).contiguous()


class Join(nn.Module):
    def __init__(self, d):
        super().__init__()
        self.lin = Lin(d, 6)

    def forward(self, x):
        h, _unused, idx = x
        return self.lin(h) + idx.to(h.dtype) * 1e-2


class ToFloat(nn.Module):
    def __init__(self, d):
        super().__init__()
        self.lin = Lin(d, 7)

    def forward(self, x):
        return self.lin(x).float()   # an fp32 output whatever the engine's compute dtype


def mse(out, y):
    return ((out.float() - y) ** 2).mean()


def models(d=4):
    return {"5d": nn.Sequential(Lin(d, 1), Lin(d, 2), Lin(d, 3), Lin(d, 4)),
            "tuple": nn.Sequential(Lin(d, 1), Fork(d), Join(d), Lin(d, 4)),
            "fp32": nn.Sequential(Lin(d, 1), ToFloat(d), Lin(d, 3), Lin(d, 4))}


def data(kind, d=4, seed=0):
    g = torch.Generator().manual_seed(seed)
    shape = (2, 3, 2, 2, d) if kind == "5d" else (3, d)   # 5-D: (batch, 3, 2, 2, d)
    return [(torch.randn(*shape, generator=g), torch.randn(*shape, generator=g)) for _ in range(M)]


def _grads_worker(kind):
    mesh = zl.mesh(pp=2)
    stage = pipeline_stage(models()[kind], mesh)
    loss = train_batch(stage, mesh, data(kind), mse)
    return {"loss": loss, "grads": {n: p.grad for n, p in stage.named_parameters()}}


@pytest.mark.parametrize("kind", ["5d", "tuple"])
def test_activations_of_any_shape_and_tuples_give_single_process_gradients(kind):
    results = zl.launch(_grads_worker, 2, args=(kind,), timeout=120, threads=1)
    model = models()[kind]
    loss = sum(mse(model(x), y) for x, y in data(kind)) / M
    loss.backward()
    got = {**results[0]["grads"], **results[1]["grads"]}
    assert sorted(got) == sorted(n for n, _ in model.named_parameters())
    for n, p in model.named_parameters():
        torch.testing.assert_close(got[n], p.grad, rtol=1e-5, atol=1e-7, msg=lambda m: f"{n}: {m}")
    assert results[0]["loss"] == results[1]["loss"] == pytest.approx(loss.item(), rel=1e-6)


def _bf16_worker():
    mesh = zl.mesh(pp=2)
    engine = zl.initialize(models()["fp32"], {"optimizer": {"type": "SGD", "params": {"lr": 0.0}},
                                              "gradient_accumulation_steps": M, "bf16": {"enabled": True}},
                           mesh=mesh)
    loss = engine.train_batch(data("fp32"), mse)
    return {"loss": loss, "dtypes": [r.dtype for r in mesh.ledger.records if r.op == "send"]}


def test_a_stage_returning_fp32_in_a_bf16_engine():
    """Stage 0's last layer returns fp32 under bf16: the receiver takes the dtype from the header."""
    r0, r1 = zl.launch(_bf16_worker, 2, timeout=120, threads=1)
    model = models()["fp32"]
    want = (sum(mse(model(x), y) for x, y in data("fp32")) / M).item()
    assert r0["loss"] == r1["loss"] == pytest.approx(want, rel=2e-2)   # bf16 parameters and activations
    assert r0["dtypes"] == ["float32"] * M   # stage 0 sent its fp32 outputs as fp32
    assert r1["dtypes"] == ["float32"] * M   # and got fp32 gradients back for them


def linears():
    torch.manual_seed(0)   # torch's own Linear: an fp32 input to its bf16 weight raises
    return [nn.Linear(4, 4), nn.Tanh(), nn.Linear(4, 4), nn.Linear(4, 4)]


def _eval_worker(bf16):
    import zerolab.deepspeed as deepspeed
    from zerolab.deepspeed.pipe import PipelineModule
    model = PipelineModule(linears(), num_stages=2, loss_fn=mse, partition_method="uniform")
    cfg = {"train_micro_batch_size_per_gpu": 3, "gradient_accumulation_steps": M,
           "optimizer": {"type": "SGD", "params": {"lr": 0.1}}, "bf16": {"enabled": bf16}}
    engine, *_ = deepspeed.initialize(model=model, config=cfg)
    dp_rank = engine.mesh.dp_rank
    mine = [(x, y + 10.0 * dp_rank) for x, y in data("2d", seed=dp_rank)]   # DP rank 1's targets far off
    return engine.eval_batch(iter(mine)).item()


def eval_reference(dp):
    model = nn.Sequential(*linears())
    with torch.no_grad():
        return sum(mse(model(x), y + 10.0 * r) for r in range(dp) for x, y in data("2d", seed=r)).item() / (M * dp)


@pytest.mark.slow
def test_eval_batch_under_bf16_averages_over_dp():
    results = zl.launch(_eval_worker, 4, args=(True,), timeout=300, threads=1)
    want = eval_reference(2)
    assert results == pytest.approx([want] * 4, rel=2e-2)   # every rank: the mean over both DP ranks
    assert abs(eval_reference(1) - want) > 0.3 * want        # a DP rank's own mean is far from it


def test_what_cannot_pass_is_refused_by_name():
    from zerolab.parallel.pipeline_schedule import tensors
    with pytest.raises(TypeError, match="pipeline stage 1: a tensor or a tuple of tensors .* got dict"):
        tensors({"h": torch.ones(2)}, "what is sent to pipeline stage 1")
    with pytest.raises(TypeError, match="got tuple holding a list"):
        tensors((torch.ones(2), [torch.ones(2)]), "what is sent to pipeline stage 1")
    with pytest.raises(TypeError, match="dtype torch.complex64 cannot pass"):
        tensors(torch.ones(2, dtype=torch.complex64), "what is sent to pipeline stage 1")
