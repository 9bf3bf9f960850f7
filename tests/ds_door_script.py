"""A DeepSpeed script written against ``import deepspeed`` only: the calls a PyTorch-style loop makes.

Run unchanged under real DeepSpeed (``torchrun ... tests/ds_door_script.py``, DS_ACCELERATOR=cpu) and under
zerolab (``zerolab-deepspeed --num_gpus 2 tests/ds_door_script.py``, where ``import deepspeed`` is zerolab's).
Each case builds a small model and trains 3 optimizer steps; rank r writes ``OUT.rank{r}`` (torch.save):
per case the losses, each step's ``get_lr()`` and ``get_global_grad_norm()``, the final parameters.

Cases: ``groups_sched`` (two parameter groups with their own lr, the config's WarmupLR), ``client_lambda`` (a
torch AdamW with two groups and a LambdaLR object), ``callable_linear`` (the config's "Adam" with weight decay
and a callable building a linear-warmup LambdaLR on the optimizer: Accelerate's DummyScheduler), ``backward_sS``
(``loss.backward()`` then ``engine.step()`` at stage S, gradient accumulation 2; ``engine_backward_sS`` the same
with ``engine.backward(loss)``; stage 0 in bf16, as DeepSpeed refuses it in fp32) and ``cifar_sS_P`` (an
accelerator-using loop: a small CNN on random images, "Adam" with weight decay, stage S, precision P, ending in
``engine.destroy()``).
"""
import argparse
import importlib.metadata
import importlib.util
import sys

import deepspeed
import torch
import torch.nn.functional as F
from deepspeed.accelerator import get_accelerator
from torch import nn

if "zerolab" not in (deepspeed.__version__ or ""):   # real DeepSpeed: skip a ~90 s JIT build used only for inference
    import deepspeed.comm.torch  # noqa: F401
    sys.modules["deepspeed.comm.torch"].build_shm_op = lambda *a, **k: None
    from zerolab.runtime.group_exit import close_at_exit
    close_at_exit()

STEPS = 3


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(4, 8), nn.Linear(8, 2)

    def forward(self, x):
        return self.fc2(torch.tanh(self.fc1(x)))


class CNN(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv, self.fc = nn.Conv2d(3, 4, 3), nn.Linear(4 * 6 * 6, 10)

    def forward(self, x):
        return self.fc(F.relu(self.conv(x)).flatten(1))


def config(stage, gas=1, precision="fp32", optimizer=None, scheduler=None):
    cfg = {"train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": gas,
           "zero_optimization": {"stage": stage}, "steps_per_print": 10**6}
    if precision == "bf16":
        cfg["bf16"] = {"enabled": True}
    if optimizer:
        cfg["optimizer"] = optimizer
    if scheduler:
        cfg["scheduler"] = scheduler
    return cfg


def batches(rank, n, shape=(4,), out=2, classes=False):
    g = torch.Generator().manual_seed(100 + rank)
    for _ in range(n):
        x = torch.randn(4, *shape, generator=g)
        y = torch.randint(0, 10, (4,), generator=g) if classes else torch.randn(4, out, generator=g)
        yield x, y


def finish(engine, losses, lrs, norms):
    with deepspeed.zero.GatheredParameters(list(engine.module.parameters())):
        final = {k: p.detach().float().clone() for k, p in engine.module.named_parameters()}
    return {"losses": losses, "lrs": lrs, "norms": norms, "final": final}


def train(engine, rank, gas=1, torch_backward=False, cnn=False):
    losses, lrs, norms = [], [], []
    dev = get_accelerator().current_device_name()
    for x, y in batches(rank, STEPS * gas, (3, 8, 8) if cnn else (4,), classes=cnn):
        x, y = x.to(dev), y.to(dev)
        if engine.bfloat16_enabled():
            x = x.to(torch.bfloat16)
        out = engine(x)
        loss = F.cross_entropy(out.float(), y) if cnn else F.mse_loss(out.float(), y)
        if engine.is_gradient_accumulation_boundary():
            lrs.append(engine.get_lr())
        if torch_backward:
            loss.backward()
        else:
            engine.backward(loss)
        engine.step()
        losses.append(loss.item())
        if len(losses) % gas == 0:   # after an optimizer step
            norm = engine.get_global_grad_norm()
            norms.append(None if norm is None else float(norm))
    return losses, lrs, norms


def case(name, rank):
    torch.manual_seed(0)
    model = Net()
    adamw = {"type": "AdamW", "params": {"lr": 0.01, "weight_decay": 0.01}}
    groups = [{"params": model.fc1.parameters(), "lr": 0.01}, {"params": model.fc2.parameters(), "lr": 0.005}]
    if name == "groups_sched":
        sched = {"type": "WarmupLR", "params": {"warmup_min_lr": 0.0, "warmup_max_lr": 0.01, "warmup_num_steps": 4,
                                                "warmup_type": "linear"}}
        engine, *_ = deepspeed.initialize(model=model, model_parameters=groups,
                                          config=config(2, optimizer=adamw, scheduler=sched))
        return finish(engine, *train(engine, rank))
    if name == "client_lambda":
        opt = torch.optim.AdamW([{"params": model.fc1.parameters()},
                                 {"params": model.fc2.parameters(), "lr": 0.005}], lr=0.01, weight_decay=0.01)
        sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: (s + 1) / 4)
        engine, _, _, lr_scheduler = deepspeed.initialize(model=model, optimizer=opt, lr_scheduler=sched,
                                                          config=config(1))
        assert lr_scheduler is sched
        return finish(engine, *train(engine, rank))
    if name == "callable_linear":
        adam = {"type": "Adam", "params": {"lr": 0.02, "weight_decay": 0.1}}

        def linear_warmup(optimizer, warmup=2, total=5):   # transformers.get_linear_schedule_with_warmup's rule
            return torch.optim.lr_scheduler.LambdaLR(
                optimizer, lambda s: s / warmup if s < warmup else max(0.0, (total - s) / (total - warmup)))

        engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(),
                                          lr_scheduler=linear_warmup, config=config(2, optimizer=adam))
        return finish(engine, *train(engine, rank))
    if name.startswith(("backward_s", "engine_backward_s")):   # loss.backward() | engine.backward(loss)
        stage = int(name[-1])
        engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(),
                                          config=config(stage, gas=2, optimizer=adamw, precision="bf16"
                                                        if stage == 0 else "fp32"))
        return finish(engine, *train(engine, rank, gas=2, torch_backward=name.startswith("backward")))
    if name.startswith("cifar_s"):
        stage, precision = int(name[7]), name.split("_")[-1]
        torch.manual_seed(0)
        net = CNN()
        adam = {"type": "Adam", "params": {"lr": 0.01, "weight_decay": 0.1}}
        engine, *_ = deepspeed.initialize(model=net, model_parameters=net.parameters(),
                                          config=config(stage, precision=precision, optimizer=adam))
        out = finish(engine, *train(engine, rank, cnn=True))
        engine.destroy()
        return out
    raise ValueError(name)


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--out", required=True)
    p.add_argument("--cases", default="groups_sched,client_lambda,callable_linear")
    p.add_argument("--local_rank", type=int, default=-1)
    args = p.parse_args()
    deepspeed.init_distributed(dist_backend="gloo")
    rank = deepspeed.comm.get_rank()
    acc = get_accelerator()
    result = {"version": deepspeed.__version__, "metadata_version": importlib.metadata.version("deepspeed"),
              "spec_origin": importlib.util.find_spec("deepspeed").origin,
              "accelerator": {"device_name": acc.device_name(), "current_device_name": acc.current_device_name(),
                              "backend": acc.communication_backend_name(), "bf16": acc.is_bf16_supported(),
                              "current_device": str(acc.current_device())}}
    for name in args.cases.split(","):
        result[name] = case(name, rank)
    torch.save(result, f"{args.out}.rank{rank}")


if __name__ == "__main__":
    main()
