"""3D checkpoints (zerolab/engine/checkpoint/mesh.py) and engine.full_state_dict under a mesh, on 4 gloo ranks.

TinyGPT (untied: pipeline stages) trained on (dp 2, tp 2, pp 1), saved, loaded into (dp 4, tp 1, pp 1) at
ZeRO-3, saved in the plain format, loaded into (dp 1, tp 2, pp 2), saved, loaded into (dp 2, tp 2, pp 1) at
ZeRO-3: the fp32 values and Adam's moments carried bit for bit (each checkpoint's full tensors against the
next one's, written right after the load), the step count carried, and training continued after each
reshard equal to training continued without it. full_state_dict on (2,2,1) and (1,2,2) against
single-process training, on every rank and with rank0_only. A checkpoint of another model is refused, named."""
from __future__ import annotations

import os

import pytest
import torch

import zerolab as zl
from zerolab.book.models import TinyGPT, loss_fn, synthetic_batch
from zerolab.parallel import pipeline_stage, tensor_parallel, train_batch, vocab_parallel_cross_entropy

ADAM = {"type": "Adam", "params": {"lr": 3e-3}}
ROWS, M = 4, 2   # global batch rows per step; micro-batches per step under PP (1F1B needs m >= pp)
KEYS = ("fp32", "exp_avg", "exp_avg_sq")


def build(**kw):
    return TinyGPT.preset("micro", key_bias=False, seed=1, tie_weights=False, **kw)


def engine_on(dp, tp, pp, stage, **kw):
    mesh = zl.mesh(dp=dp, tp=tp, pp=pp)
    model = build(**kw)
    if tp > 1:
        model = tensor_parallel(model, mesh)
    if pp > 1:
        model = pipeline_stage(model, mesh)
    cfg = {"optimizer": ADAM, "gradient_accumulation_steps": M if pp > 1 else 1, "zero_optimization": {"stage": stage}}
    return zl.initialize(model, cfg, mesh=mesh), mesh


def train(engine, mesh, steps):
    """Global batch of ROWS rows per step (synthetic_batch's step), this DP rank's rows."""
    lossf = (lambda out, y: vocab_parallel_cross_entropy(out, y, mesh)) if mesh.tp > 1 else loss_fn
    rows = ROWS // mesh.dp
    for step in steps:
        x, y = synthetic_batch(build(), ROWS, seed=7, step=step)
        x, y = x[rows * mesh.dp_rank: rows * (mesh.dp_rank + 1)], y[rows * mesh.dp_rank: rows * (mesh.dp_rank + 1)]
        if mesh.pp > 1:
            h = rows // M
            train_batch(engine, mesh, [(x[i * h:(i + 1) * h], y[i * h:(i + 1) * h]) for i in range(M)], lossf)
        else:
            engine.backward(lossf(engine(x), y))
            engine.step()


def saved_full(tag_dir):
    """Every parameter's full tensor of every state key, read from a (mesh or plain) checkpoint folder."""
    from zerolab.engine.checkpoint.files import read_manifest
    from zerolab.engine.checkpoint.mesh_source import MeshSource, read_mesh_manifest

    class Whole:   # a "rank" holding every parameter whole
        flat, module, gas = type("F", (), {"frozen": []})(), torch.nn.Module(), 1
    man = read_mesh_manifest(tag_dir, "mesh.json", "zerolab-mesh-checkpoint", 1, read_manifest)
    desc = {"tp": 1, "tp_rank": 0, "params": {n: [p["shape"], None] for n, p in man["params"].items()}}
    src = MeshSource(tag_dir, man, Whole(), desc)
    out = {n: {k: src._full(n, k).clone() for k in KEYS} for n in man["params"]}
    step = src.engine["optimizer"]["step_count"]
    src.close()
    return out, step


def _worker(root):
    out = {}
    a, mesh = engine_on(2, 2, 1, 1)
    train(a, mesh, range(2))
    out["A2"], out["A2_rank0"] = a.full_state_dict(), a.full_state_dict(rank0_only=True)
    a.save_checkpoint(f"{root}/a")
    train(a, mesh, range(2, 4))
    out["A4"] = a.full_state_dict()

    b, mesh = engine_on(4, 1, 1, 3)
    b.load_checkpoint(f"{root}/a")
    b.save_checkpoint(f"{root}/b2")   # right after the load: what it holds
    train(b, mesh, range(2, 4))
    out["B4"] = b.full_state_dict()
    b.save_checkpoint(f"{root}/b")
    train(b, mesh, range(4, 6))
    out["B6"] = b.full_state_dict()

    c, mesh = engine_on(1, 2, 2, 1)
    c.load_checkpoint(f"{root}/b")
    c.save_checkpoint(f"{root}/c4")
    train(c, mesh, range(4, 6))
    out["C6"], out["C6_rank0"] = c.full_state_dict(), c.full_state_dict(rank0_only=True)
    c.save_checkpoint(f"{root}/c")
    train(c, mesh, range(6, 7))
    out["C7"] = c.full_state_dict()

    d, mesh = engine_on(2, 2, 1, 3)
    d.load_checkpoint(f"{root}/c")
    d.save_checkpoint(f"{root}/d6")
    train(d, mesh, range(6, 7))
    out["D7"] = d.full_state_dict()

    for name, kw in (("fewer_layers", {"n_layer": 1}), ("wider_vocab", {"vocab": 256})):
        e, _ = engine_on(2, 2, 1, 1, **kw)
        try:
            e.load_checkpoint(f"{root}/a")
            out[name] = None
        except Exception as err:  # noqa: BLE001
            out[name] = f"{type(err).__name__}: {err}"
    keep = ("A2_rank0", "C6_rank0", "fewer_layers", "wider_vocab")   # rank 0 returns everything
    return out if torch.distributed.get_rank() == 0 else {k: out[k] for k in keep}


def reference(steps):
    model = build()
    opt = torch.optim.Adam(model.parameters(), **ADAM["params"])
    states = {}
    for step in range(max(steps)):
        x, y = synthetic_batch(model, ROWS, seed=7, step=step)
        opt.zero_grad()
        loss_fn(model(x), y).backward()
        opt.step()
        if step + 1 in steps:
            states[step + 1] = {k: v.detach().clone() for k, v in model.state_dict().items()}
    return states


def worst(a, b):
    assert a.keys() == b.keys(), sorted(set(a) ^ set(b))
    for k in a:
        assert a[k].shape == b[k].shape, k
    return max((a[k] - b[k]).abs().max().item() for k in a)


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    root = str(tmp_path_factory.mktemp("mesh"))
    return root, zl.launch(_worker, 4, args=(root,), timeout=400, threads=1)


def test_full_state_dict_3d_matches_single_process(run):
    _, results = run
    ref = reference((2, 6))
    got = results[0]
    assert list(got["A2"]) == list(ref[2])   # the original names, in the original order
    assert worst(got["A2"], ref[2]) <= 1e-5 and worst(got["C6"], ref[6]) <= 1e-5
    assert worst(got["A2_rank0"], got["A2"]) == 0 and worst(got["C6_rank0"], got["C6"]) == 0
    for r in results[1:]:
        assert r["A2_rank0"] is None and r["C6_rank0"] is None


def test_reshard_carries_the_optimizer_state_exactly(run):
    root, results = run
    for src, dst in (("a/global_step2", "b2/global_step2"), ("b/global_step4", "c4/global_step4"),
                     ("c/global_step6", "d6/global_step6")):
        (want, step_w), (got, step_g) = saved_full(f"{root}/{src}"), saved_full(f"{root}/{dst}")
        assert step_w == step_g == int(src.rsplit("step", 1)[1])
        assert want.keys() == got.keys()
        for n in want:
            for k in KEYS:
                assert torch.equal(want[n][k], got[n][k]), (src, dst, n, k)
    assert os.path.exists(f"{root}/a/global_step2/mesh.json") and os.path.exists(f"{root}/c/global_step6/mesh.json")
    assert not os.path.exists(f"{root}/b/global_step4/mesh.json")   # (4, 1, 1): the plain format
    # the fp32 values read back from the mesh checkpoint are the engine's full state, exactly
    a2, _ = saved_full(f"{root}/a/global_step2")
    assert all(torch.equal(a2[n]["fp32"].view(-1), results[0]["A2"][n].view(-1)) for n in a2)


def test_training_continued_after_reshard_equals_without(run):
    _, results = run
    got = results[0]
    diffs = {"A4-B4": worst(got["A4"], got["B4"]), "B6-C6": worst(got["B6"], got["C6"]),
             "C7-D7": worst(got["C7"], got["D7"])}
    assert all(v <= 1e-6 for v in diffs.values()), diffs


def test_checkpoint_of_another_model_is_named(run):
    _, results = run
    for r in results:
        assert "parameter 'blocks.1.attn.k.weight' of the checkpoint is not a trainable parameter of the model" \
            in r["fewer_layers"], r["fewer_layers"]
        assert "parameter 'wte.weight' has full shape [128, 32] in the checkpoint, the model's is [256, 32]" \
            in r["wider_vocab"], r["wider_vocab"]


def _full_disk_worker(root):
    """(2, 2, 1): rank 3 (the DP group of coordinate tp 1) writes on /dev/full; nothing may hang."""
    import zerolab.engine.checkpoint.files as io
    e, mesh = engine_on(2, 2, 1, 1)
    e.save_checkpoint(root, tag="good")
    if mesh.rank == 3:
        io.open_for_write = lambda path: open("/dev/full", "wb")
    try:
        e.save_checkpoint(root, tag="bad")
        return None
    except Exception as err:  # noqa: BLE001
        return f"{type(err).__name__}: {err}"


@pytest.mark.skipif(not os.path.exists("/dev/full"), reason="needs /dev/full")
def test_a_failed_coordinate_fails_the_save_everywhere(tmp_path):
    out = zl.launch(_full_disk_worker, 4, args=(str(tmp_path),), timeout=120, threads=1)
    assert all(o and o.startswith("CheckpointError") for o in out), out
    assert "global rank 3 (dp 1, tp 1, pp 0" in out[3] and "the disk is full" in out[3], out[3]
    assert "global rank 1 (dp 0, tp 1, pp 0" in out[1], out[1]   # its DP group's partner hears of it
    assert "failed on rank 1 (2 rank(s) failed)" in out[0] and "disk is full" in out[0], out[0]
    assert sorted(os.listdir(tmp_path)) == ["good", "latest"], os.listdir(tmp_path)
    assert (tmp_path / "latest").read_text().strip() == "good"


def _tied_worker(root):
    """The head tied to the embedding: one parameter within a stage (an alias in the checkpoint), a copy on
    the first and on the last stage under pipeline parallelism (two parameters)."""
    tied = _tied_engine
    out = {}
    a, mesh = tied(1, 2, 2)
    train(a, mesh, range(1))
    a.save_checkpoint(f"{root}/ta")
    train(a, mesh, range(1, 2))
    out["a2"] = a.full_state_dict()
    b, mesh = tied(2, 2, 1)
    b.load_checkpoint(f"{root}/ta")
    train(b, mesh, range(1, 2))
    out["b2"] = b.full_state_dict()
    b.save_checkpoint(f"{root}/tb")
    train(b, mesh, range(2, 3))
    out["b3"] = b.full_state_dict()
    c, mesh = tied(1, 2, 2)
    c.load_checkpoint(f"{root}/tb")
    train(c, mesh, range(2, 3))
    out["c3"] = c.full_state_dict()
    return out if torch.distributed.get_rank() == 0 else None


def _tied_engine(dp, tp, pp):
    mesh = zl.mesh(dp=dp, tp=tp, pp=pp)
    model = TinyGPT.preset("micro", key_bias=False, seed=1)   # tied
    if tp > 1:
        model = tensor_parallel(model, mesh)
    cfg = {"optimizer": ADAM, "gradient_accumulation_steps": M if pp > 1 else 1, "zero_optimization": {"stage": 1}}
    return zl.initialize(model, cfg, mesh=mesh), mesh   # initialize cuts the stages (pp > 1)


def test_tied_weights_across_stages_reshard(tmp_path):
    got = zl.launch(_tied_worker, 4, args=(str(tmp_path),), timeout=300, threads=1)[0]
    assert got["a2"]["head.weight"].equal(got["a2"]["wte.weight"])
    diffs = {"a2-b2": worst(got["a2"], got["b2"]), "b3-c3": worst(got["b3"], got["c3"])}
    assert all(v <= 1e-6 for v in diffs.values()), diffs


def _gas_worker(root):
    """Saved under (dp 1, tp 2, pp 1) at gradient_accumulation_steps 2 after 3 steps (6 micro-steps); loaded
    at 4 and at 1 accumulation steps: the optimizer steps are what is kept, the micro-steps are counted in the
    new window (3 x 4 = 12, 3 x 1 = 3), and the next save records them."""
    import json

    def engine(gas):
        mesh = zl.mesh(dp=1, tp=2, pp=1)
        cfg = {"optimizer": ADAM, "gradient_accumulation_steps": gas, "zero_optimization": {"stage": 1}}
        return zl.initialize(tensor_parallel(build(), mesh), cfg, mesh=mesh), mesh
    a, mesh = engine(2)
    for step in range(3):
        x, y = synthetic_batch(build(), ROWS, seed=7, step=step)
        for i in range(2):
            a.backward(vocab_parallel_cross_entropy(a(x[2 * i: 2 * i + 2]), y[2 * i: 2 * i + 2], mesh))
            a.step()
    a.save_checkpoint(f"{root}/g")
    out = {"saved": (a.micro_steps, a.global_steps)}
    for gas in (4, 1):
        b, _ = engine(gas)
        b.load_checkpoint(f"{root}/g")
        b.save_checkpoint(f"{root}/g{gas}")
        with open(f"{root}/g{gas}/global_step3/tp0_pp0/shards/manifest.json") as f:
            rec = json.load(f)["engine"]
        out[gas] = (b.micro_steps, b.global_steps, rec["micro_steps"], rec["global_steps"])
    return out


def test_another_accumulation_count_keeps_the_optimizer_steps(tmp_path):
    got = zl.launch(_gas_worker, 2, args=(str(tmp_path),), timeout=200, threads=1)
    for r in got:
        assert r["saved"] == (6, 3)
        assert r[4] == (12, 3, 12, 3), r   # 3 optimizer steps, each 4 micro-steps now
        assert r[1] == (3, 3, 3, 3), r


def _gpt2_engine(dp, tp, stage):
    """Hugging Face's GPT2LMHeadModel (tiny random config, nothing downloaded; its q|k|v one fused c_attn,
    split by heads: tp_dims (0, 3)) converted by HF_GPT2_PLAN (at tp 1 too: the same Linear shapes)."""
    from transformers import GPT2Config, GPT2LMHeadModel
    from zerolab.parallel import HF_GPT2_PLAN
    mesh = zl.mesh(dp=dp, tp=tp, pp=1)
    cfg = GPT2Config(vocab_size=96, n_positions=16, n_embd=32, n_layer=2, n_head=4, resid_pdrop=0.0,
                     embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=0, eos_token_id=0, attn_implementation="eager")
    torch.manual_seed(3)
    # tensor_parallel's memo of split parameters is keyed by id(); a Conv1D's weight goes through a temporary
    # transposed Parameter (parallel/layers.as_linear), freed after its layer is built, whose id a later
    # layer's temporary may reuse: mlp.c_proj then got attn.c_proj's slice now and then ("mat1 and mat2 shapes
    # cannot be multiplied (32x64 and 16x32)"). Kept alive during the conversion here, so ids stay unique.
    import zerolab.parallel.plan as plan
    real, kept = plan.as_linear, []
    plan.as_linear = lambda m: kept.append(real(m)) or kept[-1]
    try:
        model = tensor_parallel(GPT2LMHeadModel(cfg), mesh, HF_GPT2_PLAN)
    finally:
        plan.as_linear = real
    return zl.initialize(model, {"optimizer": ADAM, "zero_optimization": {"stage": stage}}, mesh=mesh), mesh


def _gpt2_train(engine, mesh, steps):
    rows = ROWS // mesh.dp
    for step in steps:
        g = torch.Generator().manual_seed(50 + step)
        x, y = torch.randint(96, (ROWS, 8), generator=g), torch.randint(96, (ROWS, 8), generator=g)
        x, y = x[rows * mesh.dp_rank: rows * (mesh.dp_rank + 1)], y[rows * mesh.dp_rank: rows * (mesh.dp_rank + 1)]
        engine.backward(vocab_parallel_cross_entropy(engine(input_ids=x, use_cache=False).logits, y, mesh))
        engine.step()


def _gpt2_worker(root):
    """tp 2 -> tp 1 (DP 2, ZeRO-2) -> tp 2: training continued after each reshard against without."""
    out = {}
    a, mesh = _gpt2_engine(1, 2, 1)
    _gpt2_train(a, mesh, range(2))
    a.save_checkpoint(f"{root}/a")
    _gpt2_train(a, mesh, range(2, 4))
    out["A4"] = a.full_state_dict()
    b, mesh = _gpt2_engine(2, 1, 2)
    b.load_checkpoint(f"{root}/a")
    b.save_checkpoint(f"{root}/b2")   # right after the load: what it holds
    _gpt2_train(b, mesh, range(2, 4))
    out["B4"] = b.full_state_dict()
    b.save_checkpoint(f"{root}/b")
    _gpt2_train(b, mesh, range(4, 6))
    out["B6"] = b.full_state_dict()
    c, mesh = _gpt2_engine(1, 2, 1)
    c.load_checkpoint(f"{root}/b")
    c.save_checkpoint(f"{root}/c4")
    _gpt2_train(c, mesh, range(4, 6))
    out["C6"] = c.full_state_dict()
    return out if torch.distributed.get_rank() == 0 else None


def test_hf_gpt2_fused_qkv_reshards_tp2_to_tp1_and_back(tmp_path):
    """The fused q|k|v (c_attn, three blocks split by heads) is joined block by block when read at tp 1 and
    cut block by block when read at tp 2; read as one block, the heads land on the wrong rows."""
    pytest.importorskip("transformers")
    got = zl.launch(_gpt2_worker, 2, args=(str(tmp_path),), timeout=300, threads=1)[0]
    assert got["A4"]["transformer.h.0.attn.c_attn.weight"].shape == (32, 96)   # full, GPT-2's Conv1D layout (in x out)
    assert (tmp_path / "a" / "global_step2" / "mesh.json").exists() and not (tmp_path / "b" / "global_step4" /
                                                                             "mesh.json").exists()
    for src, dst in (("a/global_step2", "b2/global_step2"), ("b/global_step4", "c4/global_step4")):
        (want, _), (have, _) = saved_full(tmp_path / src), saved_full(tmp_path / dst)
        for n in want:   # what the next mesh holds right after loading: bit for bit
            assert all(torch.equal(want[n][k], have[n][k]) for k in KEYS), (src, n)
    # full_state_dict gives GPT-2's own layout (Conv1D: in x out) at tp 1 as at tp 2
    assert all(got[k]["transformer.h.0.attn.c_attn.weight"].shape == (32, 96) for k in ("A4", "B4", "B6", "C6"))
    diffs = {"tp2->tp1": worst(got["A4"], got["B4"]), "tp1->tp2": worst(got["B6"], got["C6"])}
    print(f"HF GPT-2 fused q|k|v resharded: {diffs}")
    # float rounding of TP 2 against TP 1 (measured 1.8e-6 and 1.4e-6 after two steps); the fused q|k|v
    # resharded as one block differs by 0.117
    assert all(v <= 1e-5 for v in diffs.values()), diffs
