"""Context parallelism beside tensor and pipeline parallelism, trained and checkpointed, on 4 gloo ranks.

ContextParallelLM (zerolab/parallel/context.py) converted by tensor_parallel on zl.mesh(tp=2, cp=2): trained at
ZeRO-1 (ring attention), ZeRO-2 and ZeRO-3 (Ulysses) to the parameters of single-process training on the whole
sequences and batch (Adam, fp32); engine.full_state_dict gathered to the single-process model's names, shapes
and values. A mesh checkpoint saved on tp 2 x cp 2 and loaded on the same mesh continues as the run that never
stopped; loaded at another ZeRO stage (its optimizer state carried exactly), on dp 2 x tp 2 (no cp) and on
dp 2 x cp 2 (no tp) it continues the same; one saved on dp 2 x tp 2 loads back into tp 2 x cp 2. A pipeline
with context parallelism (pp 2 x cp 2) is refused by name: a stage numbers its positions from 0 and calls the
blocks as modules, which context parallelism's model does not fit."""
from __future__ import annotations

import json
import os

import pytest
import torch
import torch.nn.functional as F

import zerolab as zl
from zerolab.parallel import pipeline_stage, tensor_parallel, vocab_parallel_cross_entropy
from zerolab.parallel.context import ContextParallelLM, split_sequence

S, ROWS = 16, 4   # tokens per sequence, sequences per step (the whole batch)
LM = dict(vocab=64, n_embd=32, n_head=4, layers=2, max_seq=S, seed=3)
ADAM = {"type": "Adam", "params": {"lr": 3e-3}}
PLAN = {"wte": "vocab", "blocks.*.attn.q": "colwise", "blocks.*.attn.k": "colwise", "blocks.*.attn.v": "colwise",
        "blocks.*.attn.proj": "rowwise", "blocks.*.mlp.0": "colwise", "blocks.*.mlp.2": "rowwise", "head": "colwise"}
KEYS = ("fp32", "exp_avg", "exp_avg_sq")


def batch(step):
    g = torch.Generator().manual_seed(100 + step)
    idx = torch.randint(0, LM["vocab"], (ROWS, S + 1), generator=g)
    return idx[:, :-1], idx[:, 1:]


def engine_on(dp, tp, cp, stage, method="ring"):
    mesh = zl.mesh(dp=dp, tp=tp, cp=cp)
    model = ContextParallelLM(**LM, comm=mesh.communicator("cp"), method=method)
    if tp > 1:
        model = tensor_parallel(model, mesh, PLAN)   # checked against the plain model (the cp group shared)
    return zl.initialize(model, {"optimizer": ADAM, "zero_optimization": {"stage": stage}}, mesh=mesh), mesh


def train(engine, mesh, steps):
    """Each step: this DP rank's rows of the whole batch, this cp rank's chunk of every sequence."""
    rows, cp = ROWS // mesh.dp, mesh.communicator("cp")
    for step in steps:
        x, y = (split_sequence(t[rows * mesh.dp_rank: rows * (mesh.dp_rank + 1)], cp) for t in batch(step))
        logits = engine(x)
        loss = vocab_parallel_cross_entropy(logits, y, mesh) if mesh.tp > 1 else \
            F.cross_entropy(logits.reshape(-1, logits.shape[-1]), y.reshape(-1))
        engine.backward(loss)
        engine.step()


def _worker(root):
    """Every phase's results; a phase that raises ends the run, its error kept (the tests name it)."""
    import traceback
    out = {}
    try:
        _phases(root, out)
    except Exception:  # noqa: BLE001
        out["error"] = traceback.format_exc()[-2000:]
    return out


def _phases(root, out):
    a, mesh = engine_on(1, 2, 2, 1)                 # tp 2 x cp 2, ZeRO-1, ring attention
    train(a, mesh, range(2))
    out["A2"], out["A2_rank0"] = a.full_state_dict(), a.full_state_dict(rank0_only=True)
    a.save_checkpoint(f"{root}/a")
    train(a, mesh, range(2, 3))
    out["A3"] = a.full_state_dict()

    b, mesh = engine_on(1, 2, 2, 1)                 # (a) the same mesh: resume
    b.load_checkpoint(f"{root}/a")
    train(b, mesh, range(2, 3))
    out["B3"] = b.full_state_dict()

    c, mesh = engine_on(1, 2, 2, 3, "ulysses")      # the same mesh at ZeRO-3, Ulysses
    c.load_checkpoint(f"{root}/a")
    c.save_checkpoint(f"{root}/c2")                 # right after the load: what it holds
    train(c, mesh, range(2, 3))
    out["C3"] = c.full_state_dict()

    d, mesh = engine_on(2, 2, 1, 2)                 # (c) dp 2 x tp 2: no cp
    d.load_checkpoint(f"{root}/a")
    train(d, mesh, range(2, 3))
    out["D3"] = d.full_state_dict()
    d.save_checkpoint(f"{root}/d")
    train(d, mesh, range(3, 4))
    out["D4"] = d.full_state_dict()

    e, mesh = engine_on(2, 1, 2, 2)                 # dp 2 x cp 2: no tp (a plain engine over dp x cp)
    e.load_checkpoint(f"{root}/a")
    train(e, mesh, range(2, 3))
    out["E3"] = e.full_state_dict()

    f, mesh = engine_on(1, 2, 2, 2)                 # back: saved without cp, loaded on tp 2 x cp 2 at ZeRO-2
    f.load_checkpoint(f"{root}/d")
    train(f, mesh, range(3, 4))
    out["F4"] = f.full_state_dict()

    m = zl.mesh(pp=2, cp=2)                         # a pipeline with context parallelism
    for name, call in (("initialize", lambda: zl.initialize(ContextParallelLM(**LM, comm=m.communicator("cp")),
                                                            {"optimizer": ADAM, "gradient_accumulation_steps": 2,
                                                             "zero_optimization": {"stage": 1}}, mesh=m)),
                       ("pipeline_stage", lambda: pipeline_stage(ContextParallelLM(**LM), m))):
        try:
            call()
            out[name] = None
        except Exception as err:  # noqa: BLE001
            out[name] = f"{type(err).__name__}: {err}"


def reference(steps):
    threads = torch.get_num_threads()
    torch.set_num_threads(1)   # a tiny model: one thread (two spin against the ranks' processes on a busy machine)
    try:
        return _reference(steps)
    finally:
        torch.set_num_threads(threads)


def _reference(steps):
    model = ContextParallelLM(**LM)
    opt = torch.optim.Adam(model.parameters(), **ADAM["params"])
    states = {0: {k: v.detach().clone() for k, v in model.state_dict().items()}}
    for step in range(max(steps)):
        x, y = batch(step)
        opt.zero_grad()
        logits = model(x)
        F.cross_entropy(logits.reshape(-1, logits.shape[-1]), y.reshape(-1)).backward()
        opt.step()
        if step + 1 in steps:
            states[step + 1] = {k: v.detach().clone() for k, v in model.state_dict().items()}
    return states


def got(r, key):
    assert key in r, f"the run stopped before {key}: {r.get('error')}"
    return r[key]


def worst(a, b):
    assert list(a) == list(b), sorted(set(a) ^ set(b))
    for k in a:
        assert a[k].shape == b[k].shape, (k, a[k].shape, b[k].shape)
    return max((a[k].float() - b[k].float()).abs().max().item() for k in a)


def saved_full(tag_dir):
    """Every parameter's full tensor of every state key, read from a mesh checkpoint folder."""
    from zerolab.engine.checkpoint.files import read_manifest
    from zerolab.engine.checkpoint.mesh_source import MeshSource, read_mesh_manifest

    class Whole:   # a "rank" holding every parameter whole
        flat, module = type("F", (), {"frozen": []})(), torch.nn.Module()
    man = read_mesh_manifest(tag_dir, "mesh.json", "zerolab-mesh-checkpoint", 1, read_manifest)
    desc = {"tp": 1, "tp_rank": 0, "params": {n: [p["shape"], None] for n, p in man["params"].items()}}
    src = MeshSource(tag_dir, man, Whole(), desc)
    out = {n: {k: src._full(n, k).clone() for k in KEYS} for n in man["params"]}
    src.close()
    return out


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    root = str(tmp_path_factory.mktemp("cpckpt"))
    return root, zl.launch(_worker, 4, args=(root,), timeout=300, threads=1)


def test_tp_cp_trains_like_single_process(run):
    """ZeRO-1 (ring), ZeRO-3 (Ulysses), ZeRO-2 on tp 2 x cp 2 against one process on the whole batch."""
    _, results = run
    ref = reference((2, 3, 4))
    for r in results:
        assert worst(got(r, "A2"), ref[2]) <= 1e-5, worst(r["A2"], ref[2])   # trained before any checkpoint
        diffs = {k: worst(got(r, k), ref[int(k[1])]) for k in ("A3", "C3", "F4")}
        assert all(v <= 1e-5 for v in diffs.values()), diffs
    assert worst(ref[2], ref[0]) > 1e-3   # training moved the parameters: the comparison means something


def test_full_state_dict_is_the_single_process_model(run):
    _, results = run
    want = ContextParallelLM(**LM).state_dict()
    full = got(results[0], "A2")
    assert list(full) == list(want) and all(full[k].shape == want[k].shape for k in want)   # names, order, shapes
    assert worst(full, reference((2,))[2]) <= 1e-5                                          # and values
    assert worst(got(results[0], "A2_rank0"), full) == 0
    assert all(got(r, "A2_rank0") is None for r in results[1:])
    assert all(worst(r["A2"], full) == 0 for r in results[1:])   # every rank: the same whole model


def test_resume_on_the_same_mesh_equals_the_uninterrupted_run(run):
    _, results = run
    for r in results:
        assert worst(got(r, "B3"), got(r, "A3")) <= 1e-6, worst(r["B3"], r["A3"])


def test_reload_on_other_meshes_continues_the_same(run):
    root, results = run
    for r in results:
        assert "F4" in r, r.get("error")
        diffs = {"C3 (tp2 cp2 ZeRO-3)": worst(r["C3"], r["A3"]), "D3 (dp2 tp2)": worst(r["D3"], r["A3"]),
                 "E3 (dp2 cp2)": worst(r["E3"], r["A3"]), "F4 (dp2 tp2 -> tp2 cp2)": worst(r["F4"], r["D4"])}
        assert all(v <= 1e-6 for v in diffs.values()), diffs
    # the fp32 values and Adam's moments of the cp x tp checkpoint, carried exactly into ZeRO-3 on the same mesh
    want, got = saved_full(f"{root}/a/global_step2"), saved_full(f"{root}/c2/global_step2")
    assert want.keys() == got.keys()
    for n in want:
        for k in KEYS:
            assert torch.equal(want[n][k], got[n][k]), (n, k)
    assert all(torch.equal(want[n]["fp32"].view(-1), results[0]["A2"][n].view(-1)) for n in want)
    with open(f"{root}/a/global_step2/mesh.json") as fh:
        assert json.load(fh)["mesh"] == {"dp": 1, "tp": 2, "pp": 1, "cp": 2}
    assert sorted(os.listdir(f"{root}/a/global_step2")) == ["mesh.json", "tp0_pp0", "tp1_pp0"]


def test_pipeline_with_context_parallelism_is_refused_by_name(run):
    _, results = run
    for r in results:
        for name in ("initialize", "pipeline_stage"):
            assert got(r, name) is not None and "pp=2 with cp=2" in r[name], (name, r[name])
