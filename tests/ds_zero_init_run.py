"""A DeepSpeed script that builds its model under ``deepspeed.zero.Init`` and edits it before ``initialize``.

``run(deepspeed)`` uses only ``deepspeed.*`` names, so it runs on real DeepSpeed
(``import deepspeed``) and on zerolab (``import zerolab.deepspeed as deepspeed``);
tests/test_ds_zero_init.py runs it both ways. The model's constructor sets values
no ``reset_parameters`` gives (a bias set by ``nn.init.constant_``, a weight copied
from a fixed tensor, a custom parameter, a buffer computed from arguments); after
the block, rank 1's ``GatheredParameters(..., modifier_rank=1)`` edit must reach
every rank, and an edit under ``modifier_rank=None`` must be dropped.

As a script (under ``torchrun``) it writes rank r's result to ``OUT.rank{r}``:

    DS_ACCELERATOR=cpu torchrun --nproc-per-node 2 tests/ds_zero_init_run.py --lib deepspeed --out /tmp/z.pt
"""
from __future__ import annotations

import argparse
import importlib
import sys

import torch
import torch.nn.functional as F

from zerolab.runtime.group_exit import close_at_exit
from torch import nn

D, STEPS, LR, WD, CLIP = 6, 3, 1e-2, 0.01, 1.0
CONFIG = {"train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": 1, "gradient_clipping": CLIP,
          "optimizer": {"type": "AdamW", "params": {"lr": LR, "weight_decay": WD}},
          "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0}}
FIXED = torch.linspace(-1.0, 1.0, D * D).view(D, D)   # the weight the constructor copies in


class Fixed(nn.Linear):
    """A Linear whose own constructor sets its values: the weight copied from a fixed tensor, the bias
    by ``nn.init.constant_`` (DeepSpeed partitions a module when its own ``__init__`` returns)."""

    def __init__(self, d: int):
        super().__init__(d, d)
        nn.init.constant_(self.bias, 0.1)
        with torch.no_grad():
            self.weight.copy_(FIXED[:d, :d])


class Custom(nn.Module):
    def __init__(self, d: int = D):
        super().__init__()
        self.inp = Fixed(d)
        self.mid = nn.Linear(d, d)
        self.scale = nn.Parameter(torch.full((d,), 0.5))   # a custom parameter, no reset_parameters
        self.register_buffer("freq", torch.arange(d, dtype=torch.float32) / d)
        self.out = nn.Linear(d, 3)

    def forward(self, x):
        h = torch.tanh(self.inp(x) * self.scale + self.freq)
        return self.out(torch.tanh(self.mid(h)))


def data(step: int, rank: int):
    g = torch.Generator().manual_seed(10 * step + rank)
    return torch.randn(4, D, generator=g), torch.randint(0, 3, (4,), generator=g)


MID, DROPPED = 0.3, 9.0   # rank 1's kept edit of mid.weight; everyone's dropped edit of out.bias


def run(deepspeed, seed_by_rank: bool = False) -> dict:
    """Build under zero.Init, read and edit before initialize, train STEPS steps at ZeRO-3."""
    deepspeed.init_distributed(dist_backend="gloo")
    close_at_exit()   # DeepSpeed leaves torch's gloo group alive at exit: it can abort (runtime/group_exit.py)
    rank = deepspeed.comm.get_rank()
    torch.manual_seed(100 + rank if seed_by_rank else 100)   # rank 0's values are broadcast at construction
    with deepspeed.zero.Init(config_dict_or_path=CONFIG):
        model = Custom()
    params = list(model.parameters())
    placeholders = {n: p.numel() == 0 or p.is_meta for n, p in model.named_parameters()}
    # a read: every rank sees the whole values, whatever order it lists the parameters in
    with deepspeed.zero.GatheredParameters(params if rank == 0 else params[::-1]):
        built = {n: p.detach().clone() for n, p in model.named_parameters()}
    with deepspeed.zero.GatheredParameters(model.mid.weight, modifier_rank=1), torch.no_grad():
        model.mid.weight.fill_(MID if rank == 1 else -5.0)   # rank 1's edit is the one kept (not rank 0's)
    with deepspeed.zero.GatheredParameters([model.out.bias]), torch.no_grad():
        model.out.bias.fill_(DROPPED)   # modifier_rank=None: read-only, dropped on exit
    engine, _, _, _ = deepspeed.initialize(model=model, config=CONFIG, model_parameters=model.parameters())
    with deepspeed.zero.GatheredParameters(list(engine.module.parameters())):
        start = {n: p.detach().clone() for n, p in engine.module.named_parameters()}
    losses = []
    for step in range(STEPS):
        x, y = data(step, rank)
        loss = F.cross_entropy(engine(x), y)
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
    with deepspeed.zero.GatheredParameters(list(engine.module.parameters())):
        final = {n: p.detach().clone() for n, p in engine.module.named_parameters()}
    return {"rank": rank, "placeholders": placeholders, "built": built, "start": start, "final": final,
            "losses": losses, "freq": engine.module.freq.detach().clone()}


def reference(world: int = 2) -> dict:
    """One process: the model built plainly (seed 100), rank 1's edit, AdamW over every rank's batch."""
    torch.manual_seed(100)
    model = Custom()
    built = {n: p.detach().clone() for n, p in model.named_parameters()}
    with torch.no_grad():
        model.mid.weight.fill_(MID)
    start = {n: p.detach().clone() for n, p in model.named_parameters()}
    opt = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=WD)
    for step in range(STEPS):
        opt.zero_grad()
        sum(F.cross_entropy(model(x), y) for x, y in (data(step, r) for r in range(world))).div(world).backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP)
        opt.step()
    return {"built": built, "start": start, "final": {n: p.detach().clone() for n, p in model.named_parameters()},
            "freq": model.freq}


def main(argv):
    runner = argparse.ArgumentParser()
    runner.add_argument("--lib", default="zerolab.deepspeed")
    runner.add_argument("--out", required=True)
    ours = runner.parse_args(argv)
    deepspeed = importlib.import_module(ours.lib)
    if ours.lib == "deepspeed":   # skip a ~90 s JIT build of a shared-memory op used only for inference
        importlib.import_module("deepspeed.comm.torch")
        sys.modules["deepspeed.comm.torch"].build_shm_op = lambda *a, **k: None
    result = run(deepspeed)
    torch.save(result, f"{ours.out}.rank{result['rank']}")


if __name__ == "__main__":
    main(sys.argv[1:])
