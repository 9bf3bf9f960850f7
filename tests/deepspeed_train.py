"""A DeepSpeed training script, written against DeepSpeed's API only, in the style of its getting-started tutorial.

``train(deepspeed, argv)`` uses nothing but ``deepspeed.*`` names, so the same
function runs on real DeepSpeed (``import deepspeed``) and on zerolab
(``import zerolab.deepspeed as deepspeed``); tests/test_deepspeed_api.py runs it
both ways and compares what each returns: the batches each rank saw (sample
indices) and the parameters at the end.

Run as a script (under ``torchrun``) it writes rank r's result to ``OUT.rank{r}``:

    DS_ACCELERATOR=cpu torchrun --nproc-per-node 2 tests/deepspeed_train.py \
        --lib deepspeed --out /tmp/ds.pt --deepspeed_config ds.json
"""
from __future__ import annotations

import argparse
import importlib
import sys

import torch
import torch.nn.functional as F

from zerolab.runtime.group_exit import close_at_exit
from torch import nn
from torch.utils.data import TensorDataset

N_SAMPLES = 36     # per rank 18 with 2 ranks: micro-batches of 4 leave a short last one (2)


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(4, 8), nn.Linear(8, 2)

    def forward(self, x):
        return self.fc2(torch.tanh(self.fc1(x)))


def dataset(n: int = N_SAMPLES) -> TensorDataset:
    g = torch.Generator().manual_seed(1)
    x = torch.randn(n, 4, generator=g)
    return TensorDataset(torch.arange(n), x, torch.sin(x[:, :2]) + 0.1 * torch.randn(n, 2, generator=g))


def train(deepspeed, argv=(), epochs: int = 2, client_optimizer: bool = False, zero_init: bool = False,
          set_epoch: bool = True) -> dict:
    """The script: arguments, init_distributed, initialize with training_data, the loop, a gathered read.
    ``client_optimizer``: a torch.optim.AdamW object instead of the config's optimizer; ``zero_init``:
    build the model under ``zero.Init`` and load its weights inside ``GatheredParameters``."""
    parser = argparse.ArgumentParser(description="tiny regression")
    parser.add_argument("--local_rank", type=int, default=-1, help="set by the launcher")
    parser = deepspeed.add_config_arguments(parser)
    args = parser.parse_args(list(argv))
    deepspeed.init_distributed(dist_backend="gloo")
    close_at_exit()   # DeepSpeed leaves torch's gloo group alive at exit: it can abort (runtime/group_exit.py)

    torch.manual_seed(0)
    model = Net()
    initial = {k: v.detach().clone() for k, v in model.state_dict().items()}
    if zero_init:   # partitioned construction, then rank 0 writes the weights; leaving the block spreads them
        with deepspeed.zero.Init(config_dict_or_path=args.deepspeed_config):
            model = Net()
        with deepspeed.zero.GatheredParameters(list(model.parameters()), modifier_rank=0):
            if deepspeed.comm.get_rank() == 0:
                with torch.no_grad():
                    for n, p in model.named_parameters():
                        p.copy_(initial[n])
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.02, weight_decay=0.01) if client_optimizer else None
    engine, optimizer, loader, _ = deepspeed.initialize(args=args, model=model, optimizer=optimizer,
                                                        model_parameters=model.parameters(),
                                                        training_data=dataset())
    batches, losses = [], []
    for epoch in range(epochs):
        if set_epoch:
            loader.data_sampler.set_epoch(epoch)
        for idx, x, y in loader:
            batches.append(idx.tolist())
            loss = F.mse_loss(engine(x.to(engine.device)), y.to(engine.device))
            engine.backward(loss)
            engine.step()
            losses.append(loss.item())
    with deepspeed.zero.GatheredParameters(list(engine.module.parameters())):
        final = {n: p.detach().clone() for n, p in engine.module.named_parameters()}
    return {"rank": deepspeed.comm.get_rank(), "world_size": deepspeed.comm.get_world_size(),
            "initial": initial, "final": final, "batches": batches, "losses": losses,
            "lr": engine.get_lr(), "global_steps": engine.global_steps, "global_samples": engine.global_samples,
            "stage": engine.zero_optimization_stage(), "micro": engine.train_micro_batch_size_per_gpu(),
            "gas": engine.gradient_accumulation_steps(), "boundary": engine.is_gradient_accumulation_boundary(),
            "local_rank": engine.local_rank, "args_local_rank": args.local_rank, "device": str(engine.device),
            "loader_len": len(loader), "workers": loader.num_local_io_workers}


def main(argv):
    """``--lib deepspeed|zerolab.deepspeed --out PATH`` are the runner's; the rest is the script's."""
    runner = argparse.ArgumentParser()
    runner.add_argument("--lib", default="zerolab.deepspeed")
    runner.add_argument("--out", required=True)
    runner.add_argument("--client_optimizer", action="store_true")
    runner.add_argument("--zero_init", action="store_true")
    ours, rest = runner.parse_known_args(argv)
    deepspeed = importlib.import_module(ours.lib)
    if ours.lib == "deepspeed":   # skip a ~90 s JIT build of a shared-memory op used only for inference
        importlib.import_module("deepspeed.comm.torch")   # `import deepspeed.comm.torch as m` binds the real torch
        sys.modules["deepspeed.comm.torch"].build_shm_op = lambda *a, **k: None
    result = train(deepspeed, rest, client_optimizer=ours.client_optimizer, zero_init=ours.zero_init)
    torch.save(result, f"{ours.out}.rank{result['rank']}")


if __name__ == "__main__":
    main(sys.argv[1:])
