"""engine.train_batch and zl.initialize(whole model, mesh=) with pp > 1 (zerolab/parallel/pipeline_run.py).

Across real processes, against single-process training of the whole model (fp32, Adam, 3 steps
of 4 micro-batches), every parameter within 1e-5: DP x PP (2, 1, 2) with ZeRO-1 (clipping that
binds) and ZeRO-0 (GPipe); TP x PP (1, 2, 2); TinyGPT with its head tied to the embedding on
pp = 2, also under TP = 2 (both stages keep one value; clipping that binds counts the tied gradient
once); bf16 against the fp32-master reference; pp = 1
``train_batch`` bit-equal to plain accumulation. Errors name the value.
"""
from __future__ import annotations

import pytest
import torch
from torch import nn

import zerolab as zl
from zerolab.book.models import TinyGPT, loss_fn, synthetic_batch
from zerolab.config import Config, ConfigError

TOL = 1e-5   # fp32: every parameter of the whole model within this of single-process training
M, STEPS, ROWS = 4, 3, 4   # micro-batches per step, steps, rows per micro-batch (all DP ranks together)
# eps 1e-6 (torch's default 1e-8): Adam's first steps move an element by about lr * g / (|g| + eps), so
# where a gradient element nearly cancels (|g| ~ 1e-9) eps = 1e-8 turns the order of a float sum into a
# 1e-5 difference in that one parameter; eps = 1e-6 keeps such elements' steps proportional to g
ADAM = {"type": "Adam", "params": {"lr": 3e-3, "eps": 1e-6}}


def gpt(tied=False):
    return TinyGPT.preset("micro", key_bias=False, tie_weights=tied, seed=1)


def batches(model, step):
    x, y = synthetic_batch(model, M * ROWS, seed=7, step=step)
    return [(x[i * ROWS:(i + 1) * ROWS], y[i * ROWS:(i + 1) * ROWS]) for i in range(M)]


def config(stage_n, sched="1f1b", clip=0.0):
    return {"optimizer": ADAM, "gradient_accumulation_steps": M, "gradient_clipping": clip,
            "zero_optimization": {"stage": stage_n}, "zerolab": {"pipeline_schedule": sched}}


def _worker(dp, tp, pp, stage_n, sched, tied, clip):
    from zerolab.parallel import gather_3d, tensor_parallel, tp_dims, vocab_parallel_cross_entropy
    mesh = zl.mesh(dp=dp, tp=tp, pp=pp)
    model = gpt(tied)
    if tied and mesh.pp_rank == pp - 1:   # the last stage's copy starts elsewhere: initialize syncs it to stage 0's
        with torch.no_grad():
            model.head.weight.add_(0.5)
    if tp > 1:
        model = tensor_parallel(model, mesh)
    engine = zl.initialize(model, config(stage_n, sched, clip), mesh=mesh)   # the whole model: cut here
    lf = (lambda out, y: vocab_parallel_cross_entropy(out, y, mesh)) if tp > 1 else loss_fn
    rows, losses = ROWS // dp, []
    for step in range(STEPS):
        mine = [(x[rows * mesh.dp_rank: rows * (mesh.dp_rank + 1)], y[rows * mesh.dp_rank: rows * (mesh.dp_rank + 1)])
                for x, y in batches(model, step)]
        losses.append(engine.train_batch(mine, lf))
    own = engine.module.state_dict()   # this rank's stage (full_state_dict under a mesh is the whole model)
    state = gather_3d(engine.full_state_dict(), tp_dims(engine.module), mesh)
    return {"state": state, "own": sorted(own), "losses": losses, "stats": engine.pipeline_stats,
            "bytes": {g: engine.comm.total_bytes(group=g) for g in ("dp", "tp", "pp", "embed")}}


def reference(tied=False, clip=0.0):
    model = gpt(tied)
    opt = torch.optim.Adam(model.parameters(), **ADAM["params"])
    losses = []
    for step in range(STEPS):
        opt.zero_grad()
        loss = sum(loss_fn(model(x), y) for x, y in batches(model, step)) / M
        loss.backward()
        if clip:   # binds on every step (asserted)
            assert torch.nn.utils.clip_grad_norm_(model.parameters(), clip) > clip
        opt.step()
        losses.append(loss.item())
    return model.state_dict(), losses


def check(results, tied=False, clip=0.0):
    want, want_losses = reference(tied, clip)
    worst = 0.0
    for r in results:
        assert sorted(r["state"]) == sorted(want)   # the whole model, under its original names
        for n in want:
            worst = max(worst, (r["state"][n] - want[n]).abs().max().item())
            torch.testing.assert_close(r["state"][n], want[n], rtol=0, atol=TOL, msg=lambda m: f"{n}: {m}")
        for got, w in zip(r["losses"], want_losses):   # the mean over micro-batches and DP: every rank
            assert got == pytest.approx(w, rel=1e-5)
        assert len({tuple(r["losses"]) for r in results}) == 1
    print(f"max |difference| to single-process training: {worst:.2e}")
    return worst


@pytest.mark.parametrize("stage_n,sched,clip", [(1, "1f1b", 0.3), (0, "gpipe", 0.0)])
def test_dp2_pp2_whole_model_matches_single_process(stage_n, sched, clip):
    results = zl.launch(_worker, 4, args=(2, 1, 2, stage_n, sched, False, clip), timeout=300, threads=1)
    check(results, clip=clip)
    assert all(r["bytes"]["dp"] > 0 and r["bytes"]["pp"] > 0 and r["bytes"]["embed"] == 0 for r in results)
    # each rank's engine holds only its stage: stage 0 the embeddings, stage 1 the head
    assert "wte.weight" in results[0]["own"] and "head.weight" not in results[0]["own"]
    assert "head.weight" in results[1]["own"] and "wte.weight" not in results[1]["own"]


@pytest.mark.parametrize("tied,clip", [(False, 0.0), (True, 0.3)])
def test_tp2_pp2_whole_model_matches_single_process(tied, clip):
    """TP x PP (1, 2, 2), ZeRO-1; tied: the vocabulary-parallel embedding and head, each TP slice summed
    with its twin on the other stage (the embedding groups are per TP rank)."""
    results = zl.launch(_worker, 4, args=(1, 2, 2, 1, "1f1b", tied, clip), timeout=300, threads=1)
    check(results, tied=tied, clip=clip)
    if tied:
        assert all(torch.equal(r["state"]["wte.weight"], r["state"]["head.weight"]) for r in results)


def test_tied_embedding_across_stages_matches_single_process():
    """dp=2 x pp=2, ZeRO-1, clipping that binds: the head on stage 1 tied to the embedding on stage 0."""
    results = zl.launch(_worker, 4, args=(2, 1, 2, 1, "1f1b", True, 0.3), timeout=300, threads=1)
    check(results, tied=True, clip=0.3)
    for r in results:   # the two copies: one value, bit for bit
        assert torch.equal(r["state"]["wte.weight"], r["state"]["head.weight"])
    # the tied gradient summed over the embedding group: V x C fp32 per step, plus the initial broadcast
    V, C = 128, 32
    first = [r for r in results if "wte.weight" in r["own"]]
    assert len(first) == 2 and all(r["bytes"]["embed"] == (STEPS + 1) * V * C * 4 for r in first)


@pytest.mark.slow
def test_dp2_tp2_pp2_tied_on_8_ranks_matches_single_process():
    results = zl.launch(_worker, 8, args=(2, 2, 2, 1, "1f1b", True, 0.3), timeout=600, threads=1)
    check(results, tied=True, clip=0.3)


def _plain_tied_worker():
    """pp=2, no engine: the stage modules' .grad after one train_batch (tied: summed on both)."""
    from zerolab.parallel import pipeline_stage, train_batch
    mesh = zl.mesh(pp=2)
    model = gpt(True)
    stage = pipeline_stage(model, mesh)
    from zerolab.parallel.pipeline import sync_tied
    sync_tied(stage, mesh)
    loss = train_batch(stage, mesh, batches(model, 0), loss_fn, "1f1b")
    return {"loss": loss, "grads": {n: p.grad.clone() for n, p in stage.named_parameters()}}


def test_tied_gradients_without_engine():
    results = zl.launch(_plain_tied_worker, 2, timeout=120, threads=1)
    model = gpt(True)
    (sum(loss_fn(model(x), y) for x, y in batches(model, 0)) / M).backward()
    want = {n: p.grad for n, p in model.named_parameters(remove_duplicate=False)}
    got = {**results[0]["grads"], **results[1]["grads"]}
    assert sorted(got) == sorted(want)
    for n in want:   # wte.weight and head.weight: both the sum of the two uses' gradients
        torch.testing.assert_close(got[n], want[n], rtol=1e-5, atol=1e-7, msg=lambda m: f"{n}: {m}")


def _pp1_worker():
    """pp = 1 (no mesh), DP = 2: engine.train_batch against the DeepSpeed loop by hand, same data."""
    out = {}
    for how in ("train_batch", "loop"):
        engine = zl.initialize(gpt(), config(1))
        losses = []
        for step in range(STEPS):
            r = torch.distributed.get_rank()
            mine = [(x[2 * r: 2 * r + 2], y[2 * r: 2 * r + 2]) for x, y in batches(gpt(), step)]
            if how == "train_batch":
                losses.append(engine.train_batch(mine, loss_fn))
                continue
            total = 0.0
            for x, y in mine:
                loss = loss_fn(engine(x), y)
                engine.backward(loss)
                engine.step()
                total += loss.item()
            losses.append(total / M)
        out[how] = {"state": engine.full_state_dict(), "losses": losses,
                    "stats": getattr(engine, "pipeline_stats", None)}
    return out


def test_pp1_train_batch_is_plain_accumulation():
    results = zl.launch(_pp1_worker, 2, timeout=180, threads=1)
    for r in results:
        a, b = r["train_batch"], r["loop"]
        for n in a["state"]:
            assert torch.equal(a["state"][n], b["state"][n]), n
        assert a["stats"]["in_flight_max"] == 1 and len(a["stats"]["trace"]) == 2 * M
    # the loss: the mean over micro-batches and DP ranks, the same on both ranks
    tb = [r["train_batch"]["losses"] for r in results]
    assert tb[0] == tb[1]
    for step in range(STEPS):
        assert tb[0][step] == pytest.approx(sum(r["loop"]["losses"][step] for r in results) / 2, rel=1e-6)
    check([{"state": results[0]["train_batch"]["state"], "losses": tb[0]}])


def _errors_worker():
    mesh = zl.mesh(pp=2)
    out = {}

    def attempt(key, fn):
        try:
            fn()
            out[key] = None
        except (ValueError, ConfigError) as e:
            out[key] = str(e)

    attempt("blocks", lambda: zl.initialize(nn.Sequential(nn.Linear(4, 4)), config(0), mesh=mesh))
    attempt("cut", lambda: zl.initialize(nn.Linear(4, 4), config(0), mesh=mesh))
    engine = zl.initialize(gpt(), config(0), mesh=mesh)
    attempt("gas", lambda: engine.train_batch(batches(gpt(), 0)[:3], loss_fn))
    short = zl.initialize(gpt(), {**config(0), "gradient_accumulation_steps": 1}, mesh=mesh)
    attempt("1f1b", lambda: short.train_batch(batches(gpt(), 0)[:1], loss_fn))
    return out


def test_errors_name_the_value():
    out = zl.launch(_errors_worker, 2, timeout=120, threads=1)[0]
    assert "pp=2 is larger than the number of blocks (1)" in out["blocks"]
    assert "got Linear, which cannot be cut" in out["cut"]
    assert "len(batches) = 3 micro-batches" in out["gas"] and "gradient_accumulation_steps is 4" in out["gas"]
    assert "1F1B needs at least as many micro-batches as stages: 1 micro-batches, pp=2" in out["1f1b"]
    with pytest.raises(ConfigError, match=r"zerolab.pipeline_schedule: 'interleaved' is not allowed; expected one of "
                                          r"\('1f1b', 'gpipe'\)"):
        Config.from_deepspeed({"zerolab": {"pipeline_schedule": "interleaved"}})
    assert Config.from_deepspeed({}).pipeline_schedule == "1f1b"
    assert Config.from_deepspeed({"zerolab": {"pipeline_schedule": "GPipe"}}).pipeline_schedule == "gpipe"


def test_embedding_layout_by_hand():
    from zerolab.runtime.mesh import embedding_layout
    # rank = (dp_rank * pp + pp_rank) * tp + tp_rank: first and last stage at the same (dp, tp)
    assert embedding_layout(2, 2, 2) == [[0, 2], [1, 3], [4, 6], [5, 7]]
    assert embedding_layout(1, 1, 4) == [[0, 3]]
    assert embedding_layout(2, 1, 1) == []   # pp == 1: the first stage is the last


def _bf16_worker(tied):
    mesh = zl.mesh(dp=2, pp=2)
    model = gpt(tied)
    engine = zl.initialize(model, {**config(1, clip=0.3), "bf16": {"enabled": True}}, mesh=mesh)
    for step in range(STEPS):
        mine = [(x[2 * mesh.dp_rank: 2 * mesh.dp_rank + 2], y[2 * mesh.dp_rank: 2 * mesh.dp_rank + 2])
                for x, y in batches(model, step)]
        engine.train_batch(mine, loss_fn)
    from zerolab.parallel import gather_3d
    return {"state": gather_3d(engine.full_state_dict(), {}, mesh), "dtype": str(engine.flat.flat.dtype)}


def fp32_master_reference(tied, clip=0.3):
    """One process: the bf16 model, fp32 master weights and torch's Adam on them, clipping on the master."""
    model = gpt(tied).to(torch.bfloat16)
    named = dict(model.named_parameters())
    init = {n: p.detach().float().clone() for n, p in named.items()}
    master = {n: p.detach().float().clone().requires_grad_() for n, p in named.items()}
    opt = torch.optim.Adam(master.values(), **ADAM["params"])
    for step in range(STEPS):
        model.zero_grad()
        (sum(loss_fn(model(x), y) for x, y in batches(model, step)) / M).backward()
        for n, p in named.items():
            master[n].grad = p.grad.float()
        torch.nn.utils.clip_grad_norm_(master.values(), clip)
        opt.step()
        with torch.no_grad():
            for n, p in named.items():
                p.copy_(master[n])
    return init, {n: m.detach() for n, m in master.items()}


@pytest.mark.parametrize("tied", [True])
def test_bf16_matches_fp32_master_reference(tied):
    """bf16 with fp32 master weights, dp=2 x pp=2, ZeRO-1, the head tied: every tensor within a quarter of
    how far the reference moved it, the whole model within 5% (the bound tests/test_engine_precision.py uses)."""
    results = zl.launch(_bf16_worker, 4, args=(tied,), timeout=300, threads=1)
    init, want = fp32_master_reference(tied)
    aliases = {"head.weight": "wte.weight"} if tied else {}
    sq_err = sq_moved = 0.0
    for r in results:
        assert r["dtype"] == "torch.bfloat16"
        for name, w in want.items():
            got = r["state"][name].float()
            moved, err = (w - init[name]).norm().item(), (got - w).norm().item()
            assert moved > 0 and err <= 0.25 * moved, f"{name}: {err:.3g} from the reference, moved {moved:.3g}"
            sq_err, sq_moved = sq_err + err ** 2, sq_moved + moved ** 2
        for a, b in aliases.items():
            assert torch.equal(r["state"][a], r["state"][b])
    print(f"bf16: the model is {sq_err ** 0.5 / sq_moved ** 0.5:.3f} of its movement from the fp32-master reference")
    assert sq_err ** 0.5 <= 0.05 * sq_moved ** 0.5
