"""The mutants: plausible bugs in the engines, the loader, checkpoints and ZeRO++ (issue 25, item 8).

Each mutant replaces one exact snippet of a file under ``zerolab/`` (it must occur exactly
once: ``tests/test_mutants_table.py`` checks that on every ``make test``, so a refactor that
moves the code shows here) and names the tests that must fail with it. ``run.py`` applies
each one to a copy of the package and runs those tests. The test selections are narrow on
purpose: one parametrisation where one is enough, so the suite runs in minutes on 2 cores.
"""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Mutant:
    id: str            # short name, for run.py's command line
    file: str          # the file it changes, relative to the repository root
    old: str           # the exact snippet (occurs once in the file)
    new: str           # what replaces it (the file must still compile)
    tests: tuple       # pytest node ids or files (relative to the root) that must fail
    why: str           # the bug in one line


EQ2 = "tests/test_engine_equivalence.py::test_fp32_matches_single_process[2]"
PREC2 = "tests/test_engine_precision.py::test_mixed_precision_matches_fp32_master_reference[2]"
CLIP = "tests/test_engine_clipping.py"
RESHARD = "tests/test_checkpoint_reshard.py::test_reshard_matches_uninterrupted_run"
RESUME = "tests/test_checkpoint_resume.py::test_resume_is_bit_identical_pairwise"

MUTANTS = [
    # ------------------------------------------------------------ the step: clipping, scaling, boundaries
    Mutant("clip-above-one", "zerolab/engine/optim.py",
           "return min(1.0, max_norm / (total_norm + 1e-6))",
           "return max_norm / (total_norm + 1e-6)",
           (CLIP,), "clip coefficient not capped at 1: gradients scaled UP when the norm is below the threshold"),
    Mutant("clip-local-norm", "zerolab/engine/base.py",
           'self.communicator.all_reduce(sq, tag="grad-norm")',
           "pass",
           (CLIP,), "clipping uses the norm of this rank's shard only (the all-reduce of Σg² is missing)"),
    Mutant("boundary-off-by-one", "zerolab/engine/base.py",
           "return (self.micro_steps + 1) % self.gas == 0",
           "return self.micro_steps % self.gas == 0",
           (EQ2,), "the accumulation boundary is the first micro-batch of a step, not the last"),
    Mutant("step-off-by-one", "zerolab/engine/base.py",
           "if self.micro_steps % self.gas:\n            return",
           "if (self.micro_steps + 1) % self.gas:\n            return",
           (EQ2,), "the optimizer steps one micro-batch early"),
    Mutant("sum-not-mean", "zerolab/engine/base.py",
           "scale = 1.0 / (self.world_size * (self.scaler.scale if self.scaler else 1.0))",
           "scale = 1.0 / (self.scaler.scale if self.scaler else 1.0)",
           (EQ2,), "the reduced gradients are the sum over ranks, not the mean"),
    Mutant("forgotten-unscale", "zerolab/engine/base.py",
           "scale = 1.0 / (self.world_size * (self.scaler.scale if self.scaler else 1.0))",
           "scale = 1.0 / self.world_size",
           (PREC2,), "fp16: the loss scale is never divided out of the gradients"),
    Mutant("overflow-not-agreed", "zerolab/engine/base.py",
           'self.communicator.all_reduce(flag, op="max", tag="overflow")',
           "pass",
           ("tests/test_engine_precision.py::test_fp16_overflow_on_one_rank_skips_everywhere[0]",),
           "fp16: each rank decides alone whether to skip an overflowing step"),
    Mutant("scaler-never-halves", "zerolab/engine/precision.py",
           "self.scale = max(self.scale / 2, self.min_scale)",
           "self.scale = max(self.scale, self.min_scale)",
           ("tests/test_engine_precision.py::test_dynamic_loss_scaler_follows_deepspeed",),
           "fp16: the dynamic loss scale is not lowered after an overflow"),
    Mutant("master-never-copied", "zerolab/engine/base.py",
           "self.own(self.flat.flat, self.flat.units[i]).copy_(self.targets[i])",
           "self.targets[i].float()",
           (PREC2,), "mixed precision: the fp32 master is stepped but the 16-bit parameters never change"),
    Mutant("adam-no-bias-correction", "zerolab/engine/optim.py",
           "denom = (v.sqrt() / math.sqrt(1 - b2 ** t)).add_(h.eps)",
           "denom = v.sqrt().add_(h.eps)",
           ("tests/test_engine_optim.py",), "Adam (non-fused path): the second moment's bias correction is dropped"),
    Mutant("lr-one-step-ahead", "zerolab/engine/base.py",
           "return self.scheduler.lr(self.optimizer.step_count)",
           "return self.scheduler.lr(self.optimizer.step_count + 1)",
           ("tests/test_engine_api.py::test_scheduler_drives_the_engine_lr",),
           "the schedule is read one step ahead"),
    Mutant("buffers-not-broadcast", "zerolab/engine/base.py",
           'c.broadcast(b, src=0, tag="init-buffers")',
           "pass",
           ("tests/test_engine_api.py::test_params_frozen_params_and_buffers_come_from_rank_0",),
           "ranks keep their own initial buffers instead of rank 0's"),
    # ------------------------------------------------------------ stages 1-3: shards and collectives
    Mutant("own-shard-offset", "zerolab/engine/flat.py",
           "start = u.offset + self.rank * u.shard",
           "start = self.rank * u.shard",
           (EQ2,), "a rank's shard of a unit is read from the start of the flat buffer, not the unit's offset"),
    Mutant("stage1-no-allgather", "zerolab/engine/stage1.py",
           "def after_update(self) -> None:\n        self.all_gather_params()",
           "def after_update(self) -> None:\n        pass",
           (EQ2,), "stages 1-2: the updated shards are never all-gathered (a step that never updates the rest)"),
    Mutant("stage2-writes-not-adds", "zerolab/engine/stage2.py",
           "first = self.micro_steps % self.gas == 0",
           "first = True",
           (EQ2,), "stage 2 writes, instead of adding, the later micro-batches' reduced gradients"),
    Mutant("stage2-unused-not-zeroed", "zerolab/engine/stage2.py",
           "view[a:b].zero_()",
           "pass",
           (EQ2,), "stage 2: a parameter without a gradient reduces whatever its staging buffer held"),
    Mutant("stage3-persistent-stale", "zerolab/engine/stage3.py",
           "for i in self.persistent:",
           "for i in []:",
           ("tests/test_engine_stage3.py::test_stage3_fp32_matches_single_process[2]",),
           "stage 3: the persistent (small, whole) unit is not all-gathered after the step"),
    Mutant("stage3-kept-in-backward", "zerolab/engine/stage3.py",
           "self.release_params(i)\n            self.unit_grads_done(i)",
           "self.unit_grads_done(i)",
           ("tests/test_engine_bigmodel.py::test_sequential_units_are_its_layers_and_peak_gathered_is_one_layer",),
           "stage 3: a unit stays gathered after its backward (released only when backward ends)"),
    Mutant("prefetch-past-max-live", "zerolab/engine/prefetch.py",
           "elif self.live_elements + n > self.max_live:\n                break",
           "elif False:\n                break",
           ("tests/test_engine_stage3_measured.py::test_max_live_parameters_bounds_the_gathered_units",),
           "prefetch gathers past stage3_max_live_parameters"),
    Mutant("frozen-twin-never-released", "zerolab/engine/frozen.py",
           "if self._grads_left[j] == 0:\n                self.release_params(j)",
           "if self._grads_left[j] == 0:\n                pass",
           ("tests/test_engine_frozen.py::test_frozen_twins_are_released_after_their_backward[False]",),
           "stage 3: a frozen twin is never released in backward (only when backward ends)"),
    # ------------------------------------------------------------ the ledger
    Mutant("ledger-allgather-input", "zerolab/runtime/comm.py",
           'return self._run("all_gather", output,',
           'return self._run("all_gather", input,',
           ("tests/test_engine_measured.py::test_ledger_bytes_equal_comm_volume[2]",),
           "the ledger books an all-gather by its input (one shard), not the full tensor"),
    # ------------------------------------------------------------ ZeRO++
    Mutant("qgz-no-swizzle", "zerolab/engine/zeropp/engine.py",
           "swizzled = rows.view(m, k, r).transpose(0, 1)",
           "swizzled = rows.view(k, m, r)",
           ("tests/test_zeropp.py::test_qgz_hierarchical_all_to_all_gives_each_rank_its_shard",),
           "qgZ: the rows are not reordered before the intra-node all-to-all (it sums the wrong rows)"),
    Mutant("qgz-overwrites", "zerolab/engine/zeropp/engine.py",
           "if self.micro_steps % self.gas == 0:   # first micro-batch",
           "if True:   # first micro-batch",
           ("tests/test_zeropp.py::test_qgz_accumulates_micro_batches",),
           "qgZ: every micro-batch overwrites the gradient shard instead of adding to it"),
    Mutant("hpz-wrong-slice", "zerolab/engine/zeropp/engine.py",
           "start = self.hpz_comm.rank * s.numel()",
           "start = 0",
           ("tests/test_zeropp.py::test_hpz_is_exact_and_holds_its_secondary_partition",),
           "hpZ: every rank keeps the first slice of the unit as its secondary shard"),
    Mutant("quant-truncates", "zerolab/engine/zeropp/quantize.py",
           "q = torch.round(blocks / safe[:, :, None])",
           "q = torch.trunc(blocks / safe[:, :, None])",
           ("tests/test_zeropp.py::test_pack_roundtrip_and_size",),
           "quantization truncates instead of rounding (errors up to a whole step)"),
    # ------------------------------------------------------------ checkpoints
    Mutant("reshard-wrong-offset", "zerolab/engine/checkpoint/reshard.py",
           'a = u["shard_offset"] + e - r * s',
           'a = u["shard_offset"] + e',
           (RESHARD,), "resharding reads a saved rank's shard at the global element offset, not the rank's"),
    Mutant("reshard-drops-moments", "zerolab/engine/checkpoint/load.py",
           'read = keys if with_optimizer else ["fp32"]',
           'read = ["fp32"]',
           (RESHARD,), "loading a checkpoint keeps the weights and drops the optimizer moments"),
    Mutant("resume-step-count", "zerolab/engine/checkpoint/load.py",
           'opt.step_count = rec["optimizer"]["step_count"] if with_optimizer else 0',
           "opt.step_count = 0",
           (RESUME,), "resuming restarts Adam's step count (bias correction as at step 1)"),
    Mutant("consolidate-wrong-offset", "zerolab/engine/checkpoint/reshard.py",
           'a = u["shard_offset"] + lo - r * u["shard"]',
           'a = lo - r * u["shard"]',
           ("tests/test_checkpoint_consolidate.py::test_consolidate_equals_full_state_dict",),
           "consolidation reads every unit's shard from the start of the rank's file"),
    # ------------------------------------------------------------ the loader and offload
    Mutant("loader-wrong-offset", "zerolab/engine/bigmodel/load.py",
           "dst[a - lo: b - lo].copy_(src_flat[a - off: b - off])",
           "dst[a - lo: b - lo].copy_(src_flat[a - lo: b - lo])",
           ("tests/test_engine_bigmodel.py::test_meta_model_loaded_shard_by_shard_equals_the_file_and_trains_the_same",),
           "load_state_dict copies a shard from the file at the shard's offset, not the parameter's"),
    Mutant("offload-unscaled", "zerolab/engine/offload/optimizer.py",
           "if scale != 1.0:\n                    g.mul_(scale)",
           "if False:\n                    g.mul_(scale)",
           ("tests/test_engine_offload.py::test_offloaded_runs_reach_the_same_parameters[2]",),
           "offloaded optimizer: the gradients' scale (mean over ranks, clipping, unscale) is never applied"),
]
