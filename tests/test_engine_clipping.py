"""Gradient clipping at stages 0-3 against torch's ``clip_grad_norm_`` (issue 25, items 7-8).

Two thresholds, each checked in the reference to do what it claims on every step:
far above the gradient norm (clipping must leave the gradients alone: a coefficient
above 1 would scale them *up*), and below it (clipping binds: the norm must be the
global one, all ranks' shards together, not this rank's). SGD with momentum, because
Adam ignores a constant scale of its gradients and would hide a wrong coefficient.
The reference is single-process torch on the same global batch; the engines run on
two ranks with two micro-batches per step. The mutation suite (``tests/mutants``)
plants a coefficient above 1 and a norm without its all-reduce; both fail here.
"""
from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

import zerolab as zl
from engine_util import train_rank_slices
from zerolab.book.models import MLP, loss_fn, synthetic_batch

STEPS, MBS, GAS, N = 3, 4, 2, 2   # MBS rows per rank per micro-batch
LR = 0.05
CLIPS = {"never binds": 100.0, "always binds": 0.05}


def config(stage, clip):
    return {"optimizer": {"type": "SGD", "params": {"lr": LR, "momentum": 0.9}},
            "gradient_accumulation_steps": GAS, "gradient_clipping": clip,
            "zero_optimization": {"stage": stage, "reduce_bucket_size": 600}}


def train(cases):
    """Inside a rank: each (stage, clip) case with the engine; rank 0's final parameters."""
    rank, n = dist.get_rank(), dist.get_world_size()
    out = []
    for stage, clip in cases:
        model = MLP(depth=3, seed=4)
        engine = zl.initialize(model, config(stage, clip))
        norms = []
        engine.step = _recording(engine, norms)
        out.append((train_rank_slices(engine, model, STEPS, GAS, MBS, seed=11), norms))
    return out


def _recording(engine, norms):
    """engine.step, appending ``engine.last_grad_norm`` after each boundary (None between them)."""
    step = engine.step

    def recorded():
        step()
        if engine.micro_steps % GAS == 0:
            norms.append(engine.last_grad_norm)
    return recorded


def reference(clip):
    """Single process, torch.optim.SGD and clip_grad_norm_ on the whole global batch; the norms seen."""
    model = MLP(depth=3, seed=4)
    opt = torch.optim.SGD(model.parameters(), lr=LR, momentum=0.9)
    norms = []
    for step in range(STEPS):
        x, y = synthetic_batch(model, N * GAS * MBS, seed=11, step=step)
        opt.zero_grad()
        loss_fn(model(x), y).backward()
        norms.append(float(torch.nn.utils.clip_grad_norm_(model.parameters(), clip)))
        opt.step()
    return model.state_dict(), norms


@pytest.fixture(scope="module")
def results():
    cases = [(stage, clip) for stage in (0, 1, 2, 3) for clip in CLIPS.values()]
    return dict(zip(cases, zl.launch(train, world_size=N, args=(cases,), timeout=300, threads=1)[0]))


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
@pytest.mark.parametrize("which", list(CLIPS))
def test_clipping_equals_torch_clip_grad_norm(results, stage, which):
    clip = CLIPS[which]
    want, norms = reference(clip)
    # the threshold does what the case says, on every step
    assert all((n < clip) == (which == "never binds") for n in norms), (which, clip, norms)
    got, got_norms = results[(stage, clip)]
    # the norm the engine clipped by (engine.last_grad_norm, what get_global_grad_norm reports): torch's, each step
    torch.testing.assert_close(torch.tensor(got_norms, dtype=torch.float64), torch.tensor(norms, dtype=torch.float64),
                               rtol=1e-5, atol=0, msg=lambda m: f"stage {stage}: last_grad_norm {m}")
    assert got.keys() == want.keys()
    for name in want:
        torch.testing.assert_close(got[name], want[name], rtol=1e-5, atol=1e-6,
                                   msg=lambda m: f"stage {stage}, clipping {clip} ({which}) {name}: {m}")
