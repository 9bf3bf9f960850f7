"""What a gloo collective allocates beyond its tensors, measured (the sweep's working set; README's sweep).

The sweep's "rest" of the peak at stages 2-3 holds more than the activations and the engine's
own buffers. One part is the backend's: gloo allocates scratch memory inside some collectives,
which no tensor census sees. This measures it: on each rank, the resident high-water mark
(``VmHWM``, reset through ``/proc/self/clear_refs``) above the resident set just before the call,
for one collective on a tensor of ``numel`` fp32 elements (an all-gather's output, a
reduce-scatter's input, an all-reduce's tensor).

    python -m zerolab.bench.scratch            # 2 ranks, 4M elements (16 MB)

A ratio near 1.0 means the call holds a second copy of the tensor while it runs.
"""
from __future__ import annotations

import sys

CALLS = ("all_reduce", "all_gather_into_tensor", "reduce_scatter (list)", "broadcast")


def _status_kb(key: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(key + ":"):
                return int(line.split()[1])
    return 0


def _rank(numel: int) -> dict:
    import torch
    import torch.distributed as dist
    from zerolab.runtime.measure import trim_heap
    n, out = dist.get_world_size(), {}
    for name in CALLS:
        full, shard = torch.ones(numel), torch.ones(numel // n)
        dist.barrier()
        trim_heap()
        with open("/proc/self/clear_refs", "w") as f:   # VmHWM := VmRSS
            f.write("5")
        base = _status_kb("VmRSS")
        if name == "all_reduce":
            dist.all_reduce(full)
        elif name == "all_gather_into_tensor":
            dist.all_gather_into_tensor(full, shard)
        elif name == "broadcast":
            dist.broadcast(full, src=0)
        else:
            dist.reduce_scatter(shard, list(full.chunk(n)))
        out[name] = (_status_kb("VmHWM") - base) * 1024
        del full, shard
    return out


def measure(world_size: int = 2, numel: int = 4_000_000) -> dict:
    """{call: [bytes above the resident set, per rank]} for one call on ``numel`` fp32 elements."""
    from zerolab.runtime.launch import launch
    ranks = launch(_rank, world_size=world_size, args=(numel,), threads=1, timeout=300)
    return {name: [r[name] for r in ranks] for name in CALLS}


def main(argv=None) -> int:
    import argparse
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--world-size", type=int, default=2)
    ap.add_argument("--numel", type=int, default=4_000_000)
    a = ap.parse_args(argv)
    tensor = 4 * a.numel
    print(f"gloo, {a.world_size} ranks, one call on {a.numel:,} fp32 elements ({tensor / 1e6:.1f} MB): "
          f"resident memory above the tensors, per rank (measured)")
    for name, per_rank in measure(a.world_size, a.numel).items():
        print(f"  {name:<24}" + "".join(f"{b / 1e6:>8.1f} MB" for b in per_rank)
              + f"   ÷ tensor: {max(per_rank) / tensor:.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
