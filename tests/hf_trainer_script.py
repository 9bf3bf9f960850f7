"""A Hugging Face Trainer job with a DeepSpeed config, as the ChatGLM2-6B fine-tuning recipe runs one
(``--deepspeed deepspeed.json``: ZeRO-2, optimizer offloaded to the CPU, "auto" values, clipping 1.0), on a tiny
``GlmForCausalLM`` (random weights, no download). Nothing here names zerolab: run it under
``zerolab-deepspeed --num_gpus 2`` or, with DeepSpeed installed, ``torchrun --nproc-per-node 2``
(DS_ACCELERATOR=cpu). ``python hf_trainer_script.py OUT [--no-auto-batch]``: rank 0 writes OUT (json) with
each logged step's loss, learning rate and gradient norm; ``--gas2``: two micro-batches a step. ``--no-auto-batch`` leaves ``train_batch_size``
out of the config: DeepSpeed on a CPU fails with it "auto" (Trainer fills it for one process).
"""
import json
import os
import resource
import sys

import torch
from transformers import GlmConfig, GlmForCausalLM, Trainer, TrainingArguments

from hf_script_common import Tokens, skip_deepspeed_shm_build

skip_deepspeed_shm_build()


CONFIG = {   # the recipe's deepspeed.json, at stage 2 with the optimizer on the CPU
    "train_batch_size": "auto", "train_micro_batch_size_per_gpu": "auto", "gradient_accumulation_steps": "auto",
    "gradient_clipping": 1.0,
    "zero_optimization": {"stage": 2, "offload_optimizer": {"device": "cpu"}, "allgather_partitions": True,
                          "allgather_bucket_size": 5e8, "reduce_scatter": True, "reduce_bucket_size": 5e8,
                          "overlap_comm": False, "contiguous_gradients": True},
    "optimizer": {"type": "AdamW", "params": {"lr": "auto", "betas": "auto", "eps": "auto", "weight_decay": "auto"}},
    "scheduler": {"type": "WarmupLR", "params": {"warmup_min_lr": "auto", "warmup_max_lr": "auto",
                                                 "warmup_num_steps": "auto"}},
    "fp16": {"enabled": "auto"}, "bf16": {"enabled": "auto"},
}


def main(out, auto_batch=True, gas=1):
    cfg = dict(CONFIG)
    if not auto_batch:
        del cfg["train_batch_size"]
    torch.manual_seed(0)
    model = GlmForCausalLM(GlmConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                     num_attention_heads=4, num_key_value_heads=2, head_dim=8, pad_token_id=0,
                                     eos_token_id=1, bos_token_id=1))
    args = TrainingArguments(output_dir=os.path.dirname(out) or ".", per_device_train_batch_size=2, max_steps=3,
                             learning_rate=1e-3, warmup_steps=2, gradient_accumulation_steps=gas, weight_decay=0.01, logging_steps=1, deepspeed=cfg,
                             report_to=[], save_strategy="no", use_cpu=True, dataloader_num_workers=0, seed=0)
    trainer = Trainer(model=model, args=args, train_dataset=Tokens())
    trainer.train()
    rank = int(os.environ.get("RANK", "0"))
    engine = trainer.model_wrapped   # the DeepSpeed engine: its memory per rank (zerolab's only), the peak RSS (both)
    mem = {"peak_rss": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024}
    if hasattr(engine, "memory"):
        report = engine.memory()
        mem.update(params=report.params, grads=report.grads, optimizer=report.optimizer, total=report.total)
    with open(f"{out}.rank{rank}.mem", "w") as f:
        json.dump(mem, f)
    if rank == 0:
        logs = [{k: log[k] for k in ("loss", "learning_rate", "grad_norm")} for log in trainer.state.log_history
                if "loss" in log]
        with open(out, "w") as f:
            json.dump(logs, f)


if __name__ == "__main__":
    main(sys.argv[1], "--no-auto-batch" not in sys.argv, 2 if "--gas2" in sys.argv else 1)
