"""choose_stage (theory/plan.py): the procedure chapters 12, 14 and exercise 7 share, its
tie-break, and the seeds' rules of thumb by model size (issue 14)."""
from __future__ import annotations

import pytest

import zerolab as zl
from zerolab.theory import plan as plan_mod
from zerolab.theory.nodes import NODES

GB = 1e9
SHAPES = {6.7e9: (32, 4096, 32), 13e9: (40, 5120, 40), 20e9: (44, 6144, 48), 40e9: (60, 7168, 56),
          70e9: (80, 8192, 64), 175e9: (96, 12288, 96)}


def act(psi):
    layers, hidden, heads = SHAPES[psi]
    return zl.activation_memory(layers, hidden, heads, 2048, 1, checkpointing=True)


def test_ties_go_to_the_lower_stage():
    # 7B on one DGX A100: DDP does not fit; ZeRO-1 and ZeRO-2 send the same bytes at g = 1
    p = zl.choose_stage(6.7e9, 8, 80 * GB, act(6.7e9), node="dgx-a100")
    z1, z2 = (c for c in p.candidates if c.stage in (1, 2) and c.offload_optimizer == "none")
    assert z1.fits and z2.fits and z1.seconds == pytest.approx(z2.seconds)
    assert p.name == "ZeRO-1"
    # with accumulation ZeRO-2 sends (g+1)/2 times more: still ZeRO-1, now on time alone
    assert zl.choose_stage(6.7e9, 8, 80 * GB, act(6.7e9), node="dgx-a100", grad_accum=8).name == "ZeRO-1"


def test_planted_tie_break_by_memory_is_caught(monkeypatch):
    """Plant the other tie-break (least memory, the old chapter-11 rule): the 7B answer changes."""
    real_min = min

    def by_memory(iterable, key=None, **kw):
        items = list(iterable)
        if key is not None and items and isinstance(items[0], plan_mod.Candidate):
            return real_min(items, key=lambda c: c.device_bytes)
        return real_min(items, key=key, **kw) if key else real_min(items, **kw)
    monkeypatch.setattr(plan_mod, "min", by_memory, raising=False)
    assert zl.choose_stage(6.7e9, 8, 80 * GB, act(6.7e9), node="dgx-a100").name == "ZeRO-2"


def test_least_offload_first_and_nothing_fits():
    p = zl.choose_stage(70e9, 8, 80 * GB, act(70e9), node="dgx-a100")
    assert p.name == "ZeRO-3 + offload_optimizer=cpu"
    assert not any(c.fits for c in p.candidates if c.offload_optimizer == "none")
    tight = zl.choose_stage(70e9, 8, 80 * GB, act(70e9), node="dgx-a100", host_bytes=10 * GB)
    assert tight.choice is None or tight.choice.host_bytes <= 10 * GB
    assert zl.choose_stage(1e12, 8, 80 * GB, 10 * GB, node="dgx-a100", host_bytes=0).choice is None


@pytest.mark.parametrize("psi", [40e9, 70e9, 175e9])
def test_seed_rule_zero3_above_40b(psi):
    """Seeds: 'ZeRO-3 for models above 40B'. Agreed for 80 GB GPUs: from about 36B the 16-bit
    parameters (2Ψ) alone exceed 90 % of 80 GB, so no stage below 3 fits on any number of GPUs."""
    for n in (64, 512):
        p = zl.choose_stage(psi, n, 80 * GB, act(psi), node="dgx-a100")
        assert p.stage == 3, (psi, n, p.name)
    assert 2 * 36e9 <= 0.9 * 80 * GB < 2 * 40e9


@pytest.mark.parametrize("psi", [6.7e9, 13e9, 20e9])
def test_below_the_threshold_a_lower_stage_wins(psi):
    assert zl.choose_stage(psi, 64, 80 * GB, act(psi), node="dgx-a100").stage < 3


@pytest.mark.parametrize("psi", [70e9, 175e9])
def test_seed_rule_70b_needs_tp_depends_on_the_nics(psi):
    """Seeds: '70B+: ZeRO-3 + tensor parallelism'. Memory does not force TP (ZeRO-3 fits on 64
    GPUs); the network does: on one NIC per node communication exceeds compute, on a DGX A100's
    eight it does not — so we agree only for nodes with few NICs."""
    compute = 8 * psi * 2048 / 150e12
    eight = zl.choose_stage(psi, 64, 80 * GB, act(psi), node="dgx-a100", compute_seconds=compute)
    one = zl.choose_stage(psi, 64, 80 * GB, act(psi), node=NODES["dgx-a100"].with_nics(1), compute_seconds=compute)
    assert eight.stage == one.stage == 3
    assert eight.compute_ratio < 1 < one.compute_ratio


def test_communication_never_falls_with_the_stage():
    """Why the lower-stage tie-break makes the choice 'the lowest stage that fits': for any g the
    ring model orders DDP = ZeRO-1 <= ZeRO-2 <= ZeRO-3 (so an answer cannot depend on g)."""
    for g in (1, 2, 8):
        t = [zl.step_comm_time(13e9, 64, s, node="dgx-a100", grad_accum=g) for s in range(4)]
        assert t[0] == pytest.approx(t[1]) and t[1] <= t[2] * (1 + 1e-12) and t[2] <= t[3]


def test_allow_offload_limits_the_levels():
    p = zl.choose_stage(1e12, 8, 80 * GB, 10 * GB, node="dgx-a100", host_bytes=512 * GB, margin=0)
    assert p.name == "ZeRO-3 + offload_optimizer=nvme + offload_param=nvme"
    assert zl.choose_stage(1e12, 8, 80 * GB, 10 * GB, node="dgx-a100", host_bytes=512 * GB, margin=0,
                           allow_offload="optimizer").choice is None
    with pytest.raises(ValueError, match="allow_offload"):
        zl.choose_stage(7e9, 8, 80 * GB, node="dgx-a100", allow_offload="cpu")


def test_bad_inputs():
    with pytest.raises(ValueError, match="gpu_bytes"):
        zl.choose_stage(7e9, 8, 0, node="dgx-a100")
    with pytest.raises(ValueError, match="margin"):
        zl.choose_stage(7e9, 8, 80 * GB, node="dgx-a100", margin=1)
    with pytest.raises(ValueError, match="needs node"):
        zl.choose_stage(7e9, 8, 80 * GB)


# ---- the full step: compute, communication, offload traffic, CPU optimizer (theory.hardware) ----

def test_seventy_b_on_one_node_is_bound_by_the_cpu_adam():
    from zerolab.theory import HARDWARE, offload_seconds
    hw = HARDWARE["dgx-a100"]
    act = zl.activation_memory(80, 8192, 64, 2048, 1, checkpointing=True)
    compute = 8 * 70e9 * 2048 / hw.flops
    p = zl.choose_stage(70e9, 8, 80 * GB, act, hardware="dgx-a100", compute_seconds=compute)
    assert p.name == "ZeRO-3 + offload_optimizer=cpu"
    t = offload_seconds(70e9, 8, 2048, 1, "cpu", "none", hw)
    assert p.times["offload"] == pytest.approx(t["optimizer: PCIe (grads down, params up)"])      # 1.4 s
    assert p.times["optimizer"] == pytest.approx(t["optimizer: CPU Adam (host memory)"])          # 14 s
    assert p.binding == "optimizer" and p.times["optimizer"] > p.times["compute"] > p.times["comm"]
    assert p.choice.step_seconds == pytest.approx(sum(p.times.values()))
    nvme = next(c for c in p.candidates if c.offload_optimizer == "nvme")
    assert nvme.times["offload"] > p.times["offload"] and nvme.times["comm"] == pytest.approx(p.times["comm"])


def test_without_offload_the_binding_term_is_compute_or_comm():
    p = zl.choose_stage(7e9, 8, 80 * GB, node="dgx-a100", compute_seconds=1.0)
    assert p.times["offload"] == p.times["optimizer"] == 0 and p.binding == "compute"
    one = zl.choose_stage(7e9, 64, 80 * GB, node=NODES["dgx-a100"].with_nics(1, 1e9 / 8), compute_seconds=1.0)
    assert one.binding == "comm"


def test_hardware_presets_are_checked_and_named():
    from zerolab.theory import HARDWARE, Hardware, get_hardware
    assert get_hardware("dgx-a100") is HARDWARE["dgx-a100"]
    with pytest.raises(ValueError, match="unknown hardware"):
        get_hardware("dgx-z100")
    with pytest.raises(ValueError, match="nvme_drives"):
        HARDWARE["dgx-a100"].with_(nvme_drives=0)
    for hw in HARDWARE.values():
        assert isinstance(hw, Hardware) and hw.cpu_adam == hw.host_memory / 30 and hw.nvme == hw.nvme_drives * hw.nvme_drive
    with pytest.raises(ValueError, match="node=, link= or hardware="):
        zl.choose_stage(7e9, 8, 80 * GB)


def test_gpu_peaks_and_ridge_points():
    from zerolab.theory import GPUS
    assert [round(g.ridge) for g in GPUS.values()] == [153, 295, 206, 281]     # FLOPs per HBM byte
    assert GPUS["H200"].bf16 == GPUS["H100"].bf16 and GPUS["H200"].hbm > GPUS["H100"].hbm
