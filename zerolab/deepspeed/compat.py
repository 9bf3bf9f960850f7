"""What of DeepSpeed 0.19.8's API ``zerolab.deepspeed`` answers: one table, the README's is generated from it.

``TABLE`` rows are ``(DeepSpeed name, status, why)``: ``supported`` (DeepSpeed's
signature and behaviour; tests compare them where DeepSpeed is installed),
``differs`` (runs, with the difference said), ``refused`` (raises an error
naming the call and what to use instead). ``markdown()`` is the README section;
``tests/test_deepspeed_compat.py`` checks that the README holds exactly it and
that every name marked supported or differs exists here.
"""
from __future__ import annotations

SUPPORTED, DIFFERS, REFUSED = "supported", "differs", "refused"

TABLE = [
    ("deepspeed.initialize", SUPPORTED,
     "DeepSpeed's arguments and its four return values (engine, optimizer, loader, scheduler); config from "
     "config= or --deepspeed_config"),
    ("deepspeed.initialize(optimizer=...)", DIFFERS,
     "an unused torch.optim Adam, AdamW or SGD (or a callable making one) is read into the config; other "
     "optimizers are refused: zerolab's engines keep the optimizer state themselves, sharded"),
    ("deepspeed.initialize(lr_scheduler=...)", SUPPORTED,
     "a torch scheduler on the client optimizer, or a callable given the optimizer (Accelerate's DummyScheduler, "
     "the Trainer's linear warmup); stepped after each applied optimizer step; each group's lr read from the "
     "optimizer's param_groups (with the config's optimizer, from a never-stepped torch optimizer of its kind)"),
    ("config \"optimizer\": {\"type\": \"Adam\"}", SUPPORTED,
     "AdamW (decoupled weight decay) unless \"adam_w_mode\": false, as DeepSpeed; in zl.initialize too"),
    ("config \"scheduler\" with parameter groups of different lr", SUPPORTED,
     "every group runs at the schedule's lr, as DeepSpeed's WarmupLR/WarmupDecayLR set it (zl.initialize keeps "
     "scaling each group's own lr by the schedule)"),
    ("the config's notes (keys accepted and ignored, meanings that differ)", DIFFERS,
     "warned once by initialize on rank 0 (UserWarning); DeepSpeed logs its own messages"),
    ("deepspeed.initialize(mpu=..., mesh_param=...)", REFUSED,
     "Megatron-style model-parallel units; zerolab's tensor and pipeline parallelism is zerolab.parallel"),
    ("deepspeed.initialize(training_data=...)", SUPPORTED,
     "DeepSpeed's batch order (DistributedSampler, shuffled with random seed 0, padded) and its 2 loader workers, "
     "inside zl.launch too"),
    ("bf16 or fp16 over a model built in fp32", DIFFERS,
     "the fp32 master starts from the model's fp32 values; DeepSpeed casts the module to 16 bits first and "
     "fills its master from the rounded weights (Mamba's A_log and dt_proj.bias lose up to 1.6e-2)"),
    ("deepspeed.init_distributed", DIFFERS,
     "without a launcher's environment a one-rank group starts (DeepSpeed tries MPI discovery)"),
    ("deepspeed.add_config_arguments", SUPPORTED, "the same four arguments, defaults and group"),
    ("deepspeed.comm.get_rank / get_world_size / get_local_rank / barrier / all_reduce / broadcast / all_gather",
     SUPPORTED, "torch.distributed underneath, as in DeepSpeed"),
    ("deepspeed.zero.Init", DIFFERS,
     "zl.zero_init(): the constructor's values, broadcast from rank 0, each rank keeping its piece; a module "
     "is partitioned when attached to its parent, not when its own __init__ returns (a value set in between is "
     "kept here, lost in DeepSpeed); dtype cast after construction; module=, remote_device= and process groups "
     "are refused"),
    ("deepspeed.zero.GatheredParameters", DIFFERS,
     "before initialize as DeepSpeed (whole values from the pieces; modifier_rank's edits kept, None's dropped); "
     "an edit made with modifier_rank after initialize is kept (DeepSpeed's next step overwrites it from its "
     "fp32 partition)"),
    ("deepspeed.utils.RepeatingLoader", SUPPORTED, "restarts the loader when it runs out"),
    ("deepspeed.utils.set_z3_leaf_modules / unset_z3_leaf_modules / get_z3_leaf_modules", SUPPORTED,
     "the marked module is one ZeRO-3 unit, gathered whole on every rank (an MoE block whose experts may get "
     "no tokens); zerolab's own default units already keep experts inside their block"),
    ("deepspeed.pipe.PipelineModule", DIFFERS,
     "partition_method parameters, uniform, type:REGEX as DeepSpeed cuts; ranks placed DP-outermost (DeepSpeed: "
     "pipeline-outermost; the same when dp or pp is 1); one tensor between stages; ZeRO-0/1 only; clipping uses "
     "the norm over every stage (DeepSpeed's ZeRO-0 fp32 pipeline counts only model-parallel rank 0's gradients, "
     "the first stage's; measured with gradient_clipping 1.0 on examples/deepspeed/train_pipeline.py: the losses "
     "part from the third step, by up to 2.7e-3)"),
    ("deepspeed.pipe.LayerSpec", SUPPORTED, "built only on the stage that holds it"),
    ("deepspeed.pipe.TiedLayerSpec", DIFFERS,
     "a key on one stage, or on the first and the last (the gradients summed over those two, the last copy "
     "starting from the first's, as DeepSpeed); a key on a stage in between is refused"),
    ("PipelineModule(topology=, seed_layers=True, activation_checkpoint_interval>0, partition_method='profile')",
     REFUSED, "not implemented (DeepSpeed refuses 'profile' too)"),
    ("engine(x) / engine.backward(loss) / engine.step()", SUPPORTED,
     "backward scales by 1/gradient_accumulation_steps; the step happens at the boundary"),
    ("loss.backward() then engine.step()", DIFFERS,
     "as DeepSpeed 0.19: hooks on engine(x)'s outputs start the engine's backward and divide by "
     "gradient_accumulation_steps; stages 0-3 (DeepSpeed refuses fp32 stage 0); fp16 refused (the loss scale "
     "needs engine.backward)"),
    ("engine.destroy", SUPPORTED, "the engine's gradient hooks removed"),
    ("deepspeed.accelerator.get_accelerator / set_accelerator", DIFFERS,
     "CPU or the rank's CUDA device: device_name, set_device, current_device(_name), communication_backend_name, "
     "is_bf16/fp16_supported, manual_seed, memory queries, synchronize...; only zerolab's two accelerators"),
    ("deepspeed.get_accelerator", SUPPORTED, "the same object"),
    ("deepspeed.utils.logger / log_dist", SUPPORTED, "the logger named DeepSpeed, INFO, to stdout"),
    ("deepspeed.moe.utils.split_params_into_different_moe_groups_for_optimizer", DIFFERS,
     "groups come back as DeepSpeed returns them for a model without MoE layers; expert-parallel parameters "
     "refused"),
    ("deepspeed.moe.layer.MoE", REFUSED,
     "DeepSpeed's layer (its random token selection, allreduce=False parameters) is not served; expert "
     "parallelism itself is zerolab.parallel.MoELayer (top-k with capacity, the balancing loss, all-to-all over "
     "the mesh's ep group), beside a zl.initialize engine"),
    ("engine.zero_gather_16bit_weights_on_model_save / _zero3_consolidated_16bit_state_dict", SUPPORTED,
     "what Accelerate and Trainer.save_model call at ZeRO-3: the config's flag, and the whole model in the "
     "compute dtype on rank 0, gathered a unit at a time"),
    ("bf16 at ZeRO stage 0", DIFFERS,
     "DeepSpeed 0.19.8 runs its FP16_Optimizer path there (bf16 gradients all-reduced, a dynamic loss scale), "
     "and its trajectory leaves its own stages 1-3 after one step (CIFAR-style test: loss 2.284 against 2.320); "
     "zerolab's stage 0 follows DeepSpeed's stages 1-3"),
    ("engine.config", SUPPORTED, "the user's config dict, as DeepSpeed keeps it (transformers reads it)"),
    ("deepspeed.runtime.zero.partition_parameters", DIFFERS,
     "the module path transformers reaches into under ZeRO-3; Init is zero.Init, which casts parameters when it "
     "partitions them and wraps no tensor constructor, so the wrapper transformers swaps has nothing to change"),
    ("Hugging Face Trainer with a DeepSpeed config (stages 2 and 3, from_pretrained under zero.Init, save_model, "
     "resume)", SUPPORTED,
     "runs unchanged under zerolab-deepspeed; equal to DeepSpeed step for step (tests/test_hf_trainer_door.py, "
     "test_hf_trainer_zero3.py)"),
    ("Accelerate loop with DeepSpeedPlugin (client optimizer, or DummyOptim/DummyScheduler)", SUPPORTED,
     "runs unchanged under zerolab-deepspeed; equal to DeepSpeed step for step (tests/test_accelerate_door.py); "
     "on CPU ranks Accelerate needs InitProcessGroupKwargs(backend='gloo') with either library"),
    ("deepspeed.ops.adam.FusedAdam / DeepSpeedCPUAdam", DIFFERS,
     "accepted as initialize(optimizer=...) (Accelerate's offload path builds DeepSpeedCPUAdam) and read into "
     "the config; their own step() is refused: the engine updates"),
    ("deepspeed.__version__ and importlib.metadata.version(\"deepspeed\") under zerolab-deepspeed", DIFFERS,
     "0.19.8+zerolab: the release followed, marked as zerolab's"),
    ("engine.backward(retain_graph=True), engine.step(lr_kwargs=...)", REFUSED,
     "zerolab's backward frees the graph; the schedule sets the learning rate"),
    ("engine.backward(loss, scale_wrt_gas=False), engine.set_gradient_accumulation_boundary", SUPPORTED,
     "as Hugging Face Trainer and Accelerate drive DeepSpeed: the caller divides the loss and calls step() at "
     "the boundary only; a boundary the config's gradient_accumulation_steps disagrees with is refused"),
    ("engine.train_batch(data_iter=None)", SUPPORTED,
     "PipelineModule engines: gradient_accumulation_steps micro-batches from data_iter or the engine's loader, "
     "one step; returns the mean loss over micro-batches and DP ranks"),
    ("engine.eval_batch(data_iter, return_logits=False, ...)", SUPPORTED,
     "forwards only; the mean loss on every rank; reduce_output 'avg' or None (DeepSpeed allows no others)"),
    ("engine.get_global_grad_norm", SUPPORTED,
     "the last step's norm before clipping, as DeepSpeed's ZeRO optimizers report it; None at fp32 ZeRO-0, "
     "as DeepSpeed"),
    ("engine.get_lr / get_mom", SUPPORTED, "lists, one entry per parameter group"),
    ("engine.was_step_applied / optimizer_name / save_fp16_model", SUPPORTED, "as DeepSpeed answers them"),
    ("engine.get_batch_info", DIFFERS,
     "returns the three numbers (train_batch_size, micro-batch, accumulation steps); DeepSpeed 0.19.8 returns "
     "the three bound methods, not their values, though its docstring promises the numbers"),
    ("lr_scheduler.get_lr / get_last_lr / state_dict", SUPPORTED,
     "the config's \"scheduler\", advanced by the engine at each optimizer step"),
    ("engine.global_steps / global_samples / micro_steps / skipped_steps", SUPPORTED, "DeepSpeed's counters"),
    ("engine.is_gradient_accumulation_boundary", SUPPORTED,
     "True before the micro-batch that steps (pipeline engines: False outside train_batch, as DeepSpeed)"),
    ("engine.device / local_rank / global_rank / world_size", SUPPORTED, "as DeepSpeed on its accelerator"),
    ("engine.train_micro_batch_size_per_gpu / train_batch_size / gradient_accumulation_steps / "
     "zero_optimization_stage / gradient_clipping", SUPPORTED, "methods, as in DeepSpeed"),
    ("engine.save_checkpoint / load_checkpoint", DIFFERS,
     "DeepSpeed's keywords and return values (and format=\"deepspeed\"); save_latest=False, "
     "load_module_strict=False and custom_load_fn are refused"),
    ("engine.load_checkpoint(a folder DeepSpeed wrote)", SUPPORTED,
     "ZeRO-1/2/3, fp32 or bf16: weights, fp32 master, Adam moments and step, scheduler, client_state; at any "
     "world size and stage on zerolab's side (continuing equals DeepSpeed continuing; bf16 stage 3 within 2e-2: "
     "DeepSpeed's own bf16 forward differs from torch's)"),
    ("engine.save_checkpoint(..., format=\"deepspeed\") and python -m zerolab convert SRC DST --to deepspeed",
     SUPPORTED, "DeepSpeed's file names, keys and layout; DeepSpeed 0.19.8 resumes it at stages 1-3 (fp16, SGD, "
     "several parameter groups and NVMe-offloaded state are refused)"),
    ("DeepSpeed's universal checkpoint (ds_to_universal)", DIFFERS,
     "read by load_checkpoint at any world size; not written (DeepSpeed's ds_to_universal.py converts the "
     "DeepSpeed-format files zerolab writes)"),
    ("deepspeed.runtime.utils.set_random_seed", SUPPORTED, "random, numpy and torch seeded, as DeepSpeed"),
    ("engine.save_16bit_model", SUPPORTED, "the gathered weights, saved by rank 0; returns True"),
    ("engine.no_sync", REFUSED,
     "zerolab already skips the reduction between accumulation boundaries (DeepSpeed refuses it at ZeRO-2/3 too)"),
    ("optimizer.step / state_dict / load_state_dict", REFUSED,
     "engine.step() updates; the state is sharded: engine.save_checkpoint / load_checkpoint"),
    ("lr_scheduler.step", REFUSED, "the config's schedule: the engine advances it at each optimizer step, as "
     "DeepSpeed's does (a client scheduler is the client's object)"),
    ("the deepspeed launcher (deepspeed script.py)", SUPPORTED,
     "DeepSpeed's launcher runs a zerolab script (it only starts processes); zerolab-deepspeed / python -m "
     "zerolab.deepspeed runs an unchanged `import deepspeed` script on zerolab: --num_gpus, --include/--exclude "
     "localhost, --master_port/--master_addr, --module, --no_local_rank on torchrun; several nodes, other hosts "
     "and --launcher refused"),
]

BEGIN, END = "<!-- deepspeed-compat:begin (generated by zerolab.deepspeed.compat.markdown) -->", \
    "<!-- deepspeed-compat:end -->"


def markdown() -> str:
    """The table as Markdown, between the README's markers."""
    rows = ["| DeepSpeed 0.19.8 | zerolab.deepspeed | why / how it differs |", "|---|---|---|"]
    rows += [f"| `{name}` | {status} | {why} |" for name, status, why in TABLE]
    return "\n".join([BEGIN, *rows, END])


def counts() -> dict:
    out = {SUPPORTED: 0, DIFFERS: 0, REFUSED: 0}
    for _, status, _ in TABLE:
        out[status] += 1
    return out
