"""ZeRO-3 as DeepSpeed scripts use it: build under ``zero.Init``, set weights inside ``GatheredParameters``.

    DS_LIB=zerolab torchrun --nproc-per-node 2 examples/deepspeed/train_zero3.py
    DS_LIB=deepspeed DS_ACCELERATOR=cpu torchrun --nproc-per-node 2 examples/deepspeed/train_zero3.py

Under ``zero.Init`` no rank holds the whole model. Rank 0 writes the starting
weights (a fixed recipe, so both libraries start alike) inside
``GatheredParameters(..., modifier_rank=0)``; after training the 16-bit weights
are saved with ``save_16bit_model`` (gathered on rank 0).
"""
import argparse
import os

import torch
import torch.nn.functional as F
from torch import nn

if os.environ.get("DS_LIB", "zerolab") == "zerolab":
    import zerolab.deepspeed as deepspeed
else:
    import deepspeed

CONFIG = {"train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": 1, "gradient_clipping": 0.5,
          "optimizer": {"type": "Adam", "params": {"lr": 1e-2}}, "zero_optimization": {"stage": 3},
          "steps_per_print": 1000}


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed, self.out = nn.Linear(6, 24), nn.Linear(24, 3)

    def forward(self, x):
        return self.out(torch.relu(self.embed(x)))


def main(argv=None, steps=8):
    parser = argparse.ArgumentParser()
    parser.add_argument("--local_rank", type=int, default=-1)
    parser.add_argument("--out", default=None)
    parser.add_argument("--save_dir", default=None)
    args = parser.parse_args(argv)
    deepspeed.init_distributed(dist_backend="gloo")
    rank = deepspeed.comm.get_rank()
    with deepspeed.zero.Init(config_dict_or_path=CONFIG):
        model = Net()
    with deepspeed.zero.GatheredParameters(list(model.parameters()), modifier_rank=0):
        if rank == 0:
            g = torch.Generator().manual_seed(5)
            with torch.no_grad():
                for p in model.parameters():
                    p.copy_(0.3 * torch.randn(p.shape, generator=g))
    engine, _, _, _ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=CONFIG)
    g = torch.Generator().manual_seed(100 + rank)
    losses, norms = [], []
    for _ in range(steps):
        x = torch.randn(4, 6, generator=g)
        loss = F.cross_entropy(engine(x), (x[:, 0] > 0).long() + (x[:, 1] > 0).long())
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
        norms.append(float(engine.get_global_grad_norm()))
    with deepspeed.zero.GatheredParameters(list(engine.module.parameters())):
        params = {n: p.detach().clone() for n, p in engine.module.named_parameters()}
    if args.save_dir:
        engine.save_16bit_model(args.save_dir, "model.bin")
    result = {"rank": rank, "losses": losses, "grad_norms": norms, "params": params,
              "global_steps": engine.global_steps}
    if rank == 0:
        print("losses", " ".join(f"{x:.4f}" for x in losses))
    if args.out:
        torch.save(result, f"{args.out}.rank{rank}")
    return result


if __name__ == "__main__":
    main()
