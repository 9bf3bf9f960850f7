"""Mutants of context parallelism and the mesh's cp/ep axes: ring attention's online softmax, causal mask and
dK/dV return, Ulysses' all-to-all, the cp layout and coordinates, the engine's dp×cp group, the byte formula."""
from __future__ import annotations

from mutants import Mutant

EXACT2 = "tests/test_context_parallel.py::test_exact_on_2_ranks"
EXACT4 = "tests/test_context_parallel.py::test_exact_on_4_ranks"
HAND = "tests/test_context_parallel.py::test_formula_by_hand"
ZERO = "tests/test_context_parallel.py::test_zero2_over_dp_and_cp[ulysses]"
LAYOUT = "tests/test_mesh_cpep.py::test_layout_matches_hand_table"
COORDS = "tests/test_mesh_cpep.py::test_coordinates_with_cp_and_ep"

MUTANTS = [
    Mutant("cp-ring-no-rescale", "zerolab/parallel/context_ring.py",
           "out = out * torch.exp(lse - new) + o_j * torch.exp(l_j - new)",
           "out = out + o_j * torch.exp(l_j - new)",
           (EXACT2,), "ring attention adds a block without rescaling the running sum to the new normaliser"),
    Mutant("cp-ring-causal-reversed", "zerolab/parallel/context_ring.py",
           "    return not causal or src <= r",
           "    return not causal or src >= r",
           (EXACT2,), "the causal mask by chunk index lets a rank's queries see later chunks, not earlier ones"),
    Mutant("cp-ring-dkv-not-home", "zerolab/parallel/context_ring.py",
           'dkv = shift(dkv, comm, "ring-dkv") if n > 1 else dkv',
           "dkv = dkv",
           (EXACT2,), "the dK/dV accumulators stay on the rank after theirs instead of the last hop home"),
    Mutant("cp-ulysses-wrong-split", "zerolab/parallel/context_ulysses.py",
           "send = torch.stack(x.chunk(n, dim=scatter)).contiguous()",
           "send = torch.stack(x.chunk(n, dim=gather)).contiguous()",
           (EXACT2,), "Ulysses' all-to-all cuts the dimension it should join (sequence for heads)"),
    Mutant("cp-ulysses-bwd-same-way", "zerolab/parallel/context_ulysses.py",
           'return _exchange(grad.contiguous(), ctx.comm, gather, scatter, ctx.tag + "-bwd")',
           'return _exchange(grad.contiguous(), ctx.comm, scatter, gather, ctx.tag + "-bwd")',
           (EXACT2,), "the all-to-all's backward repeats the forward exchange instead of inverting it"),
    Mutant("cp-mesh-coordinate-off-by-one", "zerolab/runtime/mesh.py",
           '        out["cp"] = rank // tp % cp',
           '        out["cp"] = (rank // tp + 1) % cp',
           (COORDS,), "a rank's cp coordinate is its neighbour's"),
    Mutant("cp-mesh-dpcp-order", "zerolab/runtime/mesh.py",
           '"dp_cp": [[rank(d, p, c, t) for d in range(dp) for c in range(cp)]',
           '"dp_cp": [[rank(d, p, c, t) for c in range(cp) for d in range(dp)]',
           (LAYOUT,), "the dp×cp group lists its ranks cp-major (not in rank order): group indices disagree"),
    Mutant("cp-mesh-cp-stride", "zerolab/runtime/mesh.py",
           "        return ((d * pp + p) * cp + c) * tp + t",
           "        return ((d * pp + p) * cp + c) + t * cp",
           (LAYOUT,), "the cp axis sits innermost instead of tp (TP groups no longer consecutive)"),
    Mutant("cp-engine-averages-over-dp", "zerolab/engine/__init__.py",
           "mesh.communicator(mesh.grad_group, cfg.link)",
           'mesh.communicator("dp", cfg.link)',
           (ZERO,), "with cp > 1 the engine averages gradients over dp only: cp ranks drift apart"),
    Mutant("cp-lm-positions-from-zero", "zerolab/parallel/context.py",
           "start = 0 if self.comm is None else self.comm.rank * s",
           "start = 0",
           (ZERO,), "every cp rank numbers its tokens from 0: the position embedding of chunk r is chunk 0's"),
    Mutant("cp-formula-no-home-hop", "zerolab/theory/context.py",
           'dict(what="dkv-home", nbytes=2 * k, count=n, **common)',
           'dict(what="dkv-home", nbytes=2 * k, count=0, **common)',
           (HAND, EXACT2), "the ring's byte formula forgets the last hop bringing dK/dV home"),
    Mutant("cp-formula-ulysses-no-ring-factor", "zerolab/theory/context.py",
           "each = d[\"nbytes\"] if d[\"op\"] == \"send\" else ring_bytes(d[\"op\"], d[\"nbytes\"], d[\"group\"])",
           "each = d[\"nbytes\"]",
           (HAND, EXACT2), "the all-to-all counted as sending the whole tensor (a rank keeps its own piece)"),
]
