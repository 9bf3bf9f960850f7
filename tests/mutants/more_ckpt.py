"""Mutants of the checkpoint code's DeepSpeed interop and 3D (mesh) checkpoints: the DeepSpeed ZeRO-3
sub-groups, the param group DeepSpeed's FusedAdam reads, the fused q|k|v resharded under a mesh, the
accumulation steps changed between two meshes. Each names the tests that must fail with it."""
from __future__ import annotations

from mutants import Mutant

GPT2_QKV = "tests/test_mesh_checkpoint.py::test_hf_gpt2_fused_qkv_reshards_tp2_to_tp1_and_back"
GAS = "tests/test_mesh_checkpoint.py::test_another_accumulation_count_keeps_the_optimizer_steps"
SUBGROUPS_LOAD = "tests/test_ds_checkpoint_resume.py::test_load_deepspeeds_fixture[stage3_subgroups-3-2]"
SUBGROUPS_CONVERT = ("tests/test_ds_checkpoint_convert.py::"
                     "test_convert_deepspeed_to_zerolab_and_back_gives_deepspeeds_tensors[stage3_subgroups]")
WRITTEN1 = "tests/test_ds_checkpoint_resume.py::test_written_files_have_deepspeeds_keys_and_shapes_and_resume[1]"
OTHER_MODEL = "tests/test_mesh_checkpoint.py::test_checkpoint_of_another_model_is_named"

MUTANTS = [
    Mutant("mesh-qkv-joined-as-one-block", "zerolab/engine/checkpoint/mesh_source.py",
           "return ms.unshard(pieces, *split) if split else pieces[0]",
           "return ms.unshard(pieces, split[0]) if split else pieces[0]",
           (GPT2_QKV,), "a fused q|k|v saved at tp 2 is joined as one block (q0 k0 v0 | q1 k1 v1), not block by "
                        "block: at tp 1 the heads land on the wrong rows"),
    Mutant("mesh-qkv-cut-as-one-block", "zerolab/engine/checkpoint/mesh_source.py",
           "ms.shard(full, split[0], split[1], self.tp, self.tp_rank)",
           "ms.shard(full, split[0], 1, self.tp, self.tp_rank)",
           (GPT2_QKV,), "a fused q|k|v read at tp 2 is cut as one block: rank 0 gets q and half of k"),
    Mutant("gas-micro-steps-not-recounted", "zerolab/engine/checkpoint/load.py",
           'engine.micro_steps = rec["global_steps"] * engine.gas',
           'engine.micro_steps = rec["micro_steps"]',
           (GAS,), "the micro-step counter kept as saved, not counted in the new accumulation window (saved at "
                   "gas 2 after 3 steps, loaded at gas 4: 6 micro-steps, so the next window ends early)"),
    Mutant("ds-load-one-state-per-param-group", "zerolab/engine/checkpoint/ds_load.py",
           'groups = [base["state"].get(i, {}) for g in base["param_groups"] for i in g["params"]]',
           'groups = [base["state"].get(i, {}) for i in range(len(base["param_groups"]))]',
           (SUBGROUPS_LOAD,), "one Adam state entry read per parameter group: DeepSpeed's stage-3 sub-groups "
                              "(every model above 1e9 parameters) cannot be loaded"),
    Mutant("ds-load-forgets-sub-group-size", "zerolab/engine/checkpoint/ds_load.py",
           '"sub_group_size": int((cfg.get("zero_optimization") or {}).get("sub_group_size") or 10**9)',
           '"sub_group_size": 10**9',
           (SUBGROUPS_CONVERT,), "DeepSpeed's sub_group_size is not carried through a conversion: written back "
                                 "as one sub-group, which the DeepSpeed run that saved it cannot load"),
    Mutant("ds-save-sub-group-rule", "zerolab/engine/checkpoint/ds_save.py",
           "if size >= sub_group_size or i == len(piece_numels) - 1:",
           "if size > sub_group_size or i == len(piece_numels) - 1:",
           ("tests/test_ds_checkpoint_convert.py::test_stage3_sub_groups_follow_deepspeeds_rule",),
           "a sub-group closes only past sub_group_size: DeepSpeed closes it on reaching it, so its loader "
           "would pair other sub-groups"),
    Mutant("ds-save-no-fused-adam-keys", "zerolab/engine/checkpoint/ds_save.py",
           '"weight_decay": hyper["weight_decay"], **FUSED_ADAM_KEYS, **TORCH_ADAM_KEYS,',
           '"weight_decay": hyper["weight_decay"], **TORCH_ADAM_KEYS,',
           (WRITTEN1, "tests/test_ds_checkpoint_convert.py::"
                      "test_convert_deepspeed_to_zerolab_and_back_gives_deepspeeds_tensors[stage1]"),
           "torch Adam's param group only: DeepSpeed's FusedAdam, its default, fails KeyError: 'bias_correction' "
           "on its first step after loading"),
    Mutant("ds-save-last-rank-padding-kept", "zerolab/engine/checkpoint/ds_save.py",
           '"single_partition_of_fp32_groups": [fp32[: ds.size - ds.pad * last]]',
           '"single_partition_of_fp32_groups": [fp32]',
           (WRITTEN1,), "stages 1-2: the last rank's fp32 partition keeps the group's end padding, which "
                        "DeepSpeed saves without"),
    Mutant("ds-save-schedule-position", "zerolab/engine/checkpoint/ds_save.py",
           '{"last_batch_iteration": sched["position"] - 1}',
           '{"last_batch_iteration": sched["position"]}',
           (WRITTEN1,), "the schedule's position written as DeepSpeed's last_batch_iteration: DeepSpeed resumes "
                        "its learning-rate schedule one step ahead"),
    Mutant("mesh-full-shape-not-compared", "zerolab/engine/checkpoint/mesh.py",
           "        if saved[name] != shape:",
           "        if False:",
           (OTHER_MODEL,), "a mesh checkpoint of another model's shapes (a wider vocabulary) is not refused by "
                           "name; the load fails later on a slice, or silently"),
    Mutant("old-zerolab-names-not-read", "zerolab/engine/checkpoint/files.py",
           'if name not in manifest["files"] and legacy_name(name) in manifest["files"]:',
           "if False:",
           ("tests/test_ds_checkpoint_layout.py::test_no_deepspeed_file_names_and_old_names_still_load[1]",),
           "a checkpoint zerolab wrote under DeepSpeed's file names (before the rename) no longer loads"),
]
