"""Mutants of expert parallelism (zerolab/parallel/experts*.py, zerolab/theory/experts.py): the gate's
capacity, weights and balancing loss, which rank holds which experts, the all-to-alls and their gradient,
the expert gradients' scaling and reduction under ZeRO, and the byte and memory formulas."""
from __future__ import annotations

from mutants import Mutant

T = "tests/test_expert_parallel.py"
NAIVE = f"{T}::test_layer_matches_token_by_token"
CAP = f"{T}::test_capacity_by_hand"
AUX = f"{T}::test_balancing_loss_by_hand"
EP2 = f"{T}::test_ep2_matches_one_process"
BYTES = f"{T}::test_ep2_ledger_bytes_equal_formula"
ZERO2 = f"{T}::test_zero_dp2_ep2_trains_as_one_process"
ZERO4 = f"{T}::test_zero_dp4_ep2_trains_as_one_process"
MEM = f"{T}::test_moe_memory_shards_experts_over_edp"
BREAKDOWN = f"{T}::test_comm_breakdown_ep_by_hand"

MUTANTS = [
    Mutant("ep-aux-no-E", "zerolab/parallel/experts_gate.py",
           "aux = e * (first.mean(dim=0) * probs.mean(dim=0)).sum()",
           "aux = (first.mean(dim=0) * probs.mean(dim=0)).sum()",
           (AUX, NAIVE), "the balancing loss misses Switch's factor E (1/E of its value and gradient)"),
    Mutant("ep-capacity-floor", "zerolab/theory/experts.py",
           "return math.ceil(capacity_factor * k * tokens / num_experts)",
           "return math.floor(capacity_factor * k * tokens / num_experts)",
           (CAP, NAIVE), "capacity rounded down: a token more dropped per full expert than GShard/DeepSpeed drop"),
    Mutant("ep-combine-unweighted", "zerolab/parallel/experts.py",
           "out[rows] * gates[:, None].to(out.dtype)",
           "out[rows]",
           (NAIVE,), "the combine adds the experts' outputs without their gate weights (router gets no gradient)"),
    Mutant("ep-top2-unnormalised", "zerolab/parallel/experts_gate.py",
           "gates = top_p if k == 1 else top_p / top_p.sum(dim=-1, keepdim=True)",
           "gates = top_p",
           (NAIVE,), "top-2 gates are the raw probabilities, not renormalised over the two chosen experts"),
    Mutant("ep-dispatch-wrong-rank", "zerolab/parallel/experts.py",
           "self.first_expert = comm.rank * self.num_local_experts",
           "self.first_expert = (comm.world_size - 1 - comm.rank) * self.num_local_experts",
           (EP2,), "a rank keeps other experts than those whose tokens the all-to-all sends it"),
    Mutant("ep-combine-not-sent-home", "zerolab/parallel/experts.py",
           'return all_to_all(torch.stack(outs, dim=1), self.comm, "ep-combine")',
           "return torch.stack(outs, dim=1)",
           (EP2,), "the experts' outputs stay on the expert's rank: no reverse all-to-all"),
    Mutant("ep-alltoall-backward-identity", "zerolab/parallel/experts.py",
           'ctx.comm.all_to_all(out, grad, tag=ctx.tag + "-bwd")',
           "out.copy_(grad)",
           (EP2,), "the all-to-all's backward keeps the gradient where it is instead of sending it back"),
    Mutant("ep-expert-grads-not-over-dp", "zerolab/parallel/experts.py",
           "    flat /= dp\n",
           "",
           (ZERO2,), "expert gradients are not divided by dp as the engine divides the dense ones (dp times too big)"),
    Mutant("ep-edp-not-reduced", "zerolab/parallel/experts.py",
           'edp_comm.all_reduce(flat, tag="edp-grads")',
           "pass",
           (ZERO4,), "replicas of an expert (the edp group) do not sum their gradients: they drift apart"),
    Mutant("ep-bytes-forward-only", "zerolab/theory/experts.py",
           "return layers * (4 if backward else 2) * one",
           "return layers * 2 * one",
           (BYTES,), "the all-to-all byte formula forgets the backward's two all-to-alls"),
    Mutant("ep-memory-over-dp", "zerolab/theory/experts.py",
           "experts = estimate(expert_params // ep, dp // ep, stage, precision, optimizer)",
           "experts = estimate(expert_params // ep, dp, stage, precision, optimizer)",
           (MEM,), "expert parameters counted as sharded over all dp ranks, not over their dp/ep replicas"),
    Mutant("ep-breakdown-count", "zerolab/theory/experts.py",
           "count=4 * m[\"layers\"] * grad_accum,",
           "count=2 * m[\"layers\"] * grad_accum,",
           (BREAKDOWN,), "comm_breakdown lists the experts' forward all-to-alls only"),
    Mutant("ep-experts-inside-engine-accepted", "zerolab/parallel/experts.py",
           'any(getattr(p, "_zerolab_engine", False) for p in self.experts.parameters())',
           "False",
           (ZERO2,), "experts left inside a DP engine train silently wrong (each rank's experts averaged together)"),
]
