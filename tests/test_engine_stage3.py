"""Stage 3 on 1-4 ranks reaches the parameters of plain single-process training (issue 5, item 4).

The harness (single-process ``torch.optim`` reference, per-rank training loop)
is ``test_engine_equivalence``'s; this file adds stage-3 configurations
(prefetch on / off, persistence, reuse, tiny live budgets) and two models
every sharded engine must handle: a weight tied across two units, and
control flow that changes from step to step.
"""
from __future__ import annotations

import math

import pytest
import torch

import test_engine_equivalence as eq
import test_engine_precision as prec
import zerolab as zl
from zerolab.book.models import MLP


class TiedMLP(MLP):
    """MLP whose last block reuses the first block's weight: one parameter, two units."""

    def __init__(self, seed=4):
        super().__init__(d_in=16, width=16, depth=3, seed=seed)
        self.blocks[2][0].weight = self.blocks[0][0].weight


class SwitchMLP(MLP):
    """Which blocks run, and how often, changes every step (the same on every rank)."""
    ORDERS = ([0, 1, 2], [0, 2], [0, 1, 1, 2], [2, 0, 1])

    def __init__(self, seed=5):
        super().__init__(d_in=16, width=16, depth=3, seed=seed)
        self.calls = 0

    def forward(self, x):
        order = self.ORDERS[self.calls % len(self.ORDERS)]
        self.calls += self.training
        for i in order:
            x = self.blocks[i](x)
        return self.head(x)


_make_model = eq.make_model


def make_model(kind):
    return {"tied": TiedMLP, "switch": SwitchMLP}.get(kind, lambda: _make_model(kind))()


eq.make_model = make_model  # the harness builds our two extra models too


def stage3(prefetch, **zero):
    """Stage 3 with nothing persistent or reused unless asked: every unit is gathered and released."""
    return {"stage": 3, "stage3_prefetch_bucket_size": prefetch, "stage3_param_persistence_threshold": 0,
            "stage3_max_reuse_distance": 0, **zero}


def fp32_cases():
    adam = {"type": "Adam", "params": {"lr": 3e-3, "weight_decay": 0.01, "adam_w_mode": False}}   # L2: torch.optim.Adam
    adamw = {"type": "AdamW", "params": {"lr": 3e-3, "weight_decay": 0.1}}
    sgd = {"type": "SGD", "params": {"lr": 0.1, "momentum": 0.9, "weight_decay": 0.01}}
    cases = []
    for prefetch in (0, 10**8):
        cases += [
            {"model": "gpt", "config": {"optimizer": adam, "gradient_accumulation_steps": 2, "gradient_clipping": 0.3,
                                        "zero_optimization": stage3(prefetch, reduce_bucket_size=500)}},
            # persistent small params, reuse kept, a live budget smaller than two units
            {"model": "gpt", "config": {"optimizer": sgd, "gradient_accumulation_steps": 2,
                                        "zero_optimization": stage3(prefetch, stage3_param_persistence_threshold=100,
                                                                    stage3_max_reuse_distance=10**9,
                                                                    stage3_max_live_parameters=9000)}},
            {"model": "mlp", "config": {"optimizer": sgd, "gradient_clipping": 0.05,
                                        "zero_optimization": stage3(prefetch, reduce_bucket_size=10**8)}},
            {"model": "mlp", "config": {"optimizer": adamw, "gradient_accumulation_steps": 3,
                                        "zero_optimization": stage3(prefetch, overlap_comm=False)}},
            {"model": "mlp-edge", "config": {"optimizer": {"type": "Adam", "params": {"lr": 1e-2}},
                                             "zero_optimization": stage3(prefetch, reduce_bucket_size=700)}},
            {"model": "tied", "config": {"optimizer": adam, "zero_optimization": stage3(prefetch)}},
            # plain SGD: a block skipped in a step has no gradient, and torch.optim skips it, while
            # the engines (like DDP) see a zero gradient; without momentum or decay both leave it alone
            {"model": "switch", "config": {"optimizer": {"type": "SGD", "params": {"lr": 0.1}},
                                           "zero_optimization": stage3(prefetch)}},
        ]
    return cases


@pytest.mark.parametrize("n", [1, 2, 3, 4])
def test_stage3_fp32_matches_single_process(n):
    cases = fp32_cases()
    with pytest.warns(UserWarning, match="order units ran in changed"):  # the switching model
        results = zl.launch(eq.run_cases, world_size=n, args=(cases,), timeout=300, threads=1)
    for ci, (case, got) in enumerate(zip(cases, results[0])):
        want = eq.reference(case, n)
        assert got.keys() == want.keys()
        for name in want:
            torch.testing.assert_close(got[name], want[name].float(), rtol=1e-4, atol=1e-5,
                                       msg=lambda m: f"n={n} {case} {name}: {m}")
        for r in range(1, n):
            for name in want:
                assert math.isclose(results[r][ci][name], float(got[name].sum()), rel_tol=1e-6, abs_tol=1e-6), \
                    (n, r, ci, name)


@pytest.mark.parametrize("n", [2, 3])
def test_stage3_bf16_matches_fp32_master_reference(n):
    cases = []
    for prefetch in (0, 10**8):
        for kind, p in (("gpt", "bf16"), ("mlp", "fp16")):
            cfg = prec.config(2, p)
            cfg["zero_optimization"] = stage3(prefetch, reduce_bucket_size=3000)
            cases.append((kind, cfg))
    assert prec.launch_and_check(cases, n) == []   # within a fraction of the reference's movement


def stages_worker():
    """The same model and data through stages 2 and 3 (prefetch off / on): identical parameters."""
    import torch.distributed as dist
    from zerolab.book.models import TinyGPT, loss_fn, synthetic_batch
    rank, n = dist.get_rank(), dist.get_world_size()
    out = []
    for zero in ({"stage": 2}, stage3(0), stage3(10**8), {"stage": 3}):
        model = TinyGPT.preset("micro", seed=5)   # with the key bias: bit-for-bit, not close
        engine = zl.initialize(model, {"optimizer": {"type": "Adam", "params": {"lr": 3e-3}},
                                       "zero_optimization": {"reduce_bucket_size": 5000, **zero}})
        for step in range(3):
            x, y = synthetic_batch(model, 2 * n, seed=7, step=step, rank=rank, world_size=n)
            engine.backward(loss_fn(engine(x), y))
            engine.step()
        out.append(engine.full_state_dict())
    return out


def test_stage3_bit_identical_to_stage2():
    for res in zl.launch(stages_worker, world_size=2, threads=1):
        for other in res[1:]:
            for k in res[0]:
                assert torch.equal(other[k], res[0][k]), k


class ReadsChild(torch.nn.Module):
    """A parent whose forward reads its child's weight without calling the child (DeepSpeed trains
    this: an "external parameter"); ``call_after``: the child runs too, after the read."""

    def __init__(self, call_after):
        super().__init__()
        self.child = torch.nn.Linear(8, 8)
        self.call_after = call_after

    def forward(self, x):
        h = torch.tanh(x @ self.child.weight.t())
        return self.child(h) if self.call_after else h


def reads_child_model(seed=3):
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(8, 8), ReadsChild(False), ReadsChild(True), torch.nn.Linear(8, 1))


def reads_child_worker(steps=3):
    import torch.distributed as dist
    rank, n = dist.get_rank(), dist.get_world_size()
    out = {}
    for prefetch in (0, 10**8):
        model = reads_child_model()
        engine = zl.initialize(model, {"optimizer": {"type": "SGD", "params": {"lr": 0.1}},
                                       "zero_optimization": stage3(prefetch)})
        for step in range(steps):
            g = torch.Generator().manual_seed(step)
            x, y = torch.randn(4, 8, generator=g), torch.randn(4, 1, generator=g)
            engine.backward(torch.nn.functional.mse_loss(engine(x[2 * rank: 2 * rank + 2]), y[2 * rank: 2 * rank + 2]))
            engine.step()
        with torch.no_grad():   # an eval forward reads it too
            out[prefetch] = (engine.full_state_dict(), engine(x).sum().item())
    return out


def test_a_parent_reading_its_childs_weight_trains_like_one_process():
    results = zl.launch(reads_child_worker, world_size=2, timeout=120, threads=1)
    model = reads_child_model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for step in range(3):
        g = torch.Generator().manual_seed(step)
        x, y = torch.randn(4, 8, generator=g), torch.randn(4, 1, generator=g)
        opt.zero_grad()
        torch.nn.functional.mse_loss(model(x), y).backward()
        opt.step()
    with torch.no_grad():
        want_out = model(x).sum().item()
    for r in results:
        for state, out in r.values():
            for name, p in model.state_dict().items():
                torch.testing.assert_close(state[name], p, rtol=1e-5, atol=1e-6, msg=lambda m: f"{name}: {m}")
            assert out == pytest.approx(want_out, rel=1e-5)
