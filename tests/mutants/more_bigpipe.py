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
