"""``python -m zerolab bench --sweep`` (issue 28): memory per rank equals the formula at the small
size (model states exactly, the rest within 10% of the activation model), a smoke run of one point
of each preset, and the sweep's pure parts (points, specs, command line)."""
from __future__ import annotations

import json
import os

import pytest

from zerolab.bench import peers as bp
from zerolab.bench import sweep as sw
from zerolab.bench.activations import activation_bytes, largest_unit, rest_model
from zerolab.bench.sweep_report import markdown
from zerolab.book.models import PRESETS
from zerolab.cli import build_parser, main
from zerolab.theory.activations import activation_memory
from zerolab.theory.memory import estimate

KEYS = {"model", "psi", "world_size", "stage", "label", "model_state_bytes", "estimate_bytes", "peak_bytes",
        "median_ms", "floor_ms", "efficiency", "scaling", "rest_model_bytes"}


@pytest.fixture(scope="module")
def small(tmp_path_factory):
    """TinyGPT small on 2 ranks, every stage, 2 rows per rank (strong = weak: one launch per stage)."""
    out = tmp_path_factory.mktemp("sweep")
    result = sw.sweep(models=["small"], world_sizes=[2], stages=[0, 1, 2, 3], global_batch=4, micro_batch=2,
                      steps=1, repeats=1, warmup=1, out=str(out), peers=False, verbose=False, timeout=300)
    return result, out


@pytest.mark.slow
@pytest.mark.timeout(180)
def test_memory_per_rank_equals_the_formula_at_the_small_size(small):
    result, _ = small
    rows = [r for r in result["sweep"] if r["scaling"] == "strong"]
    assert sorted(r["stage"] for r in rows) == [0, 1, 2, 3]
    psi = rows[0]["psi"]
    for r in rows:
        # model states, read from engine.memory() between backward and step: the formula to the byte
        assert r["model_state_bytes"] == r["estimate_bytes"] == estimate(psi, 2, r["stage"], "fp32").total, r
        # the rest of the tensor peak: the step's activations (+ the engine's working set, stages 2-3)
        assert r["rest_bytes"] == r["peak_bytes"] - r["model_state_bytes"]
        assert r["rest_model_bytes"] == rest_model("small", 2, 2, r["stage"])
        if r["stage"] < 2:
            assert r["rest_ratio"] == pytest.approx(1.0, abs=0.10), r
        else:
            # stages 2-3 add the engine's working set of full-size units (gradient staging, gathered
            # parameters), freed as the engine sees each collective complete: how many units are alive
            # at the peak varies from run to run (TinyGPT small, 2 ranks: 1 to 4 at stage 2), so the
            # bound is the activations below and a few units above, not 10%
            unit = 4 * largest_unit("small")
            # (a full run under load saw 6.2 units alive at stage 3: issue 28 leaves this working set unexplained)
            assert 0.9 * r["step_model_bytes"] < r["rest_bytes"] < r["step_model_bytes"] + 8 * unit, r


@pytest.mark.slow
def test_sweep_writes_bench_json_figure_and_tables(small):
    result, out = small
    with open(os.path.join(out, "bench.json")) as f:
        doc = json.load(f)
    assert doc["schema"] == "zerolab-bench/1" and doc["mode"] == "sweep" and doc["runs"] == []
    assert len(doc["sweep"]) == 8 and all(KEYS <= set(r) for r in doc["sweep"])
    assert {r["scaling"] for r in doc["sweep"]} == {"strong", "weak"}   # micro batch 2 = 4 / 2: one run, both
    assert os.path.getsize(os.path.join(out, "sweep.png")) > 1000
    with open(os.path.join(out, "sweep.md")) as f:
        assert f.read() == markdown(result)
    # a compare run's bench.json in the same folder keeps its contents and gains the list
    with open(os.path.join(out, "bench.json"), "w") as f:
        json.dump(dict(schema="zerolab-bench/1", mode="compare", settings={"model": "small"}, notes=[], runs=[1]), f)
    from zerolab.bench.sweep_report import save
    save(result, str(out))
    with open(os.path.join(out, "bench.json")) as f:
        doc = json.load(f)
    assert doc["mode"] == "compare" and doc["runs"] == [1] and len(doc["sweep"]) == 8
    # a later sweep adds its points and replaces only the ones it measured again
    later = dict(result, sweep=[dict(r, model="large") for r in result["sweep"][:2]] + result["sweep"][2:3])
    save(later, str(out))
    with open(os.path.join(out, "bench.json")) as f:
        doc = json.load(f)
    assert len(doc["sweep"]) == 10 and len(doc["sweep_settings"]) == 2   # the compare doc had none


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_smoke_one_point_of_each_preset():
    """One rank, stage 0, one row per step: small, medium and large each build, train and are
    measured; the medium point also runs its peer (torch DDP)."""
    result = sw.sweep(models=["small", "medium", "large"], world_sizes=[1], stages=[0], global_batch=1,
                      micro_batch=1, steps=1, repeats=1, warmup=0, out="", verbose=False, timeout=300)
    rows = {(r["model"], r["kind"]): r for r in result["sweep"]}
    assert set(rows) == {("small", "ours"), ("medium", "ours"), ("medium", "ddp"), ("large", "ours")}
    for (model, kind), r in rows.items():
        assert r["median_ms"] > 0 and r["peak_bytes"] > r["estimate_bytes"] * 0.99, r
        if kind == "ours":
            assert r["model_state_bytes"] == r["estimate_bytes"] == 16 * r["psi"]
        else:
            assert r["model_state_bytes"] is None and r["max_abs_diff"] < 1e-5
    assert rows["large", "ours"]["psi"] == 98_474_496 and rows["medium", "ours"]["psi"] == 26_297_344


def test_groups_share_the_point_where_strong_and_weak_coincide():
    g = sw.groups(["small"], [1, 2, 4], global_batch=4, micro_batch=1)
    assert [(x["world_size"], x["batch"], x["scalings"]) for x in g] == [
        (1, 4, ["strong"]), (1, 1, ["weak"]), (2, 4, ["strong"]), (2, 2, ["weak"]), (4, 4, ["strong", "weak"])]
    with pytest.raises(ValueError, match="divisible"):
        sw.groups(["small"], [3], global_batch=4, micro_batch=1)


def test_group_specs_one_peer_per_stage_at_the_peer_model(monkeypatch):
    monkeypatch.setattr(bp, "deepspeed_available", lambda: True)
    specs = sw.group_specs("medium", [0, 1, 2, 3], 2, 4, peers=True)
    assert [s.key for s in specs] == ["ours-0", "ddp-0", "ours-1", "zero_redundancy-1", "ours-2", "deepspeed-2",
                                      "ours-3", "fsdp2-3"]
    z3 = specs[-1].cfg["zero_optimization"]
    assert z3["stage3_param_persistence_threshold"] == 0 and z3["stage3_max_reuse_distance"] == 0
    assert z3["stage3_prefetch_bucket_size"] == z3["reduce_bucket_size"] == largest_unit("medium")
    assert all(s.cfg["train_micro_batch_size_per_gpu"] == 2 for s in specs)


def test_activation_model_is_korthikanti_in_fp32_without_dropout_plus_the_loss():
    p = PRESETS["small"]
    sbh = p["seq_len"] * 2 * p["d_model"]
    k = activation_memory(p["n_layer"], p["d_model"], p["n_head"], p["seq_len"], 2, dtype_bytes=4,
                          flash_attention=True)
    assert activation_bytes("small", 2) == k - p["n_layer"] * 2 * sbh + 4 * (2 * sbh + p["seq_len"] * 2 * p["vocab"])
    assert rest_model("small", 2, 2, 3) > rest_model("small", 2, 2, 2) > rest_model("small", 2, 2, 0)


def test_cli_sweep_narrowed_to_one_point(monkeypatch):
    seen = {}
    monkeypatch.setattr(sw, "sweep", lambda **kw: seen.update(kw))
    assert main(["bench", "--sweep", "--models", "medium", "--world-sizes", "2", "--stages", "3", "--out", ""]) == 0
    assert seen["models"] == ["medium"] and seen["world_sizes"] == [2] and seen["stages"] == [3]
    assert seen["global_batch"] == 4 and seen["repeats"] == 3 and seen["steps"] == 1
    args = build_parser().parse_args(["bench", "--sweep"])
    assert args.sweep and args.models is None
    assert main(["bench", "--models", "small", "--out", ""]) == 2          # --models belongs to --sweep
    assert main(["bench", "--sweep", "--overlap", "--out", ""]) == 2


def test_where_sorts_operators_into_kinds():
    from zerolab.bench.where import kind_of
    assert kind_of("torch::autograd::AccumulateGrad") == "grad hooks"     # not "compute" for its "mul"
    assert kind_of("c10d::reduce_scatter_") == kind_of("c10d::_allgather_base_") == "collectives"
    assert kind_of("FSDP::all_gather (blocks.3)") == "peer ops"
    assert kind_of("aten::mm") == kind_of("aten::_scaled_dot_product_flash_attention_for_cpu") == "compute"
    assert kind_of("aten::copy_") == kind_of("aten::cat") == "copies"
    assert kind_of("autograd::engine::evaluate_function: AddBackward0") == "other ops"
