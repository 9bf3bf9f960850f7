"""zerolab.book.figures_plan (chapter 12): the stage-choice figure draws every candidate choose_stage weighed,
and its alt text names the choice the procedure made (a planted wrong choice is caught)."""
import dataclasses

import pytest

import zerolab as zl
from zerolab import theory
from zerolab.book.figures_plan import stage_choice_figure


@pytest.fixture(scope="module")
def plan70():
    act = zl.activation_memory(80, 8192, 64, 2048, 1, checkpointing=True)
    return zl.choose_stage(70e9, 8, 80e9, act, node=theory.NODES["dgx-a100"], margin=0.1,
                           compute_seconds=8 * 70e9 * 2048 / 150e12)


def test_figure_draws_each_candidate_and_names_the_choice(plan70):
    fig, alt = stage_choice_figure(plan70, 72e9, "70B")
    mem, time = fig.axes[:2]
    assert len(mem.patches) == len(time.patches) / 3 == len(plan70.candidates)     # comm, offload, CPU Adam stacked
    heights = [p.get_height() for p in mem.patches]
    assert heights == pytest.approx([c.device_bytes / 1e9 for c in plan70.candidates])
    assert f"Chosen: {plan70.choice.name}," in alt
    assert f"{sum(c.fits for c in plan70.candidates)} fit" in alt
    tops = [sum(p.get_height() for p in time.patches[i::len(plan70.candidates)]) for i in range(len(plan70.candidates))]
    assert tops == pytest.approx([c.step_seconds - c.times["compute"] for c in plan70.candidates])
    nvme = [c for c in plan70.candidates if c.offload_optimizer == "nvme"][0]
    assert nvme.step_seconds > plan70.choice.step_seconds            # the NVMe bar is not the no-offload bar
    assert "bound by optimizer" in alt and f"{plan70.times['optimizer']:.2f} s of CPU Adam" in alt


def test_planted_wrong_choice_changes_the_alt(plan70):
    wrong = next(c for c in plan70.candidates if c != plan70.choice)
    try:
        planted = dataclasses.replace(plan70, choice=wrong)
    except TypeError:
        pytest.skip("plan is not a dataclass")
    _, alt = stage_choice_figure(planted, 72e9, "70B")
    assert f"Chosen: {plan70.choice.name}," not in alt
