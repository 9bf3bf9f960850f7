"""A Hugging Face Trainer job at ZeRO stage 3, as a user fine-tunes a pretrained model: the model is built by
``from_pretrained`` of a ``save_pretrained`` folder after ``TrainingArguments(deepspeed=...)`` (so transformers
builds it under ``deepspeed.zero.Init``, partitioned, and loads the weights through ``GatheredParameters``),
trained, saved with ``trainer.save_model`` (``stage3_gather_16bit_weights_on_model_save``: the consolidated
weights), checkpointed every 2 steps and resumed. Nothing here names zerolab: run it under
``zerolab-deepspeed --num_gpus 2`` or, with DeepSpeed installed, ``torchrun --nproc-per-node 2``
(DS_ACCELERATOR=cpu).

``python hf_trainer_zero3_script.py PRETRAINED OUT [--resume]``: trains 4 steps from PRETRAINED, writing a
Trainer checkpoint at step 2 under OUT/run and the final model under OUT/final; rank 0 writes OUT/logs.json
(loss, learning rate, gradient norm per step). ``--resume``: a fresh Trainer resumes from OUT/run/checkpoint-2
and trains steps 3-4, writing OUT/resumed.json.
"""
import json
import os
import sys

from transformers import GlmForCausalLM, Trainer, TrainingArguments

from hf_script_common import Tokens, skip_deepspeed_shm_build

skip_deepspeed_shm_build()


CONFIG = {
    "train_micro_batch_size_per_gpu": "auto", "gradient_accumulation_steps": "auto", "gradient_clipping": 1.0,
    "zero_optimization": {"stage": 3, "stage3_gather_16bit_weights_on_model_save": True,
                          "stage3_param_persistence_threshold": 0, "overlap_comm": False},
    "optimizer": {"type": "AdamW", "params": {"lr": "auto", "betas": "auto", "eps": "auto", "weight_decay": "auto"}},
    "scheduler": {"type": "WarmupLR", "params": {"warmup_min_lr": "auto", "warmup_max_lr": "auto",
                                                 "warmup_num_steps": "auto"}},
    "fp16": {"enabled": "auto"}, "bf16": {"enabled": "auto"},
}


def main(pretrained, out, resume):
    args = TrainingArguments(output_dir=os.path.join(out, "run"), per_device_train_batch_size=2, max_steps=4,
                             learning_rate=1e-3, warmup_steps=2, weight_decay=0.01, logging_steps=1,
                             deepspeed=CONFIG, report_to=[], save_strategy="steps", save_steps=2,
                             use_cpu=True, dataloader_num_workers=0, seed=0, save_only_model=False)
    model = GlmForCausalLM.from_pretrained(pretrained)   # under zero.Init: built partitioned
    trainer = Trainer(model=model, args=args, train_dataset=Tokens())
    if resume:
        trainer.train(resume_from_checkpoint=os.path.join(out, "run", "checkpoint-2"))
    else:
        trainer.train()
        trainer.save_model(os.path.join(out, "final"))
    if int(os.environ.get("RANK", "0")) == 0:
        logs = [{k: log[k] for k in ("step", "loss", "learning_rate", "grad_norm")}
                for log in trainer.state.log_history if "loss" in log]
        with open(os.path.join(out, "resumed.json" if resume else "logs.json"), "w") as f:
            json.dump(logs, f)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], "--resume" in sys.argv)
