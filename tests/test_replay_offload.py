"""Chapter 7's clock (zerolab/book/replayed_offload.py): ZeRO-Offload's step replayed, split by term.

Synthetic traces for the arithmetic (plain unit tests, no processes: as tests/test_replay.py makes
them), and one rank traced in this process for a real trace at a target's size.
"""
from __future__ import annotations

import pytest

from zerolab.book import replayed_offload as ro
from zerolab.theory.hardware import HARDWARE
from zerolab.theory.offload import offload_seconds
from zerolab.theory.replay import replay as zl_replay
from zerolab.theory.shapes import get_shape

from test_replay import comp, opt   # the hand-made records of the replay's tests
from test_replay import meta as replay_meta

ADAM, PCIE, NVME = ("optimizer: CPU Adam (host memory)", "optimizer: PCIe (grads down, params up)",
                    "optimizer: NVMe (state in and out)")


def meta(world=1, rank=0, **kw):
    """test_replay's hand-made meta record, for an offloaded ZeRO-2 step with an fp32 master."""
    return replay_meta(world, rank=rank, **{"stage": 2, "master": True, "offload": "cpu", **kw})


def one_rank(offload="cpu", numel=10**9, flops=1e12):
    return [[meta(offload=offload), comp(0, flops), comp(0, 2 * flops, "backward"), opt(numel)]]


def test_single_gpu_is_one_gpu_with_the_whole_host():
    c = ro.single_gpu("dgx-a100")
    assert c.gpus == 1 and c.hardware.per_gpu(c.gpus)["host_memory"] == HARDWARE["dgx-a100"].host_memory
    with pytest.raises(ValueError, match="unknown hardware 'dgx-z'.*presets"):
        ro.single_gpu("dgx-z")


def test_one_gpu_cpu_adam_and_pcie_are_theory_offloads_terms():
    # 10B on one GPU of the DGX A100 preset: CPU Adam 30 x 10e9 B at the host's whole 150 GB/s = 2.0 s (not 16 s:
    # the host is not divided by the node's 8 GPUs when one GPU runs), PCIe 4 x 10e9 B at 25 GB/s = 1.6 s
    rep = ro.replay(one_rank(numel=10 * 10**9), ro.single_gpu("dgx-a100"), model=None)
    t = offload_seconds(10e9, 1, 1, 1, "cpu", hw="dgx-a100")
    got = rep.exposed()
    assert got["CPU Adam"] == pytest.approx(t[ADAM], rel=1e-12) == pytest.approx(2.0, rel=1e-12)
    assert got["PCIe"] == pytest.approx(t[PCIE], rel=1e-12) == pytest.approx(1.6, rel=1e-12)
    compute = 3e12 / HARDWARE["dgx-a100"].flops
    assert rep.step_seconds == pytest.approx(compute + 2.0 + 1.6, rel=1e-12)


def test_on_a_node_the_gpus_share_the_host_memory():
    numel = 10**9                   # each of 2 recorded ranks owns 1e9 elements: 2e9 in all, Psi/8 per GPU of the node
    traces = [[meta(world=2, rank=r), opt(numel)] for r in range(2)]
    got = ro.replay(traces, "dgx-h100", model=None).exposed()
    t = offload_seconds(2 * numel, 8, 1, 1, "cpu", hw="dgx-h100")
    assert got["CPU Adam"] == pytest.approx(t[ADAM], rel=1e-12)
    assert got["PCIe"] == pytest.approx(t[PCIE], rel=1e-12)
    assert got["CPU Adam"] == pytest.approx(30 * 2 * numel / 8 / (HARDWARE["dgx-h100"].host_memory / 8), rel=1e-12)


def test_the_split_pieces_tile_the_replayed_span_in_the_order_of_the_step():
    traces = one_rank()
    plain = zl_replay(traces, ro.single_gpu("dgx-h100"))
    rep = ro.replay(traces, ro.single_gpu("dgx-h100"), model=None)
    (_, s, e, _), = [x for x in plain.spans[0] if x[0] == "optimizer step"]
    host = [x for x in rep.spans[0] if x[3] in ro.HOST_LANES]
    assert [k for k, *_ in host] == ["PCIe: grads down", "CPU Adam", "PCIe: params up"]
    assert host[0][1] == s and host[-1][2] == pytest.approx(e, rel=1e-15)
    assert all(a[2] == b[1] for a, b in zip(host, host[1:]))            # back to back: the GPU waits throughout
    assert [x[3] for x in host] == ["PCIe", "host CPU", "PCIe"]
    assert rep.step_seconds == plain.step_seconds
    assert not [x for x in rep.spans[0] if x[0] == "optimizer step"]


def test_no_offload_no_pcie_lane_and_nothing_on_the_host():
    rep = ro.replay(one_rank(offload="none"), ro.single_gpu("dgx-h100"), model=None)
    rows, labels = rep.lanes()
    assert labels == ["rank 0 GPU compute", "rank 0 all-gather", "rank 0 reduce-scatter"]
    assert not any(ln in ro.HOST_LANES for *_, ln in rep.spans[0])
    assert rep.exposed()["PCIe"] == rep.exposed()["CPU Adam"] == 0
    assert [k for k, *_ in rep.spans[0]] == ["forward", "backward", "optimizer step"]   # on the GPU, from HBM
    on = ro.replay(one_rank(), ro.single_gpu("dgx-h100"), model=None)
    assert on.lanes()[1][3:] == ["rank 0 PCIe", "rank 0 host CPU"]


def test_fp32_copies_cross_pcie_at_four_bytes():
    # no master copy: 32-bit gradients down and 32-bit parameters up, 8 bytes per parameter; the CPU Adam is
    # charged theory.offload's 30 bytes per parameter whatever the precision (the replay's ADAM_HOST_BYTES)
    hw = HARDWARE["dgx-h100"]
    rep = ro.replay([[meta(dtype_bytes=4, master=False), opt(10**9)]], ro.single_gpu(hw), model=None)
    got = rep.exposed()
    assert got["PCIe"] == pytest.approx(8e9 / hw.pcie, rel=1e-12)
    assert got["CPU Adam"] == pytest.approx(30e9 / hw.host_memory, rel=1e-12)


def test_nvme_adds_the_drives_term():
    rep = ro.replay(one_rank(offload="nvme"), ro.single_gpu("dgx-a100"), model=None)
    t = offload_seconds(1e9, 1, 1, 1, "nvme", hw="dgx-a100")
    got = rep.exposed()
    assert (got["CPU Adam"], got["PCIe"], got["NVMe"]) == pytest.approx((t[ADAM], t[PCIE], t[NVME]), rel=1e-12)


def test_traced_step_refuses_zero3_by_name():
    from zerolab.book import replayed
    with pytest.raises(ValueError, match="'z3'.*ZeRO-3.*replayed.traced_steps"):
        ro.traced_step({"z3": replayed.config({"stage": 3})}, 2)


def test_a_recorded_step_replays_cpu_adam_as_theory_offload_at_the_target_size():
    """One rank traced in this process (TinyGPT at toy width, 2 layers) replayed at a 2-layer Llama-2-7B's size."""
    from zerolab.book import replayed
    settings = {"none": {"stage": 2}, "cpu": {"stage": 2, "offload_optimizer": {"device": "cpu"}}}
    events = ro.traced_step({n: replayed.config(z) for n, z in settings.items()}, 2)
    target = get_shape("llama-2-7b").with_(layers=2)
    reps = {n: ro.replay([ev], ro.single_gpu("dgx-h100"), model=target) for n, ev in events.items()}
    t = offload_seconds(target.params, 1, 1, 1, "cpu", hw="dgx-h100")
    got = reps["cpu"].exposed()
    assert got["CPU Adam"] == pytest.approx(t[ADAM], rel=1e-3)          # the recorded shard's padding: < 0.1 %
    assert got["PCIe"] == pytest.approx(t[PCIE], rel=1e-3)
    assert reps["cpu"].step_seconds - reps["none"].step_seconds == pytest.approx(
        t[ADAM] + t[PCIE] - target.params * 30 / HARDWARE["dgx-h100"].accelerator.hbm, rel=2e-3)
    assert reps["none"].lanes()[1] == ["rank 0 GPU compute", "rank 0 all-gather", "rank 0 reduce-scatter"]
    rows, labels = ro.measured_lanes(events["cpu"])          # the same run on this laptop's clock
    assert labels[0] == "rank 0 CPU compute" and {k for k, *_ in rows[0]} >= {"forward", "backward", "optimizer step"}
    assert min(s for row in rows for _, s, _ in row) == 0.0
    fig = ro.figure({"cpu": events["cpu"]}, {"one H100": reps})
    titles = [ax.get_title() for ax in fig.axes]
    assert "measured on this laptop" in titles[0] and all("(modelled)" in t for t in titles[1:])
    assert all(ax.get_xlabel().endswith("(ms)") for ax in fig.axes)
