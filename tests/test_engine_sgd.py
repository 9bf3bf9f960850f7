"""SGD's options against torch.optim.SGD at stages 0-3 on two ranks (issue 25, item 8).

Nesterov momentum and dampening were accepted by the config but no test trained with
them, so an engine that ignored either passed every test (the mutation suite plants
both: ``tests/mutants``). Each case trains three steps of two micro-batches, with
weight decay, and must reach the parameters of single-process torch.optim.SGD on the
same global batch; one case runs with the optimizer offloaded (its own update loop).
"""
from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

import zerolab as zl
from engine_util import train_rank_slices
from zerolab.book.models import MLP, loss_fn, synthetic_batch

STEPS, MBS, GAS, N = 3, 4, 2, 2   # MBS rows per rank per micro-batch
OPTIONS = {"nesterov": {"lr": 0.05, "momentum": 0.9, "nesterov": True, "weight_decay": 0.01},
           "dampening": {"lr": 0.05, "momentum": 0.9, "dampening": 0.5, "weight_decay": 0.01}}
CASES = [(stage, which, "none") for stage in (0, 1, 2, 3) for which in OPTIONS] + \
        [(2, which, "cpu") for which in OPTIONS]


def train(cases):
    """Inside a rank: each (stage, options, offload) case; rank 0's final parameters."""
    rank, n = dist.get_rank(), dist.get_world_size()
    out = []
    for stage, which, offload in cases:
        model = MLP(depth=3, seed=6)
        zero = {"stage": stage, "reduce_bucket_size": 600}
        if offload != "none":
            zero["offload_optimizer"] = {"device": offload}
        engine = zl.initialize(model, {"optimizer": {"type": "SGD", "params": OPTIONS[which]},
                                       "gradient_accumulation_steps": GAS, "zero_optimization": zero})
        out.append(train_rank_slices(engine, model, STEPS, GAS, MBS, seed=13))
    return out


def reference(which):
    model = MLP(depth=3, seed=6)
    opt = torch.optim.SGD(model.parameters(), **OPTIONS[which])
    for step in range(STEPS):
        x, y = synthetic_batch(model, N * GAS * MBS, seed=13, step=step)
        opt.zero_grad()
        loss_fn(model(x), y).backward()
        opt.step()
    return model.state_dict()


@pytest.fixture(scope="module")
def results():
    return dict(zip(CASES, zl.launch(train, world_size=N, args=(CASES,), timeout=300, threads=1)[0]))


@pytest.mark.parametrize("case", CASES, ids=[f"stage{s}-{w}-{o}" for s, w, o in CASES])
def test_sgd_options_equal_torch_sgd(results, case):
    want, got = reference(case[1]), results[case]
    assert got.keys() == want.keys()
    for name in want:
        torch.testing.assert_close(got[name], want[name], rtol=1e-5, atol=1e-6, msg=lambda m: f"{case} {name}: {m}")
