"""Every exercise: the solution passes, the stub fails, and plausible wrong answers fail.

One kernel per exercise (``grading.grade_variants``): the solution, the untouched
stub and each wrong answer run through every cell of the pristine notebook in
turn. ``WRONG`` documents which check catches which mistake; the closing
report of issue 7 lists the same table.
"""
from __future__ import annotations

import pytest

from zerolab.grading import exercises as ex
from zerolab.grading import grader as grading

pytestmark = pytest.mark.slow


def _solution(exercise, answer):
    nb = ex.read(ex.solution_path(exercise))
    return next(c.source for c in nb.cells if ex.meta(c).get("answer") == answer)


def _stubs(exercise):
    nb = ex.read(ex.solution_path(exercise))
    return {ex.meta(c)["answer"]: ex.meta(c)["stub"] for c in nb.cells if ex.ANSWER in ex.tags(c)}


def mutate(exercise, answer, *edits):
    """The solution of ``answer`` with each (old, new) replacement applied (old must occur)."""
    src = _solution(exercise, answer)
    for old, new in edits:
        assert old in src, f"{exercise}/{answer}: {old!r} not in the solution"
        src = src.replace(old, new)
    return {answer: src}


MESH_CHECK = "the mesh zl.choose_stage picks (fit first, then the full step)"

# exercise -> {label: (answers, the checks that must fail)}
WRONG = {
    "01_memory": {
        "no padding (floor division)": (
            mutate("01_memory", "model_state_bytes", ("-(-psi // n_gpus)", "psi // n_gpus")),
            {"padding when N does not divide Ψ", "every precision and stage, N = 1..8"}),
        "fp32 with a master copy (K = 12)": (
            mutate("01_memory", "model_state_bytes", ('"fp32": (4, 4, 8)', '"fp32": (4, 4, 12)')),
            {"every precision and stage, N = 1..8", "against engine.memory() on 2 ranks"}),
        "stage 2 partitions the parameters": (
            mutate("01_memory", "model_state_bytes", ("stage >= 3 else psi", "stage >= 2 else psi")),
            {"the ZeRO paper's 7.5B model on 64 GPUs", "against engine.memory() on 2 ranks"}),
        "a budget met exactly does not fit (< instead of <=)": (
            mutate("01_memory", "min_gpus_to_fit", ("<= gpu_bytes", "< gpu_bytes")),
            {"the fewest GPUs that fit"}),
    },
    "02_ring_allreduce": {
        "N steps instead of N-1 in the reduce-scatter": (
            mutate("02_ring_allreduce", "ring_all_reduce", ("for s in range(n - 1):                          # reduce",
                                                            "for s in range(n):                              # reduce")),
            {"each rank sends 2(N-1)/N of the tensor"}),   # the sums survive: the all-gather overwrites
        "adds instead of copying in the all-gather": (
            mutate("02_ring_allreduce", "ring_all_reduce", ("chunks[recv_i].copy_(exchange(", "chunks[recv_i].add_(exchange(")),
            {"the ring sums correctly on 2, 3 and 4 ranks"}),
        "shortcut through dist.all_reduce": (
            {"ring_all_reduce": "def ring_all_reduce(t):\n    dist.all_reduce(t)\n"
                                "    n = dist.get_world_size()\n    return 2 * (n - 1) * t.numel() * 4 // n\n"},
            {"the ring sums correctly on 2, 3 and 4 ranks", "each rank sends 2(N-1)/N of the tensor"}),
        "reports bytes without the (N-1)/N factor": (
            mutate("02_ring_allreduce", "ring_all_reduce", ("    return sent", "    return 2 * t.numel() * t.element_size()")),
            {"each rank sends 2(N-1)/N of the tensor"}),
        "averages instead of summing": (
            mutate("02_ring_allreduce", "all_reduce_via_rs_ag", ("comm.reduce_scatter(shard, buf)",
                                                                 "comm.reduce_scatter(shard, buf, op='avg')")),
            {"reduce-scatter + all-gather, with padding"}),
        "no padding before the reduce-scatter": (
            mutate("02_ring_allreduce", "all_reduce_via_rs_ag", ("padded = -(-flat.numel() // n) * n",
                                                                 "padded = flat.numel()")),
            {"reduce-scatter + all-gather, with padding"}),
        "forgets the (N-1)/N factor": (
            mutate("02_ring_allreduce", "ring_cost", ("return 2 * (n - 1) * nbytes // n", "return 2 * nbytes")),
            {"the byte and time formulas"}),
        "latency paid once per phase": (
            mutate("02_ring_allreduce", "ring_cost", ("2 * (n - 1) * latency", "2 * latency")),
            {"the byte and time formulas"}),
    },
    "03_flat_partition": {
        "off-by-one padding (always one more chunk)": (
            mutate("03_flat_partition", "shard_layout", ("shard = -(-numel // world_size)",
                                                         "shard = numel // world_size + 1")),
            {"padded size and shard size"}),
        "floor division drops the tail": (
            mutate("03_flat_partition", "shard_layout", ("shard = -(-numel // world_size)",
                                                         "shard = max(1, numel // world_size)")),
            {"padded size and shard size", "one all-gather rebuilds the parameters on 3 and 4 ranks"}),
        "piece start measured from the flat buffer, not the shard": (
            mutate("03_flat_partition", "shard_pieces", ("lo - offset, lo - lo_r, hi - lo", "lo - offset, lo, hi - lo")),
            {"pieces cover every element exactly once"}),
        "inclusive end: one element too many": (
            mutate("03_flat_partition", "shard_pieces", ("if lo < hi:", "if lo <= hi:"),
                   ("lo - offset, lo - lo_r, hi - lo", "lo - offset, lo - lo_r, hi - lo + 1")),
            {"pieces cover every element exactly once"}),
        "every rank builds rank 0's shard": (
            mutate("03_flat_partition", "build_shard", ("shard_pieces(numels, world_size, rank)",
                                                        "shard_pieces(numels, world_size, 0)")),
            {"your shards equal the engine's FlatParams shards",
             "one all-gather rebuilds the parameters on 3 and 4 ranks"}),
    },
    "04_zero1_step": {
        "sum instead of mean (forgets to divide by N)": (
            mutate("04_zero1_step", "zero1_step", ("    grad /= n ", "    pass ")),
            {"the gradient shard is the mean over ranks"}),
        "averaging twice": (
            mutate("04_zero1_step", "zero1_step", ("comm.reduce_scatter(grad, flat_grads)",
                                                   "comm.reduce_scatter(grad, flat_grads, op='avg')")),
            {"the gradient shard is the mean over ranks"}),
        "bias correction off by one step": (
            mutate("04_zero1_step", "adam_shard_update", ("1 - b1 ** step", "1 - b1 ** (step + 1)")),
            {"Adam on a shard matches torch.optim.Adam", "same parameters as zerolab's ZeRO-1 engine after 3 steps"}),
        "eps inside the square root": (
            mutate("04_zero1_step", "adam_shard_update", (".sqrt_().add_(eps)", ".add_(eps).sqrt_()")),
            {"Adam on a shard matches torch.optim.Adam"}),
        "forgets the all-gather": (
            mutate("04_zero1_step", "zero1_step", ("comm.all_gather(flat_params, shard)",
                                                   "flat_params[r * S:(r + 1) * S] = shard")),
            {"same parameters as zerolab's ZeRO-1 engine after 3 steps",
             "one reduce-scatter and one all-gather per step: an all-reduce's bytes"}),
        "all-reduce instead of reduce-scatter": (
            mutate("04_zero1_step", "zero1_step", ("comm.reduce_scatter(grad, flat_grads)",
                                                   "comm.all_reduce(flat_grads); grad.copy_(flat_grads[r * S:(r + 1) * S])")),
            {"one reduce-scatter and one all-gather per step: an all-reduce's bytes"}),
    },
    "05_zero2_grads": {
        "closes a bucket when it reaches the size (>=)": (
            mutate("05_zero2_grads", "assign_buckets", ("size + numels[i] > bucket_elems", "size + numels[i] >= bucket_elems")),
            {"buckets as the engine makes them"}),
        "reduces every bucket after backward": (
            mutate("05_zero2_grads", "GradBucketer", ("        self.missing[b] -= 1\n        self._issue_ready()",
                                                      "        self.missing[b] -= 1")),
            {"buckets are reduce-scattered during backward"}),
        "averaging twice": (
            mutate("05_zero2_grads", "GradBucketer", ("self.comm.reduce_scatter(shard, full)",
                                                      "self.comm.reduce_scatter(shard, full, op='avg')")),
            {"the gradient shard is the mean over ranks"}),
        "keeps the full gradients": (
            mutate("05_zero2_grads", "GradBucketer", ("        p.grad = None\n", "")),
            {"full gradients are freed; bytes as the ring says"}),
        "no padding to a multiple of N": (
            mutate("05_zero2_grads", "GradBucketer", ("self.sizes.append(-(-off // self.n) * self.n)",
                                                      "self.sizes.append(off)")),
            {"the gradient shard is the mean over ranks"}),
    },
    "06_zero3_prefetch": {
        "< instead of <= in the prefetch budget": (
            mutate("06_zero3_prefetch", "prefetch_schedule", ("ahead + numels[nxt] > prefetch_elems",
                                                              "ahead + numels[nxt] >= prefetch_elems")),
            {"the example from the rules", "valid and greedy under both budgets, forward and backward"}),
        "ignores max_live_elems": (
            mutate("06_zero3_prefetch", "prefetch_schedule", (" or sum(live.values()) + numels[nxt] > max_live_elems", "")),
            {"valid and greedy under both budgets, forward and backward"}),
        "counts the current unit as ahead": (
            mutate("06_zero3_prefetch", "prefetch_schedule", ("order[k + 1:n_fetched]", "order[k:n_fetched]")),
            {"the example from the rules", "valid and greedy under both budgets, forward and backward"}),
        "releases before computing": (
            mutate("06_zero3_prefetch", "prefetch_schedule", ('[("compute", u), ("release", u)]',
                                                              '[("release", u), ("compute", u)]')),
            {"the example from the rules", "valid and greedy under both budgets, forward and backward",
             "2 ranks compute the model's output from shards"}),
    },
    "07_choose_config": {
        "ignores activations": (
            mutate("07_choose_config", "choose_config", ("if est.total + activation_bytes <= gpu_bytes",
                                                         "if est.total <= gpu_bytes")),
            {"the chosen stage fits in GPU memory"}),
        "always stage 3": (
            mutate("07_choose_config", "choose_config", ('zero = {"stage": stage}', 'zero = {"stage": 3}')),
            {"the stage zl.choose_stage picks (fastest that fits, ties to the lower stage)"}),
        "accumulation steps without N": (
            mutate("07_choose_config", "choose_config", ("divmod(global_batch, micro_batch * n_gpus)",
                                                         "divmod(global_batch, micro_batch)")),
            {"every config is valid DeepSpeed JSON with the right batch"}),
        "ties broken by the least memory (the highest stage)": (
            mutate("07_choose_config", "choose_config", ("stage = min(s for t, s", "stage = max(s for t, s")),
            {"the stage zl.choose_stage picks (fastest that fits, ties to the lower stage)"}),
        "offloads only at stage 3": (
            mutate("07_choose_config", "choose_config", ('("cpu", (1, 2, 3))', '("cpu", (3,))')),
            {"the stage zl.choose_stage picks (fastest that fits, ties to the lower stage)"}),
        # (ignoring gradient accumulation cannot change the answer: in the ring model communication
        # never falls as the stage rises, for any g; tests/test_plan.py checks that ordering)
        "mesh: ties to the most model parallelism": (
            mutate("07_choose_config", "choose_mesh", ("least = min(r[1] * r[2] for r in close)",
                                                       "least = max(r[1] * r[2] for r in close)")),
            {MESH_CHECK}),
        "mesh: the pipeline bubble left out": (
            mutate("07_choose_config", "choose_mesh", ("rows.append((sum(times.values()), tp, pp, dp, stage))",
                                                       "rows.append((sum(times.values()) - times['bubble'], tp, pp, "
                                                       "dp, stage))")),
            {MESH_CHECK}),
        "mesh: activations not split by TP": (
            mutate("07_choose_config", "choose_mesh", ("activation_bytes / tp", "activation_bytes")), {MESH_CHECK}),
        "mesh: micro-batches per step taken as the accumulation steps": (
            mutate("07_choose_config", "choose_mesh", ("m = batch // (dp * micro)", "m = ga")), {MESH_CHECK}),
        # (allowing ZeRO-2/3 with PP changed no answer in a search over 30B-175B on 16-128 GPUs with 1 and 8
        # NICs: the time model's extra gathers per micro-batch keep them behind the meshes the rules allow)
    },
    "08_reshard": {
        "floor division for the new shard size": (
            mutate("08_reshard", "reshard_pieces", ("-(-numel // old_n), -(-numel // new_n)",
                                                    "-(-numel // old_n), max(1, numel // new_n)")),
            {"pieces cover every element exactly once, never the padding",
             "one unit, N to M, equals FlatParams' shards at M",
             "a real engine's fp32 master, saved on 2 ranks, resharded to 1, 3 and 4"}),
        "pieces run into the padding": (
            mutate("08_reshard", "reshard_pieces", ("min(numel, (new_rank + 1) * new_s)", "(new_rank + 1) * new_s")),
            {"pieces cover every element exactly once, never the padding"}),
        "start in the new shard measured from the flat buffer": (
            mutate("08_reshard", "reshard_pieces", ("lo - lo_new, hi - lo", "lo, hi - lo")),
            {"pieces cover every element exactly once, never the padding",
             "one unit, N to M, equals FlatParams' shards at M"}),
        "every new rank gets new rank 0's pieces": (
            mutate("08_reshard", "reshard_unit", ("reshard_pieces(numel, len(shards), new_n, q)",
                                                  "reshard_pieces(numel, len(shards), new_n, 0)")),
            {"one unit, N to M, equals FlatParams' shards at M",
             "a real engine's fp32 master, saved on 2 ranks, resharded to 1, 3 and 4"}),
        "cuts the old shard spaces at the new shard size": (
            mutate("08_reshard", "reshard_shard_space", ("old_s = -(-numel // old_n)", "old_s = -(-numel // new_n)")),
            {"a real engine's fp32 master, saved on 2 ranks, resharded to 1, 3 and 4"}),
    },
    "09_3d": {
        "one warm-up forward too many (p - s)": (
            mutate("09_3d", "one_f_one_b", ("warm = p - s - 1", "warm = p - s")),
            {"the example from the rules", "complete, causal, in order, at most p - s in flight"}),
        "GPipe: every forward, then every backward": (
            {"one_f_one_b": "def one_f_one_b(p, m, s):\n    return [(\"F\", i) for i in range(m)] + [(\"B\", i) for i in range(m)]\n"},
            {"the example from the rules", "complete, causal, in order, at most p - s in flight"}),
        "warm-up counted from the wrong end (s instead of p - s - 1)": (
            mutate("09_3d", "one_f_one_b", ("warm = p - s - 1", "warm = s")),
            {"the example from the rules", "no deadlock; the step is (m + p - 1)(tf + tb)",
             "4 real ranks train with your orders: gradients equal one process's"}),
        "forgets the cool-down backwards": (
            mutate("09_3d", "one_f_one_b", ("return order + [(\"B\", i) for i in range(m - warm, m)]", "return order")),
            {"complete, causal, in order, at most p - s in flight"}),
    },
    "10_ulysses": {
        "the sequence stays split (each rank keeps its own tokens)": (
            mutate("10_ulysses", "held_after", ("return list(range(s)), ",
                                                "return list(range(r * (s // cp), (r + 1) * (s // cp))), ")),
            {"the example: 2 ranks, 8 tokens, 4 heads",
             "the blocks tile the grid: every cell moves once, to where it is held",
             "on real ranks: the layout and the ledger's bytes"}),
        "sends the destination's tokens, not its own": (
            mutate("10_ulysses", "sent", ("list(range(src * chunk, (src + 1) * chunk))",
                                          "list(range(dst * chunk, (dst + 1) * chunk))")),
            {"the blocks tile the grid: every cell moves once, to where it is held"}),
        "counts the block a rank keeps as sent": (
            mutate("10_ulysses", "a2a_bytes", (" * (cp - 1) // cp", "")),
            {"on real ranks: the layout and the ledger's bytes"}),
    },
}


@pytest.mark.parametrize("exercise", sorted(WRONG))
def test_solution_stub_and_wrong_answers(exercise):
    variants = {"solution": {}, "stub": _stubs(exercise)}
    variants.update({label: answers for label, (answers, _) in WRONG[exercise].items()})
    reports = grading.grade_variants(exercise, variants)

    sol = reports["solution"]
    assert sol.passed, sol.text()
    assert len(sol.checks) >= 3
    stub = reports["stub"]
    assert not any(c.passed for c in stub.checks), stub.text()
    for label, (_, must_fail) in WRONG[exercise].items():
        rep = reports[label]
        assert not rep.passed, f"wrong answer {label!r} passed:\n{rep.text()}"
        assert must_fail <= rep.failed_checks(), (
            f"wrong answer {label!r}: expected {sorted(must_fail)} to fail, failed {sorted(rep.failed_checks())}")


def test_every_exercise_has_wrong_answers():
    assert set(WRONG) <= set(ex.names())
    for exercise, variants in WRONG.items():
        assert len(variants) >= 2, exercise
