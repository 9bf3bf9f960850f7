"""Mutants for the pipeline's link and eval_batch, the big-model loader and the fp32 master."""
from __future__ import annotations

from mutants import Mutant

P2P_TESTS = "tests/test_pipeline_p2p.py"

MUTANTS = [
    Mutant("eval-loss-not-averaged-over-dp", "zerolab/deepspeed/pipe_engine.py",
           'result = outputs if reduce_output is None else self._dp_mean(sum(outputs) / m)',
           'result = outputs if reduce_output is None else sum(outputs) / m',
           (P2P_TESTS + "::test_eval_batch_under_bf16_averages_over_dp",),
           "eval_batch returns each DP rank's own mean loss, not the mean over the DP group"),
    Mutant("p2p-header-without-dtype", "zerolab/parallel/pipeline_schedule.py",
           "            dtype, ndim = DTYPES[head[k]], head[k + 1]",
           "            dtype, ndim = torch.float32, head[k + 1]",
           (P2P_TESTS + "::test_a_stage_returning_fp32_in_a_bf16_engine",
            P2P_TESTS + "::test_activations_of_any_shape_and_tuples_give_single_process_gradients[tuple]"),
           "the receiver allocates fp32 whatever was sent: an int64 (or bf16) tensor does not fit what arrives"),
    Mutant("eval-batch-skips-the-cast", "zerolab/deepspeed/pipe_engine.py",
           "            h = self.engine(x if first else link.recv(s - 1))",
           "            h = self.engine.module(x if first else link.recv(s - 1))",
           (P2P_TESTS + "::test_eval_batch_under_bf16_averages_over_dp",),
           "eval_batch feeds fp32 inputs to a bf16 stage (train_batch casts them)"),
    Mutant("p2p-unused-input-no-grad", "zerolab/parallel/pipeline_run.py",
           "q.grad if q.grad is not None else torch.zeros_like(q)",
           "q.grad if q.grad is not None else torch.ones_like(q)",
           (P2P_TESTS + "::test_activations_of_any_shape_and_tuples_give_single_process_gradients[tuple]",),
           "an input the next stage left unused sends back a gradient that is not zero"),
]
MASTER = "tests/test_engine_master.py::test_the_fp32_master_is_the_fp32_model_bit_for_bit"
MUTANTS += [
    Mutant("master-from-rounded-weights", "zerolab/engine/base.py",
           "self.targets[-1].copy_(self.flat.exact.pop(i, own))",
           "self.targets[-1].copy_(own)",
           (MASTER,), "a bf16 engine's fp32 master starts from the bf16-rounded weights, not the model's fp32 values"),
    Mutant("exact-master-not-rank-0s", "zerolab/engine/bigmodel/materialize.py",
           '                communicator.broadcast(ex, src=0, tag="init-params")',
           '                pass',
           (MASTER,), "each rank's fp32 master starts from its own model's values, not rank 0's (the ranks diverge)"),
    Mutant("offload-master-from-rounded", "zerolab/engine/offload/optimizer.py",
           "chunk[: b - a].copy_((start or targets)[i][a:b])",
           "chunk[: b - a].copy_(targets[i][a:b])",
           (MASTER,), "the offloaded optimizer's host master starts from the bf16-rounded weights"),
]
MOE = "tests/test_hf_moe_loading.py"
MUTANTS += [
    Mutant("hf-expert-conversion-skipped", "zerolab/engine/bigmodel/load.py",
           "    raw = hf_names(model, raw, current)",
           "    raw = raw",
           (MOE,), "a MoE model's save_pretrained file (experts per expert on disk) does not load into its fused experts"),
    Mutant("hf-experts-out-of-order", "zerolab/engine/bigmodel/hf_names.py",
           "for key in sorted(sd, key=dot_natural_key):",
           "for key in sorted(sd):",
           (MOE,), "experts stacked in string order (10 before 2)"),
]
GEMMA = "tests/test_hf_loading.py::test_gemma2_built_on_meta_computes_its_embed_scale"
MUTANTS += [
    Mutant("meta-buffer-built-still-refused", "zerolab/engine/bigmodel/materialize.py",
           "    uninit.difference_update(n for n, f in zip(meta_names, flags.tolist()) if f)",
           "    pass",
           (GEMMA,), "a buffer the module's own init computed (Gemma 2's embed_scale) is still called uninitialised"),
    Mutant("meta-buffer-built-rank-0-only", "zerolab/engine/bigmodel/materialize.py",
           '        communicator.all_reduce(flags, op="max", tag="init-buffers-built", control=True)',
           '        pass',
           (GEMMA,), "only rank 0 (which built it) counts the buffer as set: the other ranks refuse the forward"),
]
READS = "tests/test_engine_stage3.py::test_a_parent_reading_its_childs_weight_trains_like_one_process"
MUTANTS += [
    Mutant("z3-read-released-not-gathered", "zerolab/engine/stage3.py",
           "        if i not in self._gathered:\n            self.gather_params([i])\n        self._pinned.add(i)",
           "        self._pinned.add(i)",
           (READS,), "ZeRO-3: a parent reading its child's released weight gets an empty tensor (shape error)"),
    Mutant("z3-read-reduced-too-early", "zerolab/engine/stage3.py",
           "            self._calls_left[i] += 1   # a call whose end never comes: ready when backward ends",
           "            pass",
           (READS,), "a unit read by another module is reduced when its own module's backward ends: the reader's gradient arrives late"),
]
