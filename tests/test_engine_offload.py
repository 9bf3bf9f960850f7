"""ZeRO-Offload / ZeRO-Infinity engines (issue 6): same parameters as without offload, tiers
equal to zl.estimate, the census agrees, NVMe really lowers resident memory, bad configs refused."""
from __future__ import annotations

import gc

import pytest
import torch.distributed as dist

import zerolab as zl
from test_engine_measured import PRECISIONS, settled_census
from zerolab.runtime.measure import PeakMeter, census
from zerolab.book.models import TinyGPT, loss_fn, synthetic_batch

STEPS, GAS = 3, 2


def config(stage, prec, oo="none", op="none", path=None, opt=None):
    z = {"stage": stage, "sub_group_size": 3000, "reduce_bucket_size": 4000,
         "stage3_param_persistence_threshold": 0}
    if oo != "none":
        z["offload_optimizer"] = {"device": oo, "nvme_path": path, "buffer_count": 2}
    if op != "none":
        z["offload_param"] = {"device": op, "nvme_path": path}
    return {"optimizer": opt or {"type": "Adam", "params": {"lr": 3e-3, "weight_decay": 0.01}},
            "gradient_accumulation_steps": GAS, "gradient_clipping": 0.3, "zero_optimization": z,
            **PRECISIONS[prec]}


def train_worker(cases, path):
    """Each case trained with and without offload on this rank; rank 0 returns the max abs diff."""
    rank, n = dist.get_rank(), dist.get_world_size()
    out = []
    for case in cases:
        finals = []
        for offloaded in (False, True):
            c = dict(case, oo="none", op="none") if not offloaded else case
            model = TinyGPT.preset("micro", key_bias=False, seed=1)
            engine = zl.initialize(model, config(c["stage"], c["prec"], c["oo"], c["op"], path, c.get("opt")))
            for step in range(STEPS):
                for k in range(GAS):
                    x, y = synthetic_batch(model, 2 * n, seed=7, step=step * GAS + k, rank=rank, world_size=n)
                    engine.backward(loss_fn(engine(x), y))
                    engine.step()
            finals.append(engine.full_state_dict())
            engine.close()
        ref, got = finals
        moved = max((ref[k].float() - TinyGPT.preset("micro", key_bias=False, seed=1).state_dict()[k].float())
                    .abs().max().item() for k in ref)
        out.append((max((got[k] - ref[k]).abs().max().item() for k in ref), moved, type(engine).__name__))
    return out


def equivalence_cases():
    cases = [{"stage": s, "prec": "mixed", "oo": d, "op": "none"} for s in (1, 2, 3) for d in ("cpu", "nvme")]
    cases += [{"stage": s, "prec": "fp32", "oo": d, "op": "none"} for s, d in ((1, "cpu"), (3, "nvme"))]
    cases += [{"stage": 3, "prec": p, "oo": oo, "op": op}
              for p, oo, op in (("fp32", "none", "nvme"), ("mixed", "none", "cpu"), ("mixed", "nvme", "nvme"))]
    cases += [{"stage": 2, "prec": "mixed", "oo": "cpu", "op": "none",
               "opt": {"type": "SGD", "params": {"lr": 0.05, "momentum": 0.9, "weight_decay": 0.01}}},
              {"stage": 1, "prec": "fp32", "oo": "nvme", "op": "none",
               "opt": {"type": "AdamW", "params": {"lr": 3e-3, "weight_decay": 0.1}}},
              {"stage": 2, "prec": "fp32", "oo": "nvme", "op": "none", "opt": {"type": "SGD", "params": {"lr": 0.05}}}]
    return cases


@pytest.mark.parametrize("n", [2, 3])
def test_offloaded_runs_reach_the_same_parameters(tmp_path, n):
    cases = equivalence_cases()
    if n == 3:   # padding on every unit: a lean subset
        cases = [c for c in cases if c["oo"] == "nvme" and c["prec"] == "mixed" and "opt" not in c]
    results = zl.launch(train_worker, world_size=n, args=(cases, str(tmp_path)), timeout=300, threads=1)
    for case, (diff, moved, cls) in zip(cases, results[0]):
        assert moved > 1e-3, (case, "training did not move the parameters")
        assert diff <= 1e-5, (case, cls, diff)
        kind = {(True, False): "Offload", (False, True): "ParamOffload", (True, True): "FullOffload"}[
            (case["oo"] != "none", case["op"] != "none")]
        assert cls == f"Stage{case['stage']}{kind}Engine"
    assert list(tmp_path.iterdir()) == []


def tiers_worker(cases, path):
    rank, n = dist.get_rank(), dist.get_world_size()
    gc.collect()
    gc.freeze()
    out = []
    for stage, prec, oo, op in cases:
        base = settled_census()
        model = TinyGPT.preset("micro", seed=1)
        engine = zl.initialize(model, config(stage, prec, oo, op, path))
        x, y = synthetic_batch(model, 2, seed=3, rank=rank, world_size=n)
        loss = loss_fn(engine(x), y)
        engine.backward(loss)
        del x, y, loss
        mem = engine.memory()
        held = settled_census() - base
        mapped = engine.param_shard.untyped_storage().nbytes() if op == "nvme" else 0   # mmap'd: a tensor too
        out.append((mem.as_dict(), held, mapped, engine.flat.padded))
        engine.step()
        engine.close()
        del engine, model
    gc.unfreeze()
    return out


def test_tiers_equal_the_estimate_and_the_census(tmp_path):
    n = 2
    cases = [(s, p, d, "none") for s in (1, 2, 3) for p in PRECISIONS for d in ("cpu", "nvme")]
    cases += [(3, p, oo, op) for p in ("fp32", "mixed") for oo in ("none", "cpu", "nvme") for op in ("cpu", "nvme")]
    results = zl.launch(tiers_worker, world_size=n, args=(cases, str(tmp_path)), timeout=300, threads=1)
    for rank_results in results:
        for (stage, prec, oo, op), (mem, held, mapped, padded) in zip(cases, rank_results):
            est = zl.estimate(padded, n, stage, precision=prec, offload_optimizer=oo, offload_param=op)
            got = {k: mem[k] for k in ("params", "grads", "optimizer", "host", "nvme", "total")}
            want = {k: getattr(est, k) for k in got}
            assert got == want, (stage, prec, oo, op, got, want)
            # CPU-only: device and host are the same RAM, so the census sees both; NVMe state is not in RAM
            assert held == mem["total"] + mem["buffers"] + mem["host"] + mapped, (stage, prec, oo, op, held, mem)


def rss_worker(path):
    """TinyGPT "small" (3.7M params), bf16, stage 1 on one rank: peak RSS of init + 1 step."""
    out = {}
    for device in ("nvme", "cpu"):
        gc.collect()
        with PeakMeter("hwm") as meter:
            model = TinyGPT.preset("small", seed=1)
            cfg = config(1, "mixed", device, "none", path)
            cfg["gradient_accumulation_steps"] = 1
            cfg["zero_optimization"]["sub_group_size"] = 200_000
            engine = zl.initialize(model, cfg)
            x, y = synthetic_batch(model, 2, seed=3)
            engine.backward(loss_fn(engine(x), y))
            engine.step()
            mem = engine.memory()
            c = census().total
        out[device] = (meter.peak, mem.as_dict(), c)
        engine.close()
        del engine, model
    return out


def test_nvme_lowers_resident_memory(tmp_path):
    out = zl.launch(rss_worker, world_size=1, args=(str(tmp_path),), timeout=300)[0]
    (peak_nvme, mem_nvme, c_nvme), (peak_cpu, mem_cpu, c_cpu) = out["nvme"], out["cpu"]
    state = mem_cpu["host"] - mem_nvme["host"]   # 12 bytes/param of fp32 master + m + v
    assert state == mem_nvme["nvme"] > 40e6
    assert mem_nvme["host"] == mem_nvme["nvme"] // 3   # both keep the fp32 gradient shard (4 bytes) in RAM
    staging = mem_nvme["buffers"] - mem_cpu["buffers"]
    assert 0 < staging < state / 4
    assert c_cpu - c_nvme >= state - staging - 1e6          # census: the state is not in RAM
    assert peak_cpu - peak_nvme >= 0.6 * (state - staging), (peak_cpu, peak_nvme, state, staging)


@pytest.mark.parametrize("zero, match", [
    ({"stage": 0, "offload_optimizer": {"device": "cpu"}}, "offload_optimizer needs stage 1, 2 or 3"),
    ({"stage": 2, "offload_param": {"device": "cpu"}}, "offload_param needs stage 3"),
    ({"stage": 1, "offload_optimizer": {"device": "nvme"}}, "nvme_path is missing"),
])
def test_bad_offload_configs_are_refused(zero, match):
    with pytest.raises(zl.ConfigError, match=match):
        zl.initialize(TinyGPT.preset("micro", seed=1), {"optimizer": {"type": "Adam", "params": {}},
                                                        "zero_optimization": zero})


def _stage3_run(path, oo, op, threshold=0, fp16_power=None, edit=False):
    model = TinyGPT.preset("micro", key_bias=False, seed=1)
    cfg = config(3, "mixed", oo, op, path)
    cfg["gradient_accumulation_steps"] = 1
    cfg["zero_optimization"]["stage3_param_persistence_threshold"] = threshold
    if fp16_power is not None:
        cfg.pop("bf16")
        cfg["fp16"] = {"enabled": True, "initial_scale_power": fp16_power}
    engine = zl.initialize(model, cfg)
    for s in range(4):
        if edit and s == 2:   # rank 0 edits a block's weights in place (re-partitioned into the master)
            with zl.gathered_parameters(engine, model.blocks[0], modifier_rank=0):
                for p in model.blocks[0].parameters():
                    p.data.mul_(0.5)
        x, y = synthetic_batch(model, 2, seed=7, step=s)
        engine.backward(loss_fn(engine(x), y))
        engine.step()
    out = engine.full_state_dict(), engine.skipped_steps
    engine.close()
    return out


@pytest.mark.parametrize("kw", [{"threshold": 10**5}, {"fp16_power": 8}, {"fp16_power": 40}, {"edit": True}],
                         ids=["persistent-params", "fp16", "fp16-overflow-skips", "modifier-rank-edit"])
def test_stage3_extras_match_without_offload(tmp_path, kw):
    ref, ref_skipped = _stage3_run(str(tmp_path), "none", "none", **kw)
    assert (ref_skipped > 0) == (kw.get("fp16_power") == 40)
    for oo, op in (("cpu", "none"), ("nvme", "nvme")):
        got, skipped = _stage3_run(str(tmp_path), oo, op, **kw)
        assert skipped == ref_skipped
        assert max((got[k] - ref[k]).abs().max().item() for k in ref) <= 1e-5, (kw, oo, op)
