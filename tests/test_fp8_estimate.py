"""FP8 as an axis of the theory and of the Memory Explorer (chapter 1): ``zl.estimate(..., fp8=True)``
against a hand-computed table, the FP8 all-gathers at half the bf16 bytes, the explorer's ``fp8`` control,
and the "measure it" button refusing FP8 by name (the CPU engine has no FP8)."""
import pytest

import zerolab as zl
from zerolab.book.explorer import MemoryExplorer
from zerolab.theory import comm_breakdown, comm_volume, step_comm_time
from zerolab.theory.fp8 import (PLAYBOOK_RECIPES, fp8_comm_breakdown, fp8_comm_volume, fp8_recipe_table,
                                fp8_step_comm_time)

PSI = 1_000_003        # not a multiple of any N below: the shard is padded
GPT = dict(layers=36, hidden=4096, heads=32, seq_len=2048, micro_batch=1)


def hand(psi, n, stage, grad_bytes=2):
    """(params, grads, optimizer) by hand: FP8 weights 1 B, gradients grad_bytes, fp32 master + Adam 12 B."""
    s = -(-psi // n)
    return (1 * (s if stage >= 3 else psi), grad_bytes * (s if stage >= 2 else psi), 12 * (s if stage >= 1 else psi))


@pytest.mark.parametrize("n", [1, 2, 8, 64])
@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_bytes_per_gpu_equal_the_hand_table(stage, n):
    for precision, grad_bytes in (("mixed", 2), ("mixed_fp32_grads", 4)):
        e = zl.estimate(PSI, n, stage, precision=precision, fp8=True)
        assert (e.params, e.grads, e.optimizer) == hand(PSI, n, stage, grad_bytes) and e.fp8
        bf16 = zl.estimate(PSI, n, stage, precision=precision)
        s = -(-PSI // n)
        assert bf16.total - e.total == (s if stage == 3 else PSI)           # FP8 saves 1 byte of the weights only
        assert e.optimizer == bf16.optimizer and e.grads == bf16.grads


def test_per_parameter_bytes_and_the_playbook_table():
    assert zl.theory.bytes_per_param("mixed", "adam", fp8=True) == (1, 2, 12)
    assert zl.theory.bytes_per_param("mixed", "adam") == (2, 2, 12)             # the default unchanged
    for name, (parts, total) in PLAYBOOK_RECIPES.items():                         # the cited totals add up
        assert sum(parts) == total, name
    rows = {r[0]: r for r in fp8_recipe_table()}
    bf16, fp8 = rows["bf16 mixed (mixed, adam)"], rows["FP8 weights (mixed, adam)"]
    assert bf16[1:6] == PLAYBOOK_RECIPES["the above without FP32 grad accumulation"][0] and bf16[6] == 16
    assert fp8[1:7] == (4, 0, 1, 2, 8, 15)
    assert zl.estimate(70e9, 1, 0, fp8=True).total == 15 * 70e9


def test_bad_fp8_input_is_named():
    with pytest.raises(ValueError, match="fp8=True needs precision 'mixed'"):
        zl.estimate(1e9, 8, 2, precision="fp32", fp8=True)
    with pytest.raises(ValueError, match="fp8 must be True or False"):
        zl.estimate(1e9, 8, 2, fp8="yes")
    with pytest.raises(ValueError, match="fp8=True beside precision='mixed'"):
        zl.estimate(1e9, 8, 2, precision="fp8")


def test_mesh_and_experts_carry_fp8():
    e = zl.estimate(8e9, 64, 3, tp=4, fp8=True)
    assert e.params == -(-(2_000_000_000) // 16) and e.fp8
    moe = zl.estimate(8e9, 64, 3, ep=8, expert_params=6e9, fp8=True)
    assert moe.params == -(-2_000_000_000 // 64) + -(-6_000_000_000 // 8 // 8)


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_fp8_all_gathers_move_half_the_bf16_bytes(stage):
    n, g = 8, 2
    bf16, fp8 = comm_breakdown(PSI, n, stage, grad_accum=g), fp8_comm_breakdown(PSI, n, stage, grad_accum=g)
    assert [(o.op, o.what, o.count) for o in bf16] == [(o.op, o.what, o.count) for o in fp8]
    for b, f in zip(bf16, fp8):
        assert f.bytes * (2 if b.what.startswith("params") else 1) == b.bytes    # gathers halve, grads do not
    gathers = sum(o.bytes for o in bf16 if o.op == "all_gather")
    assert fp8_comm_volume(PSI, n, stage, grad_accum=g) == comm_volume(PSI, n, stage, grad_accum=g) - gathers // 2
    if stage == 3:                                         # 3M -> 2M at g = 1: both gathers halve
        assert fp8_comm_volume(PSI, n, 3) * 3 == comm_volume(PSI, n, 3) * 2
    t, t8 = step_comm_time(PSI, 64, stage, node="dgx-h100"), fp8_step_comm_time(PSI, 64, stage, "dgx-h100")
    assert t8 == t if stage == 0 else t8 < t


@pytest.fixture(scope="module")
def ex():
    return MemoryExplorer(psi=7.5e9, n_gpus=64, **GPT)


def test_explorer_fp8_changes_the_total_by_the_weights_byte(ex):
    ex.fp8.value = False
    before = ex.data["total"][:]
    ex.fp8.value = True
    after = ex.data["total"]
    shard = -(-int(7.5e9) // 64)
    assert [b - a for b, a in zip(before, after)] == [7.5e9, 7.5e9, 7.5e9, shard]
    assert ex.data["params"][3] == shard and ex.data["comm"][3] * 3 == pytest.approx(
        comm_volume(7.5e9, 64, 3) * 2, rel=1e-12)
    assert "FP8 weights" in ex.verdict and "fp8" in ex.figure.axes[0].get_title()
    ex.precision.value = "fp32"                                  # FP8 needs a master copy: a named error
    assert "fp8=True needs precision 'mixed'" in ex.verdict
    hold(ex, precision="mixed", fp8=False)
    ex.render()
    assert ex.data["total"] == before and "FP8" not in ex.verdict


def hold(ex, **values):
    """Set controls without a redraw (the measure button reads the settings only)."""
    ex._hold = True
    for k, v in values.items():
        getattr(ex, k).value = v
    ex._hold = False


def test_measure_refuses_fp8_by_name(ex):
    hold(ex, psi=1e6, n_gpus=2, layers=2, hidden=64, heads=2, seq_len=32, micro_batch=2, vocab=128, stage=2,
         fp8=True)
    from zerolab.book.explorer_model import measure, measure_refusal
    assert (measure_refusal(**ex.settings()) or "").startswith("fp8=True: ")    # before the button could run it
    reason = ex.measure()
    assert reason.startswith("fp8=True: ") and "no FP8" in reason and ex.measured is None
    assert "cannot run on this laptop: fp8=True" in ex.measure_status.value
    with pytest.raises(ValueError, match="fp8=True"):
        measure(**ex.settings())
    hold(ex, fp8=False)
    assert measure_refusal(**ex.settings()) is None          # the same shape without FP8 would be measured
