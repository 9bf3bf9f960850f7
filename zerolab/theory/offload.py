"""Why optimizer offload is affordable and parameter offload costly: bandwidth arithmetic (chapter 7).

Per rank, per optimizer step, mixed-precision Adam (2-byte params and grads,
12-byte fp32 master + m + v), Ψ parameters, N ranks, ``gas`` micro-steps of
``tokens`` tokens each. Every term is bytes / bandwidth, nothing overlapped:

    compute          6 Ψ tokens gas / flops          forward + backward, every rank
    optimizer "cpu"  PCIe:  2Ψ/N grads down + 2Ψ/N params up         once per step
                     CPU:   read master, m, v, grad (16 B), write master, m, v,
                            16-bit param (14 B): 30 Ψ/N bytes through host memory
    optimizer "nvme" + read and write 12Ψ/N of state on the node's NVMe   once per step
    params "cpu"     PCIe:  the 2Ψ/N shard up before the forward gather and again
                            before the backward gather: 4Ψ/N            every micro-step
    params "nvme"    the same 4Ψ/N read from NVMe, plus 2Ψ/N written per step

Host memory and NVMe are shared by the GPUs of a node, so each rank gets a
1/min(N, gpus_per_node) share of them: the whole host for one GPU, an eighth on
a full node of 8. The bandwidths are a ``theory.HARDWARE``
preset (``theory.hardware``, where each number is cited). The optimizer terms do not grow with
tokens or gas; the parameter terms grow with gas and do not shrink with more
tokens per micro-step — which is the whole "when to offload" argument.
"""
from __future__ import annotations

from zerolab.theory.hardware import Hardware, get_hardware


def offload_seconds(psi, n_gpus, tokens, gas=1, optimizer="none", params="none",
                    hw: Hardware | str = "dgx-a100") -> dict:
    """Seconds per optimizer step, by term, for one rank (see the module docstring); ``hw`` a
    ``theory.HARDWARE`` preset (name or ``Hardware``)."""
    hw, shard = get_hardware(hw), psi / n_gpus
    share = hw.per_gpu(n_gpus)                 # the node's tiers over the GPUs on it: min(n_gpus, gpus_per_node)
    host_bw, nvme_bw = share["host_memory"], share["nvme"]
    out = {"compute": 6 * psi * tokens * gas / hw.flops}
    if optimizer != "none":
        out["optimizer: PCIe (grads down, params up)"] = 4 * shard / hw.pcie
        out["optimizer: CPU Adam (host memory)"] = 30 * shard / host_bw
    if optimizer == "nvme":
        out["optimizer: NVMe (state in and out)"] = 24 * shard / nvme_bw
    if params == "cpu":
        out["params: PCIe (shard up, fwd + bwd)"] = 4 * shard * gas / hw.pcie
    elif params == "nvme":
        out["params: NVMe (shard in, fwd + bwd)"] = (4 * shard * gas + 2 * shard) / nvme_bw
    return out


def slowdown(psi, n_gpus, tokens, gas=1, optimizer="none", params="none", hw: Hardware | str = "dgx-a100") -> float:
    """Fraction of extra time over compute alone, if no transfer overlaps compute (an upper bound)."""
    t = offload_seconds(psi, n_gpus, tokens, gas, optimizer, params, hw)
    return (sum(t.values()) - t["compute"]) / t["compute"]
