"""Mutants of the DeepSpeed front door's compatibility work (zerolab/deepspeed/, config/optimizer.py)."""
from mutants import Mutant

DOOR = "tests/test_deepspeed_door.py"
CONFIG = "tests/test_config.py::test_ignored_keys_and_notes"

MUTANTS = [
    Mutant("ds-adam-is-l2", "zerolab/config/optimizer.py",
           'if typ == "adam" and w_mode is not False:',
           'if typ == "adam" and w_mode is True:',
           (CONFIG,), "DeepSpeed's \"Adam\" read as torch.optim.Adam (L2 weight decay) instead of AdamW"),
    Mutant("ds-client-scheduler-not-stepped", "zerolab/deepspeed/engine.py",
           "            self.lr_scheduler.step()   # a client scheduler: after each applied optimizer step, as DeepSpeed",
           "            pass",
           (f"{DOOR}::test_client_schedulers_drive_the_learning_rate",),
           "a client LR scheduler is never stepped: the learning rate stays at its first value"),
    Mutant("ds-torch-backward-no-reduction", "zerolab/deepspeed/torch_backward.py",
           "        engine._end_of_backward()\n",
           "        engine._seen |= engine._fired\n",
           (f"{DOOR}::test_loss_backward_then_step_equals_engine_backward",),
           "loss.backward() + engine.step() skips the end-of-backward reduction (buckets never flushed)"),
    Mutant("ds-hook-leaks-into-parent", "zerolab/deepspeed/launch.py",
           "    env = dict(os.environ if env is None else env)\n",
           "    env = dict(os.environ if env is None else env)\n    __import__('zerolab.deepspeed.hook').deepspeed.hook.install()\n",
           (f"{DOOR}::test_the_launcher_resolves_deepspeed_to_zerolab_in_the_ranks_only",),
           "the import alias is installed in the launcher's own process (and so in whoever imports it)"),
    Mutant("ds-groups-scaled-by-schedule", "zerolab/engine/optim.py",
           "        if self.same_scheduled_lr:\n",
           "        if False:\n",
           (f"{DOOR}::test_every_group_runs_at_the_configs_schedule_as_deepspeed",),
           "with the config's scheduler each group's own lr is scaled instead of set to the schedule's (DeepSpeed)"),
    Mutant("ds-torch-backward-no-gas-scaling", "zerolab/deepspeed/torch_backward.py",
           "        return grad / engine.gas if engine.gas > 1 else None",
           "        return None",
           (f"{DOOR}::test_loss_backward_then_step_equals_engine_backward",),
           "loss.backward() does not divide by gradient_accumulation_steps as DeepSpeed's output hooks do"),
]
MUTANTS.append(Mutant(
    "ds-gathered-edit-from-rank-0", "zerolab/deepspeed/zero.py",
    "                value = p.detach().clone() if rank == self.modifier_rank else None",
    "                value = p.detach().clone() if rank == 0 else None",
    ("tests/test_ds_zero_init.py::test_a_meta_device_models_edits_before_initialize_follow_modifier_rank",),
    "GatheredParameters before initialize keeps rank 0's edit whatever modifier_rank says"))
MUTANTS.append(Mutant(
    "ds-gathered-broadcast-from-rank-0", "zerolab/deepspeed/zero.py",
    "                    dist.broadcast(full, src=self.modifier_rank)",
    "                    dist.broadcast(full, src=0)",
    ("tests/test_ds_zero_init.py::test_zero_init_keeps_the_constructors_values_and_trains_like_one_process",),
    "GatheredParameters broadcasts rank 0's values whatever modifier_rank says"))
MUTANTS.append(Mutant(
    "ds-boundary-micro-batch-not-counted", "zerolab/deepspeed/engine.py",
    "        if forced is False:   # the caller (Accelerate) calls step() only at the boundary: count the micro-batch\n"
    "            self.engine.step()",
    "        if False:\n            self.engine.step()",
    ("tests/test_hf_trainer_door.py::test_trainer_accumulation_sets_the_boundary_and_steps_only_there",),
    "Accelerate's non-boundary backward is never counted: the engine's boundary drifts from the caller's"))
