"""DeepSpeed's getting-started loop on a tiny MLP and random data: ``initialize``, ``engine(x)``, ``backward``, ``step``.

    DS_LIB=zerolab torchrun --nproc-per-node 2 examples/deepspeed/train_mlp.py --stage 2
    DS_LIB=deepspeed DS_ACCELERATOR=cpu torchrun --nproc-per-node 2 examples/deepspeed/train_mlp.py --stage 2

``DS_LIB`` selects the one line that differs (which ``deepspeed`` is imported).
The loader comes from ``deepspeed.initialize(training_data=...)``: each rank gets
its share of the samples, shuffled by the epoch the script sets.
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


def config(stage):
    return {"train_micro_batch_size_per_gpu": 8, "gradient_accumulation_steps": 2, "gradient_clipping": 1.0,
            "optimizer": {"type": "AdamW", "params": {"lr": 3e-3, "weight_decay": 0.01}},
            "scheduler": {"type": "WarmupLR", "params": {"warmup_max_lr": 3e-3, "warmup_num_steps": 3,
                                                         "warmup_type": "linear"}},
            "zero_optimization": {"stage": stage}, "steps_per_print": 1000}


def dataset(n=96):
    g = torch.Generator().manual_seed(0)
    x = torch.randn(n, 10, generator=g)
    return torch.utils.data.TensorDataset(x, (x[:, :3] @ torch.tensor([1.0, -2.0, 0.5])).unsqueeze(1).tanh())


def main(argv=None, epochs=2):
    parser = argparse.ArgumentParser()
    parser.add_argument("--local_rank", type=int, default=-1)
    parser.add_argument("--stage", type=int, default=2)
    parser.add_argument("--out", default=None)
    args = parser.parse_args(argv)
    deepspeed.init_distributed(dist_backend="gloo")
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(10, 32), nn.ReLU(), nn.Linear(32, 1))
    engine, optimizer, loader, scheduler = deepspeed.initialize(model=model, model_parameters=model.parameters(),
                                                                config=config(args.stage), training_data=dataset())
    losses, norms = [], []
    for epoch in range(epochs):
        loader.data_sampler.set_epoch(epoch)
        for x, y in loader:
            loss = F.mse_loss(engine(x.to(engine.device)), y.to(engine.device))
            engine.backward(loss)
            boundary = engine.is_gradient_accumulation_boundary()
            engine.step()
            losses.append(loss.item())
            assert engine.was_step_applied() == boundary   # the parameters changed at the boundary only
            if boundary:
                norms.append(engine.get_global_grad_norm())
    with deepspeed.zero.GatheredParameters(list(engine.module.parameters())):
        params = {n: p.detach().clone() for n, p in engine.module.named_parameters()}
    rank = deepspeed.comm.get_rank()
    result = {"rank": rank, "losses": losses, "grad_norms": [None if v is None else float(v) for v in norms],
              "params": params, "global_steps": engine.global_steps, "global_samples": engine.global_samples,
              "lr": scheduler.get_lr(), "optimizer_name": engine.optimizer_name()}
    if rank == 0:
        print("losses", " ".join(f"{x:.4f}" for x in losses[::4]))
    if args.out:
        torch.save(result, f"{args.out}.rank{rank}")
    return result


if __name__ == "__main__":
    main()
