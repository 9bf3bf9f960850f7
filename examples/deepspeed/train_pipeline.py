"""A two-stage pipeline written for DeepSpeed: ``PipelineModule`` over a list of layers, ``engine.train_batch()``.

Run it under DeepSpeed, or under zerolab with the same command (``DS_LIB=zerolab``
selects ``import zerolab.deepspeed as deepspeed``; the script is otherwise the same):

    DS_LIB=zerolab torchrun --nproc-per-node 2 examples/deepspeed/train_pipeline.py
    DS_LIB=deepspeed DS_ACCELERATOR=cpu torchrun --nproc-per-node 2 examples/deepspeed/train_pipeline.py

The layers are cut by trainable-parameter count (DeepSpeed's default
``partition_method="parameters"``): the wide first layer gets a stage to itself.
No gradient clipping here: with clipping, DeepSpeed's pipeline engine at ZeRO-0
(fp32) computes the clipping norm from the first stage's gradients only (its
model-parallel rank 0), while zerolab clips by the norm over every stage.
Each ``train_batch()`` takes ``gradient_accumulation_steps`` micro-batches from the
engine's own loader over ``training_data`` and returns their mean loss.
"""
import argparse
import os

import torch
from torch import nn

if os.environ.get("DS_LIB", "zerolab") == "zerolab":
    import zerolab.deepspeed as deepspeed
else:
    import deepspeed

CONFIG = {"train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": 4, "gradient_clipping": 0.0,
          "optimizer": {"type": "AdamW", "params": {"lr": 0.01, "weight_decay": 0.0}},
          "zero_optimization": {"stage": 0}, "steps_per_print": 1000}


def make_layers():
    """Six modules, two without parameters (Tanh); the 16x64 layer dominates the parameter count."""
    return [nn.Linear(16, 64), nn.Tanh(), nn.Linear(64, 8), nn.Tanh(), nn.Linear(8, 8), nn.Linear(8, 1)]


def dataset(n=128):
    g = torch.Generator().manual_seed(3)
    x = torch.randn(n, 16, generator=g)
    return torch.utils.data.TensorDataset(x, x[:, :4].sum(1, keepdim=True).sin())


def main(argv=None, steps=6):
    parser = argparse.ArgumentParser()
    parser.add_argument("--local_rank", type=int, default=-1)
    parser.add_argument("--out", default=None, help="save this rank's losses and parameters here")
    args = parser.parse_args(argv)
    deepspeed.init_distributed(dist_backend="gloo")
    torch.manual_seed(0)
    model = deepspeed.pipe.PipelineModule(layers=make_layers(), num_stages=2, loss_fn=nn.MSELoss(),
                                          partition_method="parameters")
    engine, _, _, _ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=CONFIG,
                                           training_data=dataset())
    losses = [engine.train_batch().item() for _ in range(steps)]
    held_out = iter(deepspeed.utils.RepeatingLoader(torch.utils.data.DataLoader(dataset(32), batch_size=4)))
    eval_loss = engine.eval_batch(held_out).item()
    rank = deepspeed.comm.get_rank()
    result = {"rank": rank, "losses": losses, "eval_loss": eval_loss, "parts": [int(p) for p in model.parts],
              "grad_norm": engine.get_global_grad_norm(), "global_samples": engine.global_samples,
              "params": {n: p.detach().clone() for n, p in model.named_parameters()}}
    if rank == 0:
        print("losses", " ".join(f"{x:.4f}" for x in losses), "eval", f"{eval_loss:.4f}")
    if args.out:
        torch.save(result, f"{args.out}.rank{rank}")
    return result


if __name__ == "__main__":
    main()
