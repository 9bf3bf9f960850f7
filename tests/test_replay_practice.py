"""Chapter 12's replayed lessons (``zerolab.book.replayed_practice``): ZeRO-3's throughput loss on three
fabrics against the source articles' figures, and ``plan.times`` against the replay.

One launch of 2 ranks records one optimizer step of ZeRO-2 and of ZeRO-3 (overlap and prefetch off,
nothing persistent) and of ZeRO-3 with prefetch on a TinyGPT with Llama-2-13B's 40 layers; every test replays those traces at
Llama-2-13B's size (4096 tokens per GPU) on the three fabrics of the claim (A100 nodes: one on NVLink;
two with one 200 Gb/s InfiniBand NIC each; two with one 100 GbE NIC each).

* **Ordering.** ZeRO-3's loss grows as the fabric slows: NVLink < InfiniBand < 100 GbE; each below
  the claim, and below the third that ZeRO-3's 1.5x bytes allow when both stages overlap alike;
  fewer tokens per GPU raise every loss (the compute shrinks, the bytes do not).
* **The overlap rule** of chapter 6 and the cheat sheet: ZeRO-3 hides its traffic when the tokens
  per GPU per micro-batch exceed T = F/β (F the preset's achieved FLOP/s, β a ring across its nodes).
  Replayed with prefetch on two nodes of each preset: at 2T the step waits under 5 % of its time on
  communication, at T/2 more than 30 %.
* **plan.times.** ``zl.choose_stage``'s candidate for the same stage, node and size, its compute given
  as the replay's counted FLOPs at the preset's rate. With overlap off both add compute and
  communication, and the difference is exactly what each counts differently: the replay pays
  (N-1)·α for every collective the engine issued (one per unit, 2U at ZeRO-2 and 3U at ZeRO-3)
  where ``step_comm_time`` counts 2 and 3; the engine's small control collectives (flags), which
  ``plan`` leaves out; and the optimizer's HBM pass on the GPU, which ``plan.times`` has no term for.
  Bytes: equal (the bandwidth term is the same).
"""
from __future__ import annotations

import pytest

from zerolab.book import replayed_practice as rp

pytestmark = pytest.mark.slow
FABRICS = ("NVLink", "InfiniBand 200 Gb/s", "100 GbE")


@pytest.fixture(scope="module")
def traces():
    return rp.record({k: rp.SETTINGS[k] for k in ("ZeRO-2", "ZeRO-3", "ZeRO-3, prefetch")})


def test_the_three_fabrics_are_the_claims():
    cl = rp.fabrics()
    assert tuple(cl) == FABRICS == tuple(rp.CLAIMS)
    assert [c.nodes for c in cl.values()] == [1, 2, 2]
    assert [c.hardware.node.network_bandwidth * 8 / 1e9 for c in cl.values()][1:] == [200, 100]   # Gb/s per node
    assert len({c.hardware.flops for c in cl.values()}) == 1          # the same GPUs: only the network differs


def test_zero3_loss_grows_as_the_fabric_slows(traces):
    got = rp.losses(rp.replay_fabrics(traces))
    print({f: f"{v:.1%}" for f, v in got.items()})
    assert 0 < got["NVLink"] < got["InfiniBand 200 Gb/s"] < got["100 GbE"] < rp.BYTES_BOUND
    assert all(got[f] < rp.CLAIMS[f] for f in FABRICS)                # every claim above the replay
    assert got["InfiniBand 200 Gb/s"] > 3 * got["NVLink"]             # one NIC per node: the network shows
    fewer = rp.losses(rp.replay_fabrics(traces, model=rp.shape(seq=1024)))
    assert all(fewer[f] > got[f] for f in FABRICS)                    # fewer tokens per GPU: a larger loss


@pytest.mark.parametrize("fabric", ["NVLink", "100 GbE"])
@pytest.mark.parametrize("stage", [2, 3])
def test_plan_times_equal_the_replay_up_to_what_each_counts(traces, stage, fabric):
    chk = rp.plan_check(traces[f"ZeRO-{stage}"], rp.fabrics()[fabric], stage)
    rep, plan = chk["replay"], chk["plan"]
    extra = (chk["issued"] - chk["counted"]) * chk["alpha"]
    print(f"\nZeRO-{stage} on {fabric}: plan comm {plan['comm']:.4f} s, replay waits {rep.exposed_comm[0]:.4f} s "
          f"({chk['issued']} collectives issued, {chk['counted']} counted; control {chk['control'] * 1e3:.2f} ms; "
          f"optimizer {chk['optimizer'] * 1e3:.2f} ms)")
    assert plan["compute"] == pytest.approx(rep.flops / rep.cluster.hardware.flops, rel=1e-12)
    assert plan["offload"] == plan["optimizer"] == 0 and chk["optimizer"] > 0
    assert chk["issued"] == (2 if stage == 2 else 3) * 43 and chk["counted"] == (2 if stage == 2 else 3)
    # overlap off: every collective is waited for, so the replay's waits are its communication
    assert rep.exposed_comm[0] == pytest.approx(plan["comm"] + extra + chk["control"], rel=1e-6)
    assert rep.step_seconds == pytest.approx(chk["plan_step"] + extra + chk["control"] + chk["optimizer"], rel=1e-6)
    assert rep.step_seconds > chk["plan_step"]                         # the replay is never the optimistic one here


def test_a_persistence_threshold_is_chosen_by_the_target():
    s = rp.persistence_settings(100_000)["ZeRO-3, norms persistent"]
    assert s == {**rp.SETTINGS["ZeRO-3, prefetch"], "stage3_param_persistence_threshold": 32}
    for bad in (1_000, 30_000_000):                  # below a 13B norm; above its smallest matrix
        with pytest.raises(ValueError, match="choose one between its norm"):
            rp.persistence_settings(bad)


@pytest.mark.parametrize("preset", ["dgx-a100", "dgx-h100", "cloud-100gbe"])
def test_the_overlap_rule_of_thumb_holds_in_the_replay(traces, preset):
    from zerolab.theory.hardware import HARDWARE
    from zerolab.theory.replay import replay
    hw = HARDWARE[preset]
    threshold = hw.flops / hw.node.link_for(2 * hw.node.gpus).bandwidth      # the cheat sheet's T
    share = {}
    for mult in (0.5, 2):
        tokens = int(mult * threshold)
        seq = min(4096, tokens)
        r = replay(traces["ZeRO-3, prefetch"], f"{preset}:2", model=rp.shape(seq=seq, micro_batch=max(1, round(tokens / seq))))
        share[mult] = r.exposed_comm[0] / r.step_seconds
    print(f"\n{preset}: T = {threshold:,.0f} tokens; waiting share at T/2 {share[0.5]:.1%}, at 2T {share[2]:.1%}")
    assert share[2] < 0.05 < 0.3 < share[0.5]
