"""The node's shared offload tiers (host memory, NVMe) are divided among the GPUs actually on the node
(theory/offload.py, theory/hardware.py): min(n_gpus, gpus_per_node), not always gpus_per_node."""
from __future__ import annotations

import pytest

from zerolab.theory import HARDWARE, offload_seconds, offload_step_seconds
from zerolab.theory.time3d import mesh_step_times

A100 = HARDWARE["dgx-a100"]            # PCIe 25 GB/s per GPU, host memory 150 GB/s, 4 x 6 GB/s NVMe per node, 8 GPUs
ADAM, PCIE, NVME = ("optimizer: CPU Adam (host memory)", "optimizer: PCIe (grads down, params up)",
                    "optimizer: NVMe (state in and out)")


def test_one_gpu_has_the_whole_host():
    """10B, optimizer on the CPU, one GPU: 30 B per parameter at the host's 150 GB/s = 2.0 s, beside PCIe's
    4 B at 25 GB/s = 1.6 s (dividing the host by 8 GPUs that are not there said 16.0 s)."""
    t = offload_seconds(10e9, 1, 1, 1, "cpu")
    assert (t[ADAM], t[PCIE]) == (pytest.approx(2.0), pytest.approx(1.6))
    assert offload_step_seconds(10e9, 1, 1, "cpu") == pytest.approx({"offload": 1.6, "optimizer": 2.0})
    nvme = offload_seconds(10e9, 1, 1, 1, "nvme")[NVME]
    assert nvme == pytest.approx(24 * 10e9 / 24e9)                      # all four drives: 24 GB/s


@pytest.mark.parametrize("n, sharing", [(1, 1), (2, 2), (4, 4), (8, 8), (16, 8), (64, 8)])
def test_tiers_divided_by_the_gpus_on_the_node(n, sharing):
    share = A100.per_gpu(n)
    assert (share["host_memory"], share["nvme"], share["pcie"]) == (150e9 / sharing, 24e9 / sharing, 25e9)
    assert share["cpu_adam"] == pytest.approx(150e9 / 30 / sharing)
    t = offload_seconds(7e9, n, 1, 1, "nvme")
    assert t[ADAM] == pytest.approx(30 * 7e9 / n / (150e9 / sharing))
    assert t[NVME] == pytest.approx(24 * 7e9 / n / (24e9 / sharing))
    s = offload_step_seconds(7e9, n, 1, "nvme")
    assert s["optimizer"] == pytest.approx(t[ADAM]) and s["offload"] == pytest.approx(t[PCIE] + t[NVME])


def test_per_gpu_of_a_full_node_by_default():
    assert A100.per_gpu() == A100.per_gpu(8)
    with pytest.raises(ValueError, match="n_gpus"):
        A100.per_gpu(0)


def test_model_parallel_ranks_share_the_host_too():
    """3D: with TP x PP = 8 on one node there is one DP rank, but 8 GPUs still share the node's host memory."""
    kw = dict(micro_batch=1, seq=128, hidden=1024, layers=8, hardware=A100, offload_optimizer="cpu")
    t = mesh_step_times(8e9, 8, 1, 8, 1, 4, **kw)                     # DP = 1: a slice of 1e9 per GPU
    assert t["optimizer"] == pytest.approx(30 * 1e9 / (150e9 / 8))
    t16 = mesh_step_times(8e9, 16, 1, 8, 1, 4, **kw)                  # 2 nodes, DP = 2
    assert t16["optimizer"] == pytest.approx(30 * 0.5e9 / (150e9 / 8))
