"""Stages 0-2 on 1-4 ranks reach the parameters of plain single-process training (issue 4, item 6).

One launch per world size runs the whole matrix inside its ranks (fork start-up
is ~0.05 s, but a launch per case would still add up); the single-process
reference is plain ``torch.optim`` on the same global batch, written here
independently of the engine.
"""
from __future__ import annotations

import math

import pytest
import torch
import torch.distributed as dist

import zerolab as zl
from zerolab.book.models import MLP, TinyGPT, loss_fn, synthetic_batch

STEPS = 4
MBS = 2  # rows per rank per micro-batch


def make_model(kind):
    if kind == "gpt":  # tied embedding/head; no key bias (its true gradient is exactly zero)
        return TinyGPT.preset("micro", key_bias=False, seed=1)
    if kind == "mlp-edge":  # frozen param, unused param (wd=0 then), buffer
        return MLP(frozen=True, unused=True, buffer=True, seed=2)
    return MLP(depth=3, seed=3)


def micro_batch(kind, model, step, k, rank, n, gas):
    """Rank ``rank``'s micro-batch ``k`` of the global batch of ``step`` (n*gas*MBS rows)."""
    x, y = synthetic_batch(model, n * gas * MBS, seed=7, step=step)
    lo = (k * n + rank) * MBS
    return x[lo: lo + MBS], y[lo: lo + MBS]


def ds_lr(sched, t):
    """DeepSpeed WarmupDecayLR (linear warm-up), written out independently: optimizer step t + 1 runs at
    the scheduler's iteration t - 1 (it starts at -1, the minimum, and steps after each optimizer step)."""
    p = sched["params"]
    warm = max(2, p["warmup_num_steps"])
    t = t - 1
    if t < 0:
        return p["warmup_min_lr"]
    g = t / warm if t < warm else max(0.0, (p["total_num_steps"] - t) / max(1.0, p["total_num_steps"] - warm))
    return p["warmup_min_lr"] + (p["warmup_max_lr"] - p["warmup_min_lr"]) * g


def reference(case, n):
    """Single process, torch.optim, the whole global batch at once."""
    kind, cfg = case["model"], case["config"]
    model = make_model(kind)
    gas = cfg.get("gradient_accumulation_steps", 1)
    o = cfg["optimizer"]
    params = [p for p in model.parameters() if p.requires_grad]
    hyper = {"weight_decay": 0.0, **o["params"]}   # DeepSpeed's defaults; its "Adam" is AdamW unless adam_w_mode false
    kind = "Adam (L2)" if o["type"] == "Adam" and not hyper.pop("adam_w_mode", True) else o["type"]
    opt = {"Adam": torch.optim.AdamW, "Adam (L2)": torch.optim.Adam, "AdamW": torch.optim.AdamW,
           "SGD": torch.optim.SGD}[kind](params, **hyper)
    clipped = 0
    for step in range(STEPS):
        x, y = synthetic_batch(model, n * gas * MBS, seed=7, step=step)
        loss = loss_fn(model(x), y)
        opt.zero_grad()
        loss.backward()
        if cfg.get("gradient_clipping"):
            norm = torch.nn.utils.clip_grad_norm_(params, cfg["gradient_clipping"])
            clipped += bool(norm > cfg["gradient_clipping"])
        if "scheduler" in cfg:
            for g in opt.param_groups:
                g["lr"] = ds_lr(cfg["scheduler"], step)
        opt.step()
    assert clipped or not cfg.get("gradient_clipping"), "the test's clipping threshold never binds"
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def run_cases(cases):
    """Inside a launched rank: train each case with the engine, return rank 0's full state dicts."""
    rank, n = dist.get_rank(), dist.get_world_size()
    out = []
    for case in cases:
        kind, cfg = case["model"], case["config"]
        model = make_model(kind)
        engine = zl.initialize(model, cfg)
        gas = engine.gas
        for step in range(STEPS):
            for k in range(gas):
                x, y = micro_batch(kind, model, step, k, rank, n, gas)
                engine.backward(loss_fn(engine(x), y))
                engine.step()
        sd = engine.full_state_dict()
        out.append(sd if rank == 0 else {k: v.sum().item() for k, v in sd.items()})
    return out


def fp32_cases():
    cases = []
    adam = {"type": "Adam", "params": {"lr": 3e-3, "weight_decay": 0.01, "adam_w_mode": False}}   # L2: torch.optim.Adam
    adamw = {"type": "AdamW", "params": {"lr": 3e-3, "weight_decay": 0.1}}
    sgd = {"type": "SGD", "params": {"lr": 0.1, "momentum": 0.9, "weight_decay": 0.01}}
    sched = {"type": "WarmupDecayLR", "params": {"warmup_min_lr": 1e-3, "warmup_max_lr": 5e-3,
                                                 "warmup_num_steps": 2, "total_num_steps": 6,
                                                 "warmup_type": "linear"}}
    for stage in (0, 1, 2):
        for i, (kind, opt) in enumerate([("gpt", adam), ("gpt", sgd), ("mlp", sgd), ("mlp", adamw)]):
            zero = {"stage": stage, "overlap_comm": i % 2 == 0,
                    # tiny buckets: one unit per collective; big: all units packed in one
                    "reduce_bucket_size": 500 if i < 2 else 10**8, "allgather_bucket_size": 10**8 if i < 2 else 500}
            cfg = {"optimizer": opt, "gradient_accumulation_steps": 3 if i == 3 else 2,
                   "gradient_clipping": [0.3, 0, 0.05, 0][i], "zero_optimization": zero}
            if stage and i in (1, 2):   # stages 1-2: the ring pair too (gloo's default is all-reduce + broadcasts)
                cfg["zerolab"] = {"collectives": "reduce_scatter"}
            if i == 3:
                cfg["scheduler"] = sched
            cases.append({"model": kind, "config": cfg})
        # edge model: frozen + unused (no weight decay, so the zero gradient leaves it alone) + buffer
        cases.append({"model": "mlp-edge", "config": {
            "optimizer": {"type": "Adam", "params": {"lr": 1e-2}}, "gradient_accumulation_steps": 1,
            "zero_optimization": {"stage": stage, "reduce_bucket_size": 700}}})
    return cases


@pytest.mark.parametrize("n", [1, 2, 3, 4])
def test_fp32_matches_single_process(n):
    cases = fp32_cases()
    results = zl.launch(run_cases, world_size=n, args=(cases,), timeout=300, threads=1)
    for ci, (case, got) in enumerate(zip(cases, results[0])):
        want = reference(case, n)
        assert got.keys() == want.keys()
        for name in want:
            torch.testing.assert_close(got[name], want[name].float(), rtol=1e-4, atol=1e-5,
                                       msg=lambda m: f"n={n} {case} {name}: {m}")
        for r in range(1, n):  # every rank ended with the same parameters
            for name in want:
                assert math.isclose(results[r][ci][name], float(got[name].sum()), rel_tol=1e-6, abs_tol=1e-6), \
                    (n, r, ci, name)


def ddp_worker(stages):
    """TinyGPT *with* the attention key bias (true gradient exactly zero: Adam amplifies rounding
    there, so single-process comparison is meaningless): our engines vs torch DDP, bit for bit."""
    rank, n = dist.get_rank(), dist.get_world_size()
    out = {}
    for stage in ["ddp"] + list(stages):
        model = TinyGPT.preset("micro", seed=5)
        if stage == "ddp":
            ddp = torch.nn.parallel.DistributedDataParallel(model)
            # fused=True: the kernel zerolab's optimizer runs (same maths as the default foreach Adam,
            # float operations in another order, so the last bits differ from foreach)
            opt = torch.optim.Adam(ddp.parameters(), lr=3e-3, fused=True)
        else:
            engine = zl.initialize(model, {"optimizer": {"type": "Adam", "params": {"lr": 3e-3}},
                                           "zero_optimization": {"stage": stage, "reduce_bucket_size": 5000}})
        for step in range(STEPS):
            x, y = synthetic_batch(model, n * MBS, seed=7, step=step, rank=rank, world_size=n)
            if stage == "ddp":
                opt.zero_grad()
                loss_fn(ddp(x), y).backward()
                opt.step()
            else:
                engine.backward(loss_fn(engine(x), y))
                engine.step()
        out[stage] = {k: v.detach().clone() for k, v in model.state_dict().items()}
    return out


def test_bit_identical_to_torch_ddp_on_two_ranks():
    results = zl.launch(ddp_worker, world_size=2, args=((0, 1, 2),), threads=1)
    for res in results:
        want = res["ddp"]
        for stage in (0, 1, 2):
            for k in want:
                assert torch.equal(res[stage][k], want[k]), (stage, k, (res[stage][k] - want[k]).abs().max())


class Branchy(torch.nn.Module):
    """Block 1 runs only for some inputs: ranks disagree on which parameters get gradients."""

    def __init__(self):
        super().__init__()
        g = torch.Generator().manual_seed(11)
        self.blocks = torch.nn.ModuleList(torch.nn.Linear(6, 6) for _ in range(3))
        for p in self.parameters():
            torch.nn.init.normal_(p, std=0.3, generator=g)

    def forward(self, x, use_branch):
        for i, b in enumerate(self.blocks):
            if i != 1 or use_branch:
                x = torch.tanh(b(x))
        return x


def branchy_batch(step, n):
    g = torch.Generator().manual_seed(100 + step)
    return torch.randn(n, MBS, 6, generator=g), torch.randn(n, MBS, 6, generator=g)


def branchy_worker(stages):
    rank, n = dist.get_rank(), dist.get_world_size()
    out = []
    for stage in stages:
        model = Branchy()
        engine = zl.initialize(model, {"optimizer": {"type": "SGD", "params": {"lr": 0.1, "momentum": 0.5}},
                                       "gradient_accumulation_steps": 2,
                                       "zero_optimization": {"stage": stage, "reduce_bucket_size": 10,
                                                             "overlap_comm": True}})
        for step in range(STEPS):
            for k in range(2):
                x, y = branchy_batch(2 * step + k, n)
                use = (rank + step + k) % 2 == 0     # differs across ranks and micro-batches
                engine.backward(torch.nn.functional.mse_loss(engine(x[rank], use), y[rank]))
                engine.step()
        out.append(engine.full_state_dict())
    return out


def test_ranks_that_use_different_parameters_still_match_single_process():
    n = 3
    results = zl.launch(branchy_worker, world_size=n, args=((0, 1, 2),), threads=1)
    ref = Branchy()
    opt = torch.optim.SGD(ref.parameters(), lr=0.1, momentum=0.5)
    for step in range(STEPS):
        opt.zero_grad()
        for k in range(2):
            x, y = branchy_batch(2 * step + k, n)
            loss = sum(torch.nn.functional.mse_loss(ref(x[r], (r + step + k) % 2 == 0), y[r]) for r in range(n))
            (loss / (2 * n)).backward()
        for p in ref.parameters():  # DDP semantics: an unused parameter's gradient is zero, not None
            if p.grad is None:
                p.grad = torch.zeros_like(p)
        opt.step()
    for si, stage in enumerate((0, 1, 2)):
        for r in range(n):
            for k, v in ref.state_dict().items():
                torch.testing.assert_close(results[r][si][k], v, rtol=1e-4, atol=1e-5, msg=lambda m: f"{stage} {k} {m}")
