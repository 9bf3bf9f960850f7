"""3D bytes (issue 24, item 6): ``zl.comm_breakdown(psi, n, stage, tp=, pp=, ...)`` against the ledger of real
gloo ranks. TinyGPT (micro, untied) tensor-parallel over TP by its default plan, split into PP stages, ZeRO
over DP, on 4 ranks as (dp, tp, pp) = (2, 2, 1), (1, 2, 2), (2, 1, 2): on every rank the TP and PP bytes the
ledger books equal the formula for that rank's stage exactly; the DP bytes, averaged over the ranks (the
stages hold unequal slices), equal the formula over Ψ/(tp·pp) up to the engine's padding."""
from __future__ import annotations

import pytest

import zerolab as zl
from zerolab.book.models import TinyGPT, loss_fn, synthetic_batch
from zerolab.theory.comm3d import stage_blocks

M, ROWS, STEPS = 4, 4, 2   # micro-batches per step, rows per micro-batch (all DP ranks), optimizer steps
MESHES = [((2, 2, 1), 1), ((2, 2, 1), 3), ((1, 2, 2), 1), ((2, 1, 2), 1), ((2, 1, 2), 0)]
SHAPE = dict(layers=2, hidden=32, seq=16)   # TinyGPT "micro"


def gpt():
    return TinyGPT.preset("micro", key_bias=False, tie_weights=False, seed=1)


def _worker(cases):
    from zerolab.parallel import pipeline_stage, tensor_parallel, tp_dims, train_batch, vocab_parallel_cross_entropy
    out = []
    for (dp, tp, pp), stage_n in cases:
        mesh = zl.mesh(dp=dp, tp=tp, pp=pp)
        model = gpt()
        if tp > 1:
            model = tensor_parallel(model, mesh)
        dims = tp_dims(model)
        replicated = sum(p.numel() for n, p in model.named_parameters() if n not in dims)
        zero = {"stage": stage_n, "reduce_bucket_size": 3000}
        if stage_n == 3:
            zero.update(stage3_param_persistence_threshold=0, stage3_max_reuse_distance=0,
                        stage3_prefetch_bucket_size=0)
        engine = zl.initialize(pipeline_stage(model, mesh),
                               {"optimizer": {"type": "Adam", "params": {"lr": 1e-3}}, "gradient_accumulation_steps": M,
                                "zero_optimization": zero, "zerolab": {"collectives": "reduce_scatter"}}, mesh=mesh)
        mesh.ledger.reset()
        lf = (lambda o, y: vocab_parallel_cross_entropy(o, y, mesh)) if tp > 1 else loss_fn
        rows = ROWS // dp
        for step in range(STEPS):
            x, y = synthetic_batch(gpt(), M * ROWS, seed=7, step=step)
            mine = [(x[i * ROWS + rows * mesh.dp_rank:i * ROWS + rows * (mesh.dp_rank + 1)],
                     y[i * ROWS + rows * mesh.dp_rank:i * ROWS + rows * (mesh.dp_rank + 1)]) for i in range(M)]
            train_batch(engine, mesh, mine, lf)
        out.append({"bytes": {g: engine.comm.total_bytes(group=g) for g in ("dp", "tp", "pp")},
                    "inter": {g: engine.comm.total_bytes(group=g, scope="inter") for g in ("dp", "tp", "pp")},
                    "pp_rank": mesh.pp_rank, "replicated": replicated, "numel": engine.flat.numel,
                    "padded": engine.flat.padded})
        engine.close()
    return out


@pytest.fixture(scope="module")
def results():
    # two simulated nodes of 2 ranks (ranks_per_node=2): which bytes cross is booked too
    return zl.launch(_worker, 4, args=(MESHES,), timeout=300, threads=1, ranks_per_node=2)


def formula(ci, replicated, pp_rank=None, scope=None):
    (dp, tp, pp), stage_n = MESHES[ci]
    psi = sum(p.numel() for p in gpt().parameters())
    ops = zl.comm_breakdown(psi, 4, stage_n, dtype_bytes=4, grad_accum=M, gpus_per_node=2, tp=tp, pp=pp,
                            replicated=replicated, micro_batch=ROWS // dp, qkv_fused=False, pp_rank=pp_rank, **SHAPE)
    return {k: STEPS * v for k, v in zl.by_axis(ops, scope).items()}


@pytest.mark.parametrize("ci", range(len(MESHES)), ids=[f"dp{d}-tp{t}-pp{p}-zero{s}" for (d, t, p), s in MESHES])
def test_bytes_per_group_equal_the_formula(results, ci):
    (dp, tp, pp), stage_n = MESHES[ci]
    per_rank = [r[ci] for r in results]
    for r in per_rank:
        want = formula(ci, r["replicated"], r["pp_rank"])
        assert (r["bytes"]["tp"], r["bytes"]["pp"]) == (want["tp"], want["pp"]), (r["pp_rank"], r["bytes"], want)
        assert (r["bytes"]["tp"] > 0) == (tp > 1) and (r["bytes"]["pp"] > 0) == (pp > 1)
        # across the two nodes: TP never; PP when the stages sit on different nodes; DP when its ranks do
        inter = formula(ci, r["replicated"], r["pp_rank"], "inter")
        assert (r["inter"]["tp"], r["inter"]["pp"]) == (inter["tp"], inter["pp"]) == (0, r["bytes"]["pp"] * (tp == 2))
        assert r["inter"]["dp"] == r["bytes"]["dp"] and (inter["dp"] > 0) == (dp > 1)
    # DP: the mean over the ranks against the formula over the mean slice; the engine pads each unit to dp
    # shards (the formula only Ψ), mesh_share rounds up per TP·PP slice
    measured = sum(r["bytes"]["dp"] for r in per_rank) / 4
    want = formula(ci, per_rank[0]["replicated"])["dp"]
    pad = max(r["padded"] - r["numel"] for r in per_rank)
    per_elem = STEPS * 4 * (3 if stage_n == 3 else 2) * M ** (stage_n == 3) * (dp - 1) / dp   # bytes per element
    assert abs(measured - want) <= per_elem * (pad + tp * pp), (measured, want, pad)
    assert (measured > 0) == (dp > 1)
    # tp*pp >= 2 ranks per node: every DP ring hop crosses, in the formula as on the ledger
    assert formula(ci, per_rank[0]["replicated"], scope="inter")["dp"] == want


def test_formula_by_hand():
    # TP=2 x DP=2 (tests/test_tp_zero.py's count): per micro-batch 5 forward + 9 backward all-reduces of
    # b·s·h fp32 (a 2-rank ring sends the tensor once) and 3 of b·s fp32 for the loss
    ops = zl.comm_breakdown(30000, 4, 1, dtype_bytes=4, grad_accum=2, tp=2, replicated=1000, micro_batch=2,
                            qkv_fused=False, **SHAPE)
    act = 2 * 16 * 32 * 4
    assert zl.by_axis(ops) == {"dp": 2 * 62000 // 2, "tp": 2 * ((5 + 9) * act + 3 * 2 * 16 * 4), "pp": 0}
    # Megatron's fused qkv: 2 + 2 per block; sequence parallelism: the same bytes as all-gathers/reduce-scatters
    fused = zl.by_axis(zl.comm_breakdown(30000, 4, 1, grad_accum=1, tp=2, micro_batch=1, **SHAPE))["tp"]
    sp = zl.comm_breakdown(30000, 4, 1, grad_accum=1, tp=2, micro_batch=1, sequence_parallel=True, **SHAPE)
    assert fused == (5 + 5) * 16 * 32 * 2 + 3 * 16 * 4 == zl.by_axis(sp)["tp"]
    assert {o.op for o in sp if o.what != "loss"} == {"all_gather", "reduce_scatter"}
    # PP: one send of b·s·h per micro-batch forward (stages 0..p-2) and backward (stages 1..p-1); the loss
    # broadcast (4 bytes) sent by every stage but p-2; the DP formula over Ψ/pp among n/pp ranks
    for s, sends in enumerate((1, 2, 2, 1)):
        ops = zl.comm_breakdown(8e6, 8, 1, grad_accum=8, pp=4, micro_batch=1, pp_rank=s, **{**SHAPE, "layers": 8})
        assert zl.by_axis(ops)["pp"] == 8 * sends * 16 * 32 * 2 + 4 * (s != 2)
        assert zl.by_axis(ops)["dp"] == zl.comm_volume(2e6, 2, 1)
    assert stage_blocks(5, 2) == [3, 2]
    with pytest.raises(ValueError, match="tp=2, pp=1 needs layers=, hidden=, micro_batch=, seq="):
        zl.comm_breakdown(1e6, 4, 1, tp=2)
    with pytest.raises(ValueError, match="pp_rank must be None or an integer in 0..1"):
        zl.comm_breakdown(1e6, 4, 1, pp=2, micro_batch=1, pp_rank=2, **SHAPE)
    with pytest.raises(ValueError, match=r"n_gpus=6 is not a multiple of tp\*pp = 4"):
        zl.comm_breakdown(1e6, 6, 1, tp=2, pp=2, micro_batch=1, **SHAPE)
