"""ZeRO for real fine-tuning (issue 12): parameter groups, meta-device models loaded shard by
shard, bad state dicts, close() and inference at stage 3.

Every engine result is compared with plain single-process torch (``torch.optim.AdamW(groups)``)
across real processes (``zl.launch``), on world sizes that do and do not divide the units."""
from __future__ import annotations

import math

import pytest
import torch
import torch.distributed as dist

import zerolab as zl
from zerolab.book.models import MLP, TinyGPT, loss_fn, synthetic_batch
from zerolab.engine.bigmodel.load import read_safetensors, save_safetensors

STEPS, MBS = 3, 2


def gpt(meta=False, seed=1):
    if meta:
        with torch.device("meta"):
            return TinyGPT.preset("micro", key_bias=False, seed=seed)
    return TinyGPT.preset("micro", key_bias=False, seed=seed)


def groups_of(model):
    """No weight decay on biases and norms; the embeddings get their own lr and decay."""
    decay, no_decay, emb = [], [], []
    for name, p in model.named_parameters():
        (emb if name.startswith(("wte", "wpe")) else decay if p.dim() >= 2 else no_decay).append(p)
    return [{"params": decay, "weight_decay": 0.1}, {"params": no_decay, "weight_decay": 0.0},
            {"params": emb, "lr": 1e-2, "weight_decay": 0.05}]


# eps 1e-6: an element whose true gradient is ~0 turns all-reduce rounding into ±lr steps at eps 1e-8
# (1.6e-5 apart after 3 steps, with or without groups); the groups are what is under test
ADAMW = {"type": "AdamW", "params": {"lr": 3e-3, "weight_decay": 0.3, "eps": 1e-6}}


def batch(model, step, rank, n):
    return synthetic_batch(model, n * MBS, seed=7, step=step, rank=rank, world_size=n)


def train(engine, model, rank, n, steps=STEPS):
    for step in range(steps):
        x, y = batch(model, step, rank, n)
        engine.backward(loss_fn(engine(x), y))
        engine.step()


def reference(n, steps=STEPS):
    """Single process: torch.optim.AdamW over the same groups, the whole global batch."""
    model = gpt()
    opt = torch.optim.AdamW(groups_of(model), **ADAMW["params"])
    for step in range(steps):
        x, y = synthetic_batch(model, n * MBS, seed=7, step=step)   # the global batch at once
        opt.zero_grad()
        loss_fn(model(x), y).backward()
        opt.step()
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


GROUP_ZEROS = [{"stage": 0}, {"stage": 1, "reduce_bucket_size": 500}, {"stage": 2, "overlap_comm": False},
               {"stage": 3, "stage3_param_persistence_threshold": 0},
               {"stage": 3, "stage3_param_persistence_threshold": 40, "stage3_prefetch_bucket_size": 10**8},
               {"stage": 2, "offload_optimizer": {"device": "cpu"}},
               {"stage": 3, "offload_optimizer": {"device": "cpu"}, "sub_group_size": 700}]


def groups_worker():
    rank, n = dist.get_rank(), dist.get_world_size()
    out = []
    for zero in GROUP_ZEROS:
        model = gpt()
        engine = zl.initialize(model, {"optimizer": ADAMW, "zero_optimization": zero},
                               model_parameters=groups_of(model))
        train(engine, model, rank, n)
        sd = engine.full_state_dict()
        out.append(sd if rank == 0 else {k: v.sum().item() for k, v in sd.items()})
    return out


@pytest.mark.parametrize("n", [1, 2, 3])
def test_parameter_groups_equal_torch_adamw_groups(n):
    want = reference(n)
    plain = reference_without_groups(n)
    results = zl.launch(groups_worker, world_size=n, timeout=300, threads=1)
    for zero, got in zip(GROUP_ZEROS, results[0]):
        for k in want:
            torch.testing.assert_close(got[k], want[k], rtol=1e-4, atol=1e-5, msg=lambda m: f"n={n} {zero} {k}: {m}")
        for r in range(1, n):
            assert all(math.isclose(results[r][GROUP_ZEROS.index(zero)][k], float(got[k].sum()), rel_tol=1e-6,
                                    abs_tol=1e-6) for k in want)
    # the groups matter: one group with the config's decay ends elsewhere (so the test can fail)
    assert max((plain[k] - want[k]).abs().max() for k in want) > 1e-4


def reference_without_groups(n):
    model = gpt()
    opt = torch.optim.AdamW(model.parameters(), **ADAMW["params"])
    for step in range(STEPS):
        x, y = synthetic_batch(model, n * MBS, seed=7, step=step)
        opt.zero_grad()
        loss_fn(model(x), y).backward()
        opt.step()
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def test_group_runs_cover_a_shard_once_per_group():
    from zerolab.engine.groups import unit_runs
    model = gpt()
    engine = zl.initialize(model, {"optimizer": ADAMW, "zero_optimization": {"stage": 0}},
                           model_parameters=groups_of(model))
    block = next(u for u in engine.flat.units if u.name == "blocks.0")
    runs = unit_runs(block, engine.group_of, 0, block.padded)
    assert [k for _, _, k in runs] == [0, 1]                  # laid out group by group
    assert runs[0][0] == 0 and runs[-1][1] == block.padded and runs[0][1] == runs[1][0]


@pytest.mark.parametrize("groups, match", [
    ([], "empty"),
    (lambda m: [{"params": [m.wte.weight]}], "no group of model_parameters: \\['wpe.weight'"),
    (lambda m: [{"params": list(m.parameters())}, {"params": [m.ln_f.weight]}], "'ln_f.weight' is in"),
    (lambda m: [{"params": list(m.parameters()), "wd": 0.1}], "model_parameters\\[0\\]: unknown optimizer.params"),
    (lambda m: [{"params": list(m.parameters()) + [torch.zeros(3)]}], "not a parameter of the model"),
    (lambda m: [list(m.parameters())], "expected a dict with a 'params' entry"),
])
def test_bad_parameter_groups_are_named(groups, match):
    model = gpt()
    with pytest.raises(ValueError, match=match):
        zl.initialize(model, {"optimizer": ADAMW}, model_parameters=groups(model) if callable(groups) else groups)


# ---------------------------------------------------------------- meta device, load_state_dict
LOAD_ZEROS = [{"stage": 0}, {"stage": 1}, {"stage": 2},
              {"stage": 3, "stage3_param_persistence_threshold": 0},
              {"stage": 3, "stage3_param_persistence_threshold": 100}]


def load_worker(path, prec):
    rank, n = dist.get_rank(), dist.get_world_size()
    out = []
    extra = {"bf16": {"enabled": True}} if prec == "bf16" else {}
    for zero in LOAD_ZEROS:
        for meta in (True, False):
            model = gpt(meta=meta, seed=9 if meta else 1)   # the meta model's own init is overwritten
            engine = zl.initialize(model, {"optimizer": ADAMW, "zero_optimization": zero, **extra})
            if meta:
                engine.load_state_dict(path)
            loaded = engine.full_state_dict()
            train(engine, model, rank, n)
            out.append((loaded, engine.full_state_dict()))
    return out


@pytest.mark.parametrize("n, ext, prec", [(2, "pt", "fp32"), (3, "safetensors", "fp32"), (2, "safetensors", "bf16")])
def test_meta_model_loaded_shard_by_shard_equals_the_file_and_trains_the_same(tmp_path, n, ext, prec):
    sd = gpt(seed=1).state_dict()
    path = tmp_path / f"weights.{ext}"
    torch.save(sd, path) if ext == "pt" else save_safetensors(sd, path)
    for res in zl.launch(load_worker, world_size=n, args=(str(path), prec), timeout=300, threads=1):
        for k, zero in enumerate(LOAD_ZEROS):
            (loaded, trained), (built, trained_ref) = res[2 * k], res[2 * k + 1]
            for name in sd:   # exactly the file's values, in fp32 (the master at bf16)
                assert torch.equal(loaded[name], sd[name]), (n, zero, name)
                if prec == "fp32":   # a built bf16 model's master starts from its bf16 values instead
                    assert torch.equal(built[name], sd[name]), (n, zero, name)
                    assert torch.equal(trained[name], trained_ref[name]), (n, zero, name)   # then the same training


def test_safetensors_round_trip_is_memory_mapped(tmp_path):
    sd = {"a": torch.randn(3, 5), "b": torch.arange(7, dtype=torch.int64), "c": torch.randn(4).bfloat16()}
    save_safetensors(sd, tmp_path / "x.safetensors")
    got = read_safetensors(tmp_path / "x.safetensors")
    assert all(torch.equal(got[k], v) for k, v in sd.items())
    assert got["a"].untyped_storage().nbytes() == sd["a"].numel() * 4   # a view into the mapped file, no copy
    assert got["b"].data_ptr() - got["a"].data_ptr() == sd["a"].numel() * 4


def meta_reset_worker():
    model = gpt(meta=True)
    engine = zl.initialize(model, {"optimizer": ADAMW, "zero_optimization": {"stage": 3}})
    sd = engine.full_state_dict()
    train(engine, model, dist.get_rank(), dist.get_world_size())
    return sd, engine.full_state_dict()


def test_meta_model_without_state_dict_runs_reset_parameters_on_rank_0():
    (sd0, t0), (sd1, t1) = zl.launch(meta_reset_worker, world_size=2, threads=1)
    for k in sd0:
        assert torch.equal(sd0[k], sd1[k]) and torch.equal(t0[k], t1[k])   # every rank: rank 0's values
    assert sd0["blocks.0.ln1.weight"].eq(1).all() and sd0["blocks.0.fc.bias"].abs().max() > 0   # reset ran
    assert sd0["blocks.0.fc.weight"].std() > 0 and not torch.equal(t0["wte.weight"], sd0["wte.weight"])
    for k, v in sd0.items():   # every rank's shard was built (rank 0's broadcast), not left at zero
        if k.endswith("weight") and "ln" not in k:
            assert (v == 0).float().mean() < 0.01, k


class Scaled(torch.nn.Module):
    """A module owning a parameter directly, without reset_parameters."""

    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(4, 4)
        self.gain = torch.nn.Parameter(torch.ones(4))

    def forward(self, x):
        return self.lin(x) * self.gain


@pytest.mark.parametrize("stage", [0, 3])
def test_meta_parameter_without_reset_parameters_must_be_loaded(stage):
    with torch.device("meta"):
        model = Scaled()
    engine = zl.initialize(model, {"optimizer": ADAMW, "zero_optimization": {"stage": stage}})
    with pytest.raises(RuntimeError, match="'gain'.*load_state_dict"):
        engine(torch.randn(2, 4))
    engine.load_state_dict({"lin.weight": torch.eye(4), "lin.bias": torch.zeros(4), "gain": torch.full((4,), 2.0)})
    assert torch.equal(engine(torch.ones(1, 4)).detach(), torch.full((1, 4), 2.0))


@pytest.mark.parametrize("stage", [0, 3])
@pytest.mark.parametrize("edit, match", [
    (lambda sd: sd.pop("blocks.1.fc.bias"), "missing from the state dict: \\['blocks.1.fc.bias'\\]"),
    (lambda sd: sd.update(extra=torch.zeros(1)), "unexpected in the state dict.*'extra'"),
    (lambda sd: sd.update({"ln_f.weight": torch.zeros(3)}), "'ln_f.weight': \\(3,\\) in the state dict, the model "
                                                            "expects \\(32,\\)"),
])
def test_bad_state_dicts_are_named(stage, edit, match):
    sd = gpt().state_dict()
    edit(sd)
    model = gpt(seed=2)
    engine = zl.initialize(model, {"optimizer": ADAMW, "zero_optimization": {"stage": stage}})
    before = engine.full_state_dict()
    with pytest.raises(ValueError, match=match):
        engine.load_state_dict(sd)
    after = engine.full_state_dict()
    assert all(torch.equal(before[k], after[k]) for k in before)   # checked before anything is written


def test_load_state_dict_errors_for_bad_files(tmp_path):
    engine = zl.initialize(gpt(), {"optimizer": ADAMW})
    with pytest.raises(FileNotFoundError, match="no file"):
        engine.load_state_dict(tmp_path / "missing.pt")
    (tmp_path / "junk.pt").write_text("not a checkpoint")
    with pytest.raises(ValueError, match="junk.pt"):
        engine.load_state_dict(tmp_path / "junk.pt")
    missing, unexpected = engine.load_state_dict({"ln_f.weight": torch.ones(32), "x": torch.ones(1)}, strict=False)
    assert "wte.weight" in missing and unexpected == ["x"]


# ---------------------------------------------------------------- close() and inference at stage 3
def close_worker():
    rank, n = dist.get_rank(), dist.get_world_size()
    model = gpt()
    engine = zl.initialize(model, {"optimizer": ADAMW, "zero_optimization": {"stage": 3,
                                   "stage3_param_persistence_threshold": 0}})
    train(engine, model, rank, n, steps=1)
    x, _ = batch(model, 5, rank, n)
    engine.eval()
    val = engine(x)                        # validation forward, grad enabled, no backward
    after_val = engine.memory().gathered
    with torch.no_grad():
        gen = engine(x)                    # generation-style forward
    after_gen = engine.memory().gathered
    engine.train()
    sd = engine.full_state_dict()
    engine.close()
    plain = model(x)                       # no engine: a plain model
    return after_val, after_gen, torch.equal(val, gen), torch.equal(plain, gen), \
        all(torch.equal(p.detach(), sd[k]) for k, p in model.named_parameters())


def test_stage3_inference_releases_and_close_leaves_a_usable_model():
    for after_val, after_gen, same, plain_same, params_same in zl.launch(close_worker, world_size=2, threads=1):
        assert after_val == after_gen == 0
        assert same and plain_same and params_same


# ---------------------------------------------------------------- units and the wrap policy
def stack():
    torch.manual_seed(0)
    return torch.nn.Sequential(*[m for _ in range(4) for m in (torch.nn.Linear(16, 16), torch.nn.ReLU())])


def peak_worker(units):
    model = stack()
    cfg = {"optimizer": ADAMW, "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0,
                                                     "stage3_max_reuse_distance": 0, "stage3_prefetch_bucket_size": 0}}
    if units is not None:
        cfg["zerolab"] = {"units": units}
    engine = zl.initialize(model, cfg)
    seen = []
    for m in model.modules():
        m.register_forward_pre_hook(lambda *_: seen.append(engine.memory().gathered))
    for step in range(2):
        engine.backward(loss_fn(engine(torch.randn(3, 16)), torch.randn(3, 16)))
        engine.step()
    return [u.name for u in engine.flat.units], 4 * engine.peak_live_elements, max(seen), engine.memory().gathered


def test_sequential_units_are_its_layers_and_peak_gathered_is_one_layer():
    layer = 16 * 16 + 16   # elements, padded for 2 ranks: already even
    (names, peak, seen, after), _ = zl.launch(peak_worker, world_size=2, args=(None,), threads=1)
    assert names == ["0", "2", "4", "6"] and peak == seen == 4 * layer and after == 0
    (names, peak, seen, after), _ = zl.launch(peak_worker, world_size=2, args=([],), threads=1)
    assert names == ["rest"] and peak == seen == 4 * 4 * layer          # "units": [] = one unit: the model


@pytest.mark.parametrize("units, match", [("Block", "expected a list"), ([3], "expected a list"),
                                          (["Blok"], "no module of class \\['Blok'\\]")])
def test_bad_wrap_policy_is_named(units, match):
    with pytest.raises(zl.ConfigError, match=match):
        zl.initialize(gpt(), {"optimizer": ADAMW, "zerolab": {"units": units}})


def test_planted_groups_ignored_is_caught(monkeypatch):
    """Plant the bug the group test guards against (every run uses the config's hyper-parameters):
    one process, stage 1, and the comparison with torch.optim.AdamW(groups) must fail."""
    from zerolab.engine.optim import ShardedOptimizer
    runs = ShardedOptimizer.runs

    def planted(self, i, a, b, lr):
        for s, e, _, _, t in runs(self, i, a, b, lr):
            yield s, e, self.hypers[0], lr, t
    want = reference(1)
    for plant in (False, True):
        if plant:
            monkeypatch.setattr(ShardedOptimizer, "runs", planted)
        model = gpt()
        engine = zl.initialize(model, {"optimizer": ADAMW, "zero_optimization": {"stage": 1}},
                               model_parameters=groups_of(model))
        for step in range(STEPS):
            x, y = synthetic_batch(model, MBS, seed=7, step=step)
            engine.backward(loss_fn(engine(x), y))
            engine.step()
        got = engine.full_state_dict()
        close = all(torch.allclose(got[k], want[k], rtol=1e-4, atol=1e-5) for k in want)
        assert close != plant


# ---------------------------------------------------------------- the peak of initialize + load
def init_load_peak_worker(path, method, plant):
    """A meta TinyGPT "small" through initialize + load_state_dict at stage 3, in a fresh process: the
    peak of tensor bytes (``method`` "profiler": exact) or the growth of anonymous resident memory
    ("anon": RssAnon, where the file's mapped pages are not; the profiler's own ~65 MB would be), the
    steady state after, the largest unit and the model's size. ``plant``: initialize holds a full copy
    of the model meanwhile (the engine before issue 12 held three)."""
    import zerolab.engine.base as base
    from zerolab.runtime.measure import peak_memory
    if plant:
        real = base.materialize

        def whole_copy(flat, model, *a, **k):
            held = torch.ones(sum(p.numel() for p in model.parameters()))   # the full model, fp32
            out = real(flat, model, *a, **k)
            del held
            return out
        base.materialize = whole_copy
    with torch.device("meta"):
        model = TinyGPT.preset("small", seed=0)
    cfg = {"optimizer": {"type": "SGD", "params": {"lr": 0.1}},
           "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0}}
    with peak_memory(method) as meter:
        engine = zl.initialize(model, cfg)
        engine.load_state_dict(path)
    unit = 4 * max(u.padded for u in engine.flat.units)
    psi = sum(p.numel() for p in TinyGPT.preset("small", seed=0).parameters())
    return meter.peak, engine.memory().total, unit, 4 * psi


@pytest.mark.parametrize("plant", [False, True], ids=["engine", "planted whole copy"])
@pytest.mark.parametrize("method", ["profiler", "anon"])
def test_meta_initialize_and_load_peak_is_the_shard_plus_a_unit_or_two(tmp_path, method, plant):
    """Issue 12's measure: no rank holds the model while building and loading it — the peak stays
    within the steady state plus two units, in tensor bytes and in anonymous RSS; a planted whole
    copy of the model breaks the bound. (FlatParams once made every unit's full buffer before
    releasing any: the whole model, for an instant — this test found it.)"""
    path = tmp_path / "small.safetensors"
    save_safetensors(TinyGPT.preset("small", seed=0).state_dict(), path)
    for peak, steady, unit, model_bytes in zl.launch(init_load_peak_worker, world_size=2,
                                                     args=(str(path), method, plant), threads=1):
        bound = steady + 2 * unit
        assert bound + unit < steady + model_bytes       # the bound tells a whole copy apart (2 ranks, SGD)
        slack = 2**20 if method == "anon" else 0         # RSS: allocator and page rounding, 1 MiB
        assert (peak > bound + slack) if plant else (peak <= bound + slack), (method, peak, bound)
