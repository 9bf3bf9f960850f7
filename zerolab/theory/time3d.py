"""How long a 3D step takes: compute, TP, PP, the bubble, DP, offload (chapter 10).

A model, nothing measured. One optimizer step on one rank of the busiest pipeline stage, nothing
overlapped, with m micro-batches per DP rank and p = ``pp`` stages:

    per micro-batch   c = compute + TP all-reduces (on NVLink) + PP sends (forward and backward)
    pipeline          (m + p - 1) · c = m·c + the bubble (p - 1)·c: a fraction (p - 1)/(m + p - 1)
    then              + DP (ZeRO over the DP group, the node's NICs) + offload (PCIe, NVMe) + CPU Adam

* compute: ``flops_per_token``·Ψ/(tp·pp) FLOPs per token of the micro-batch at the achieved FLOP/s of the
  hardware preset (``theory.hardware``: an assumption, about half the datasheet peak); 6 per parameter and
  token (forward 2, backward 4; Kaplan et al. 2020), 8 with activation recomputation.
* TP (``theory.comm3d``: Megatron's 2 + 2 all-reduces of b·s·h per block): on the node's NVLink; a TP
  group never leaves a node (``zl.mesh`` refuses it; so does this model).
* PP: each GPU sends its b·s·h activation forward and its gradient back: over NVLink when the PP
  group fits in a node (tp·pp <= GPUs per node), else over its share of the node's NICs
  (NICs x speed / GPUs per node).
* DP: the ZeRO formula (``comm_breakdown``) over the rank's slice Ψ/(tp·pp) among n/(tp·pp) ranks.
  Its ring crosses nodes when n > GPUs per node; a node holds min(tp·pp, GPUs per node) DP rings at
  once, sharing its NICs: each runs at min(NVLink, NICs x speed / min(tp·pp, GPUs per node)). At
  tp = pp = 1 that is ``theory.nodes``' ring across nodes, the rate ``step_comm_time`` uses.

Against the pipeline replay (``replay_time3d.compare``): equal when sends are free; with sends, this
model counts 2(m + p - 1) send times in series, the replayed 1F1B only those on its critical path.
"""
from __future__ import annotations

from zerolab.theory.checks import mesh_share
from zerolab.theory.comm import CommOp, comm_breakdown
from zerolab.theory.comm3d import model_parallel_ops
from zerolab.theory.hardware import HARDWARE, get_hardware, offload_step_seconds, with_node
from zerolab.theory.network import Link
from zerolab.theory.nodes import Node

GB = 10**9
PEAK_BF16 = 989e12   # H100 SXM dense bf16 (theory.hardware's GPUS, cited there); the H800 has the same compute

# HGX H800: the H100's silicon and low-precision compute with NVLink cut to 400 GB/s both ways = 200 GB/s per
# direction ("NVIDIA H800 vs H100", https://www.philisun.com/technical-analysis/nvidia-h800-vs-h100-a-technical-deep-dive-into-politically-defined-ai-chips/).
# One 400 Gb/s InfiniBand NIC per GPU: assumed, as the DGX H100 has, and as the 400G InfiniBand fabric of
# DeepSeek's H800 cluster suggests ("DeepSeek-V3 New Paper is coming!", https://nemati.ai/blog/en-US/deepseek-v3-new-paper-is-coming-unveiling-the-secrets-of-low-cost-large-model-training-through-hardware-aware-co-design).
# PCIe, CPUs, NVMe and the achieved FLOP/s (an assumption): the DGX H100 preset's.
H800 = with_node(HARDWARE["dgx-h100"], Node("HGX H800", 8, 8, 400e9 / 8, Link("nvlink-h800", 200 * GB, 3e-6)))
H800 = H800.with_(name="HGX H800")


def mesh_links(node: Node, n_gpus: int, tp: int, pp: int) -> dict:
    """{"tp", "pp", "dp": the ``Link`` each axis's traffic runs on} (module docstring)."""
    k = node.gpus
    if tp > k:
        raise ValueError(f"tp={tp} is larger than the GPUs per node ({k} on {node.name}): TP all-reduces every "
                         f"block and stays inside a node (zl.mesh refuses it too)")
    pp_link = node.intra if tp * pp <= k else node.nic_share()
    if n_gpus <= k:
        dp_link = node.intra
    else:
        bw = min(node.intra.bandwidth, node.network_bandwidth / min(tp * pp, k))
        dp_link = Link(f"{node.name} DP ring across nodes", bw, max(node.intra.latency, node.nic_latency))
    return {"tp": node.intra, "pp": pp_link, "dp": dp_link}


def _op_seconds(op, link) -> float:
    if op.op == "send":
        return op.count * (link.latency + op.nbytes / link.bandwidth)
    return op.count * link.time(op.op, op.nbytes, op.group)


def mesh_step_times(psi, n_gpus, stage, tp, pp, micro_batches, micro_batch, seq, hidden, layers, hardware="dgx-h100",
                    offload_optimizer="none", offload_param="none", dtype_bytes=2, replicated=0, compute=None,
                    flops_per_token=6, qkv_fused=True, sequence_parallel=False) -> dict:
    """Seconds per optimizer step by term: {"compute", "tp", "pp", "bubble", "dp", "offload", "optimizer"}
    (module docstring). ``micro_batches``: m per DP rank; ``micro_batch``: sequences in one;
    ``compute``: the seconds of compute one GPU spends per step (default: from the hardware's FLOP/s)."""
    hw = get_hardware(hardware)
    links = mesh_links(hw.node, n_gpus, tp, pp)
    m = micro_batches
    psi_mp, n_dp = mesh_share(psi, n_gpus, tp, pp, replicated)
    if compute is None:
        compute = flops_per_token * psi / (tp * pp) * m * micro_batch * seq / hw.flops
    _, mp = model_parallel_ops(tp, pp, m, layers, hidden, micro_batch, seq, dtype_bytes, None, hw.gpus_per_node,
                               qkv_fused, sequence_parallel)
    t = {"tp": 0.0, "pp": 0.0}
    for d in mp:
        if d["what"] != "loss" or d["axis"] == "tp":   # the 4-byte loss broadcast after the step: negligible
            t[d["axis"]] += _op_seconds(CommOp(**d), links[d["axis"]])
    per_mb = (compute + t["tp"] + t["pp"]) / m
    dp = sum(_op_seconds(op, links["dp"]) for op in comm_breakdown(psi_mp, n_dp, stage, dtype_bytes, m))
    return {"compute": compute, "tp": t["tp"], "pp": t["pp"], "bubble": (pp - 1) * per_mb, "dp": dp,
            **offload_step_seconds(psi_mp, n_dp, m, offload_optimizer, offload_param, hw, gpus=n_gpus)}


def step_time_3d(psi=175e9, tp=8, pp=4, dp=8, micro_batches=64, micro_batch=1, seq=2048, hidden=12288, layers=96,
                 stage=1, offload_optimizer="nvme", hardware=H800, recompute=False, peak=PEAK_BF16) -> dict:
    """The time model's step for one mesh, and the TFLOP/s per GPU it predicts (chapter 10).

    Defaults: the case chapter 10 quotes from its source articles — GPT-3 175B with TP=8, PP=4, DP=8
    (256 GPUs = 32 nodes of 8 H800), ZeRO-1 with the optimizer on NVMe, said to reach 182 TFLOPS per GPU.
    Cited: the shape of GPT-3 175B (96 layers, hidden 12288, sequence 2048: Brown et al. 2020, table 2.1);
    the H800's NVLink (200 GB/s per direction) and the 989 TFLOP/s dense bf16 peak (sources beside ``H800``
    and in ``theory.hardware``). Model parameters (not from the claim, which states none of them):
    one 400 Gb/s NIC per GPU,
    ``micro_batches`` per DP rank and step (the bubble's m), ``micro_batch`` sequences each, the achieved
    FLOP/s (the hardware preset's, an assumption: 450 TFLOP/s), ``recompute`` (8 instead of 6 FLOPs per
    parameter and token), PCIe, host memory and NVMe of the DGX H100 preset.

    Returns the terms of ``mesh_step_times`` (seconds), ``"step"`` (their sum), ``"tflops_per_gpu"``
    (model FLOPs, 6Ψ per token, per GPU and second), ``"mfu"`` (that over ``peak``), ``"bubble_fraction"``
    (p - 1)/(m + p - 1)."""
    n = tp * pp * dp
    terms = mesh_step_times(psi, n, stage, tp, pp, micro_batches, micro_batch, seq, hidden, layers, hardware,
                            offload_optimizer, flops_per_token=8 if recompute else 6)
    step = sum(terms.values())
    tflops = 6 * psi * dp * micro_batches * micro_batch * seq / (n * step) / 1e12
    return {**terms, "step": step, "tflops_per_gpu": tflops, "mfu": tflops * 1e12 / peak,
            "bubble_fraction": (pp - 1) / (micro_batches + pp - 1)}
