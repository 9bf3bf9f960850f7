"""Resume from a checkpoint is bit-identical to never stopping (issue 11, item 2).

For each case (stage x precision x optimizer offload x schedule, always with
gradient clipping): one launch trains k+m steps uninterrupted and, separately,
k steps then ``save_checkpoint``; a second launch (fresh processes) builds a
fresh model from another seed, ``load_checkpoint``s and trains m more steps.
Losses after the resume, the final fp32 parameters, the step counters and the
loss scale must be *equal*, bit for bit. The default run covers every pair of
factor values (12 cases); the full matrix (60 cases) is marked ``slow``.
Planted bugs (moments, Adam's step count, the fp16 loss scaler or the schedule
position not restored) must each make the comparison fail.
"""
from __future__ import annotations

import itertools

import pytest
import torch

import zerolab as zl
from zerolab.book.models import TinyGPT, loss_fn, synthetic_batch
from zerolab.engine.checkpoint.state import ShiftedSchedule

K, M = 3, 3       # steps before the save, steps after the resume
ROWS = 2          # rows per rank per micro-batch

SCHEDULES = {
    "WarmupLR": {"type": "WarmupLR", "params": {"warmup_min_lr": 1e-3, "warmup_max_lr": 4e-3,
                                                "warmup_num_steps": 4, "warmup_type": "log"}},
    "WarmupDecayLR": {"type": "WarmupDecayLR", "params": {"warmup_min_lr": 1e-3, "warmup_max_lr": 4e-3,
                                                          "warmup_num_steps": 2, "total_num_steps": 8,
                                                          "warmup_type": "linear"}},
}
# fp16: a scale that overflows at first, so skipped steps and the hysteresis counter are in the state
FP16 = {"enabled": True, "initial_scale_power": 18, "loss_scale_window": 2, "hysteresis": 2}

# every pair of (stage, precision, offload, schedule) values appears in at least one case
PAIRWISE = [(0, "fp32", "none", "WarmupLR"), (0, "bf16", "none", "WarmupDecayLR"), (0, "fp16", "none", "WarmupLR"),
            (1, "fp32", "cpu", "WarmupDecayLR"), (1, "bf16", "nvme", "WarmupLR"), (1, "fp16", "none", "WarmupDecayLR"),
            (2, "fp32", "nvme", "WarmupLR"), (2, "bf16", "none", "WarmupDecayLR"), (2, "fp16", "cpu", "WarmupLR"),
            (3, "fp32", "none", "WarmupDecayLR"), (3, "bf16", "cpu", "WarmupLR"), (3, "fp16", "nvme", "WarmupDecayLR")]
FULL = [c for c in itertools.product(range(4), ("fp32", "bf16", "fp16"), ("none", "cpu", "nvme"), SCHEDULES)
        if c[0] > 0 or c[2] == "none"]


def make_config(case, nvme_dir, index):
    stage, prec, offload, sched = case
    zero = {"stage": stage, "reduce_bucket_size": 3000, "allgather_bucket_size": 3000,
            "stage3_param_persistence_threshold": 100}
    if offload != "none":
        zero["offload_optimizer"] = {"device": offload, "nvme_path": nvme_dir} if offload == "nvme" \
            else {"device": "cpu"}
        zero["sub_group_size"] = 2500   # several pieces per unit
    cfg = {"optimizer": {"type": "AdamW", "params": {"lr": 4e-3, "weight_decay": 0.01}},
           "gradient_clipping": 0.05, "gradient_accumulation_steps": 1 + index % 2,
           "scheduler": SCHEDULES[sched], "zero_optimization": zero}
    if prec == "bf16":
        cfg["bf16"] = {"enabled": True}
    elif prec == "fp16":
        cfg["fp16"] = dict(FP16)
    return cfg


def train(engine, model, first, steps):
    rank, n, gas = engine.rank, engine.world_size, engine.gas
    losses = []
    for step in range(first, first + steps):
        for k in range(gas):
            x, y = synthetic_batch(model, n * ROWS, seed=5, step=step * gas + k, rank=rank, world_size=n)
            loss = loss_fn(engine(x), y)
            engine.backward(loss)
            engine.step()
            losses.append(loss.item())
    return losses


def summary(engine, losses):
    sd = engine.full_state_dict()
    return {"losses": losses, "state": sd if engine.rank == 0 else None, "global_steps": engine.global_steps,
            "skipped_steps": engine.skipped_steps, "micro_steps": engine.micro_steps,
            "loss_scale": engine.loss_scale, "lr": engine.get_lr()}


def first_run(cases, root):
    """Uninterrupted k+m steps, then k steps and a save, for every case."""
    out = []
    for i, case in enumerate(cases):
        cfg = make_config(case, root, i)
        model = TinyGPT.preset("micro", key_bias=False, seed=1)
        engine = zl.initialize(model, cfg)
        full = summary(engine, train(engine, model, 0, K + M))
        engine.close()
        model = TinyGPT.preset("micro", key_bias=False, seed=1)
        engine = zl.initialize(model, cfg)
        train(engine, model, 0, K)
        engine.save_checkpoint(f"{root}/case{i}")
        engine.close()
        out.append(full)
    return out


def plant_bug(engine, plant):
    """The bugs the comparison must catch: one piece of state not restored."""
    if plant == "moments":
        for s in engine.optimizer.state:
            s.zero_()
    elif plant == "step_count":     # Adam's bias correction restarts
        engine.optimizer.step_count = 0
    elif plant == "scaler":         # the fp16 loss scale back to its initial value
        engine.scaler.load_state_dict({"scale": 2.0 ** FP16["initial_scale_power"], "iteration": 0,
                                       "last_overflow": -1, "hysteresis_left": FP16["hysteresis"]})
    elif plant == "schedule":       # the learning-rate schedule restarts at step 0
        engine.scheduler = ShiftedSchedule(engine.scheduler, -engine.optimizer.step_count)


def resumed_run(cases, root, plant=None):
    """Fresh processes, a model from another seed: load, then m more steps."""
    out = []
    for i, case in enumerate(cases):
        model = TinyGPT.preset("micro", key_bias=False, seed=99)
        engine = zl.initialize(model, make_config(case, root, i))
        path, client = engine.load_checkpoint(f"{root}/case{i}")
        assert path is not None and client == {}
        plant_bug(engine, plant)
        out.append(summary(engine, train(engine, model, K, M)))
        engine.close()
    return out


def check(cases, full, resumed):
    for case, a, b in zip(cases, full, resumed):
        assert len(b["losses"]) * (K + M) == len(a["losses"]) * M, case
        tail = a["losses"][-len(b["losses"]):]
        assert tail == b["losses"], (case, tail, b["losses"])
        for key in ("global_steps", "skipped_steps", "micro_steps", "loss_scale", "lr"):
            assert a[key] == b[key], (case, key, a[key], b[key])
        assert a["state"].keys() == b["state"].keys()
        for name, t in a["state"].items():
            assert torch.equal(t, b["state"][name]), (case, name, (t - b["state"][name]).abs().max())


def run_matrix(cases, tmp_path, n=2):
    root = str(tmp_path)
    full = zl.launch(first_run, world_size=n, args=(cases, root), timeout=600, threads=1)[0]
    resumed = zl.launch(resumed_run, world_size=n, args=(cases, root), timeout=600, threads=1)[0]
    return full, resumed


def test_resume_is_bit_identical_pairwise(tmp_path):
    full, resumed = run_matrix(PAIRWISE, tmp_path)
    check(PAIRWISE, full, resumed)
    fp16 = [a for c, a in zip(PAIRWISE, full) if c[1] == "fp16"]
    assert all(a["skipped_steps"] > 0 for a in fp16), "fp16 cases never skipped a step: the scaler is untested"


@pytest.mark.parametrize("plant", ["moments", "step_count", "scaler", "schedule"])
def test_resume_planted_bug_is_caught(tmp_path, plant):
    """One piece of state not restored after the load: the comparison fails."""
    cases = [(1, "fp16" if plant == "scaler" else "fp32", "none", "WarmupLR")]
    root = str(tmp_path)
    full = zl.launch(first_run, world_size=2, args=(cases, root), timeout=300, threads=1)[0]
    bad = zl.launch(resumed_run, world_size=2, args=(cases, root, plant), timeout=300, threads=1)[0]
    with pytest.raises(AssertionError):
        check(cases, full, bad)


def test_resume_is_bit_identical_on_three_ranks(tmp_path):
    """N = 3 divides neither Ψ nor the units: the padded last shard is saved and restored too."""
    cases = [(0, "bf16", "none", "WarmupLR"), (1, "fp16", "cpu", "WarmupDecayLR"),
             (2, "fp32", "nvme", "WarmupLR"), (3, "bf16", "none", "WarmupDecayLR")]
    full, resumed = run_matrix(cases, tmp_path, n=3)
    check(cases, full, resumed)


@pytest.mark.slow
def test_resume_is_bit_identical_full_matrix(tmp_path):
    full, resumed = run_matrix(FULL, tmp_path)
    check(FULL, full, resumed)


def test_resume_with_more_accumulation_steps_waits_for_a_whole_window(tmp_path):
    """Saved after 3 micro-steps with gradient_accumulation_steps 1, loaded by an engine that accumulates
    2: the first micro-batch after the load must not step (the window has one of its two). Carrying the
    raw micro-step count (3) would make it step after one micro-batch, with half the gradient."""
    def build(gas):
        model = TinyGPT.preset("micro", seed=0)
        return model, zl.initialize(model, {"optimizer": {"type": "Adam", "params": {"lr": 1e-2}},
                                            "gradient_accumulation_steps": gas, "zero_optimization": {"stage": 1}})
    model, engine = build(1)
    for i in range(3):
        x, y = synthetic_batch(model, 2, step=i)
        engine.backward(loss_fn(engine(x), y))
        engine.step()
    engine.save_checkpoint(str(tmp_path), tag="t3")
    model2, engine2 = build(2)
    engine2.load_checkpoint(str(tmp_path))
    before = {k: v.clone() for k, v in engine2.full_state_dict().items()}
    x, y = synthetic_batch(model2, 2, step=3)
    engine2.backward(loss_fn(engine2(x), y))
    engine2.step()
    assert all(torch.equal(before[k], v) for k, v in engine2.full_state_dict().items()), "stepped mid-window"
    x, y = synthetic_batch(model2, 2, step=4)
    engine2.backward(loss_fn(engine2(x), y))
    engine2.step()
    assert any(not torch.equal(before[k], v) for k, v in engine2.full_state_dict().items()), "never stepped"
    assert engine2.global_steps == 4
