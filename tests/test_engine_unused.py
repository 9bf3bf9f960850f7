"""Parameters that get no gradient on some ranks (a mixture of experts routed by the data) at every stage.

Three promises, each against plain single-process torch on the same data:

- collectives are issued in the same order on every rank whatever each rank's
  data touched: an expert used on rank 0 and not on rank 1 must not hang ZeRO-3
  (whose backward all-gathers would interleave differently with the reductions);
- a parameter without a gradient on *every* rank is not stepped — neither its
  Adam moments nor weight decay move it, as torch.optim and DDP
  (``find_unused_parameters=True``) leave it;
- the result equals single-process training, where each rank's half of the
  batch is routed on its own and the two losses are averaged (DDP's semantics).
"""
from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from torch import nn

import zerolab as zl

STEPS = 4
ROWS = 4   # rows per rank


class Block(nn.Module):
    """A residual block with three experts; which run is decided by the data (``route``)."""

    def __init__(self, d, idle=False):
        super().__init__()
        self.norm = nn.LayerNorm(d)
        self.experts = nn.ModuleList([nn.Linear(d, d) for _ in range(3 if idle else 2)])

    def forward(self, x, gate):
        h = self.norm(x)
        out = x + self.experts[0](h)
        if gate:                        # data-dependent: expert 1 only for some batches
            out = out + self.experts[1](h)
        if len(self.experts) > 2:
            skipped = self.experts[2](h)    # computed, never reaches the loss: no gradient anywhere
            del skipped
        return out


class Routed(nn.Module):
    def __init__(self, d=8, seed=0):
        super().__init__()
        torch.manual_seed(seed)
        self.inp = nn.Linear(d, d)
        self.blocks = nn.ModuleList([Block(d, idle=(i == 0)) for i in range(3)])
        self.out = nn.Linear(d, 2)

    def forward(self, x):
        gate = bool(x[:, 0].mean() > 0)   # the router: decided by this rank's rows
        h = self.inp(x)
        for b in self.blocks:
            h = b(h, gate)
        return self.out(h)


def batch(step, rank):
    """Rank ``rank``'s rows of step ``step``: rank 0's first column is positive except at step 2 (expert 1
    used), rank 1's never (expert 1 unused there): at step 2 no rank uses expert 1, which then sits out
    a step and comes back with its own Adam step count one behind."""
    g = torch.Generator().manual_seed(100 * step + rank)
    x = torch.randn(ROWS, 8, generator=g)
    used = rank == 0 and step != 2
    x[:, 0] = x[:, 0].abs() * (1 if used else -1) + (0.5 if used else -0.5)
    y = torch.randint(0, 2, (ROWS,), generator=g)
    return x, y


def loss_of(model, x, y):
    return nn.functional.cross_entropy(model(x), y)


OPT = {"type": "AdamW", "params": {"lr": 1e-2, "weight_decay": 0.1}}


def reference(n):
    """Single process: every rank's rows routed on their own, losses averaged, torch.optim.AdamW."""
    model = Routed()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
    for step in range(STEPS):
        opt.zero_grad()
        loss = sum(loss_of(model, *batch(step, r)) for r in range(n)) / n
        loss.backward()
        opt.step()
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def worker(cases):
    rank, n = dist.get_rank(), dist.get_world_size()
    out = []
    for stage, overlap, prefetch in cases:
        model = Routed()
        zero = {"stage": stage, "overlap_comm": overlap, "reduce_bucket_size": 200}
        if stage == 3:
            zero.update(stage3_prefetch_bucket_size=prefetch, stage3_param_persistence_threshold=0)
        engine = zl.initialize(model, {"train_micro_batch_size_per_gpu": ROWS, "optimizer": OPT,
                                       "zero_optimization": zero})
        for step in range(STEPS):
            engine.backward(loss_of(engine, *batch(step, rank)))
            engine.step()
        sd = engine.full_state_dict()
        engine.close()
        out.append({k: v.detach().clone() for k, v in sd.items()})
    return out


CASES = [(0, False, 0), (1, False, 0), (2, False, 0), (2, True, 0),
         (3, False, 0), (3, True, 0), (3, False, 10**6), (3, True, 10**6)]


@pytest.fixture(scope="module")
def runs():
    return zl.launch(worker, world_size=2, args=(CASES,), timeout=120, collective_timeout=30, threads=1)


@pytest.fixture(scope="module")
def ref():
    return reference(2)


@pytest.mark.parametrize("k", range(len(CASES)), ids=[f"stage{s}-overlap{int(o)}-prefetch{int(p > 0)}"
                                                      for s, o, p in CASES])
def test_parameter_unused_on_one_rank_trains_like_single_process(runs, ref, k):
    got = runs[0][k]
    assert runs[1][k].keys() == got.keys()
    for name, want in ref.items():
        assert torch.allclose(got[name], want, atol=2e-6, rtol=0), (name, (got[name] - want).abs().max())
        assert torch.equal(runs[1][k][name], got[name]), name


@pytest.mark.parametrize("k", range(len(CASES)), ids=[f"stage{s}-overlap{int(o)}-prefetch{int(p > 0)}"
                                                      for s, o, p in CASES])
def test_parameter_unused_on_every_rank_does_not_move(runs, k):
    start = Routed().state_dict()
    got = runs[0][k]
    for part in ("weight", "bias"):
        name = f"blocks.0.experts.2.{part}"   # never reaches the loss: no gradient, ever
        assert torch.equal(got[name], start[name]), name


def resume_worker(stage, directory):
    """4 steps straight, and 3 steps + save + a fresh engine that loads and takes the 4th: expert 1 sat
    out step 2, so its own Adam step count must come back with the checkpoint."""
    rank = dist.get_rank()
    cfg = {"train_micro_batch_size_per_gpu": ROWS, "optimizer": OPT, "zero_optimization": {"stage": stage}}
    out = []
    for resume in (False, True):
        engine = zl.initialize(Routed(), cfg)
        for step in range(STEPS):
            if resume and step == 3:
                engine.save_checkpoint(directory, tag=f"s{stage}")
                engine.close()
                engine = zl.initialize(Routed(seed=5), cfg)
                engine.load_checkpoint(directory, tag=f"s{stage}")
            engine.backward(loss_of(engine, *batch(step, rank)))
            engine.step()
        out.append(engine.full_state_dict())
        engine.close()
    return out


@pytest.mark.parametrize("stage", [1, 3])
def test_steps_a_parameter_sat_out_survive_a_checkpoint(stage, tmp_path):
    straight, resumed = zl.launch(resume_worker, world_size=2, args=(stage, str(tmp_path)), timeout=120,
                                  threads=1)[0]
    for name, want in straight.items():
        assert torch.equal(resumed[name], want), name
