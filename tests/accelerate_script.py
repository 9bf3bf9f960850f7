"""A plain Accelerate training loop with a DeepSpeed plugin (``Accelerator(deepspeed_plugin=...)``), the way
Accelerate's own examples write one: a torch optimizer and LR scheduler of the user's, ``accelerator.prepare``,
``accelerator.accumulate``, ``accelerator.backward``. Nothing here names zerolab: run it under
``zerolab-deepspeed --num_gpus 2`` or, with DeepSpeed installed, ``torchrun --nproc-per-node 2``
(DS_ACCELERATOR=cpu). ``python accelerate_script.py OUT [--stage N] [--gas N] [--dummy]``: rank 0 writes OUT (json):
per optimizer step the loss (averaged over the ranks), the learning rate and the gradient norm.
``--dummy``: the optimizer and scheduler come from the config (Accelerate's DummyOptim/DummyScheduler).
"""
import json
import os
import sys

import torch
from accelerate import Accelerator
from accelerate.utils import DeepSpeedPlugin, DummyOptim, DummyScheduler, InitProcessGroupKwargs
from torch.utils.data import DataLoader
from transformers import GPT2Config, GPT2LMHeadModel

from hf_script_common import Tokens, skip_deepspeed_shm_build

skip_deepspeed_shm_build()


def arg(name, default):
    return int(sys.argv[sys.argv.index(name) + 1]) if name in sys.argv else default


def main(out):
    os.environ.setdefault("ACCELERATE_USE_DEEPSPEED", "true")   # what `accelerate launch --use_deepspeed` sets
    stage, gas, dummy = arg("--stage", 2), arg("--gas", 1), "--dummy" in sys.argv
    config = {"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": gas, "gradient_clipping": 1.0,
              "zero_optimization": {"stage": stage}}
    if dummy:
        config["optimizer"] = {"type": "AdamW", "params": {"lr": 1e-3, "weight_decay": 0.01}}
        config["scheduler"] = {"type": "WarmupLR", "params": {"warmup_min_lr": 0, "warmup_max_lr": 1e-3,
                                                             "warmup_num_steps": 2, "warmup_type": "linear"}}
    accelerator = Accelerator(deepspeed_plugin=DeepSpeedPlugin(hf_ds_config=config),
                              gradient_accumulation_steps=gas,
                              kwargs_handlers=[InitProcessGroupKwargs(backend="gloo")])   # CPU ranks
    torch.manual_seed(0)
    model = GPT2LMHeadModel(GPT2Config(vocab_size=64, n_positions=16, n_embd=32, n_layer=2, n_head=4,
                                       resid_pdrop=0, embd_pdrop=0, attn_pdrop=0))
    if dummy:
        optimizer = DummyOptim(model.parameters())
        scheduler = DummyScheduler(optimizer)
    else:
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.01)
        scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: min(1.0, (s + 1) / 4))
    loader = DataLoader(Tokens(32), batch_size=2, shuffle=False)
    model, optimizer, loader, scheduler = accelerator.prepare(model, optimizer, loader, scheduler)
    logs, losses = [], []
    for batch in loader:
        with accelerator.accumulate(model):
            loss = model(**batch).loss
            accelerator.backward(loss)
            losses.append(accelerator.reduce(loss.detach(), "mean").item())
            optimizer.step()
            scheduler.step()
            optimizer.zero_grad()
        if accelerator.sync_gradients:
            norm = model.get_global_grad_norm()
            logs.append({"loss": sum(losses) / len(losses), "lr": scheduler.get_last_lr()[0],
                         "grad_norm": None if norm is None else float(norm)})
            losses = []
    if accelerator.is_main_process:
        with open(out, "w") as f:
            json.dump(logs, f)
    accelerator.end_training()


if __name__ == "__main__":
    main(sys.argv[1])
