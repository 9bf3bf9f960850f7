"""Offload, measured: the CPU Adam step and the cost of each offload tier (chapter 7).

``adam_step_times(numel)``  seconds per Adam step over one flat fp32 tensor:
                            zerolab's offload step (torch's fused, vectorised CPU
                            kernel, the one ``OffloadOptimizer`` runs), zerolab's
                            on-device step (the same fused kernel, unit by unit),
                            torch.optim.Adam (for-loop, foreach, fused) and, where
                            it builds, DeepSpeed's CPU Adam (AVX, C++).
``tier_runs(...)``          one engine per offload mode on the same model: median
                            step time, ``memory()`` by tier, census and peak RSS.

``python -m zerolab.bench.offload`` prints both tables.
"""
from __future__ import annotations

import gc
import os
import statistics
import subprocess
import sys
import tempfile
import time

import torch

MODES = {  # name -> (offload_optimizer, offload_param)
    "no offload": ("none", "none"),
    "optimizer -> cpu": ("cpu", "none"),
    "optimizer -> nvme": ("nvme", "none"),
    "+ params -> cpu": ("cpu", "cpu"),
    "+ params -> nvme": ("nvme", "nvme"),
}


def _deepspeed_cpu_adam(numel: int, repeats: int, timeout: float) -> float | None:
    """DeepSpeed's CPU Adam in a subprocess (its JIT build may take minutes or fail); None if it fails."""
    code = f"""
import os, time, statistics, torch
os.environ.setdefault("DS_ACCELERATOR", "cpu")
torch.set_num_threads({torch.get_num_threads()})
from deepspeed.ops.adam import DeepSpeedCPUAdam
p = torch.nn.Parameter(torch.randn({numel})); p.grad = torch.randn({numel})
o = DeepSpeedCPUAdam([p], lr=1e-3, adamw_mode=False)
o.step(); ts = []
for _ in range({repeats}):
    t = time.perf_counter(); o.step(); ts.append(time.perf_counter() - t)
print("SECONDS", min(ts))
"""
    try:
        r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=timeout)
    except (subprocess.TimeoutExpired, OSError):
        return None
    for line in r.stdout.splitlines():
        if line.startswith("SECONDS"):
            return float(line.split()[1])
    return None


def adam_step_times(numel: int = 2_000_000, repeats: int = 5, deepspeed: bool = False,
                    deepspeed_timeout: float = 120) -> dict:
    """Seconds per Adam step over ``numel`` fp32 elements (one flat tensor), per implementation:
    the implementations take turns, ``repeats`` rounds, and each keeps its fastest step (on a
    shared machine the minimum is the least disturbed measurement)."""
    from types import SimpleNamespace

    from zerolab.engine.offload.optimizer import OffloadOptimizer
    from zerolab.engine.optim import ShardedOptimizer
    g = torch.randn(numel)
    steps = {}
    off = SimpleNamespace(device="cpu", pin_memory=False, nvme_path=None, buffer_count=4)
    ours = OffloadOptimizer("adam", {"lr": 1e-3}, [torch.randn(numel)], False, off)
    steps["zerolab offload step (fused CPU kernel)"] = lambda: ours.step([g], 1e-3)
    dev = ShardedOptimizer("adam", {"lr": 1e-3}, [torch.randn(numel)])
    steps["zerolab on-device step (fused, per unit)"] = lambda: dev.step([g], 1e-3)
    for name, kw in (("torch.optim.Adam (for-loop)", {"foreach": False}), ("torch.optim.Adam (foreach)", {"foreach": True}),
                     ("torch.optim.Adam (fused)", {"fused": True})):
        p = torch.nn.Parameter(torch.randn(numel))
        p.grad = g
        try:
            steps[name] = torch.optim.Adam([p], lr=1e-3, **kw).step
            steps[name]()
        except (RuntimeError, TypeError):
            steps.pop(name, None)
    best = {name: float("inf") for name in steps}
    for fn in steps.values():
        fn()  # warm-up
    for _ in range(repeats):
        for name, fn in steps.items():
            t = time.perf_counter()
            fn()
            best[name] = min(best[name], time.perf_counter() - t)
    if deepspeed:
        best["DeepSpeed CPU Adam"] = _deepspeed_cpu_adam(numel, repeats, deepspeed_timeout)
    return best


def tier_runs(preset: str = "tiny", stage: int = 3, precision: str = "mixed", steps: int = 6,
              modes=tuple(MODES), nvme_path: str | None = None, sub_group_size: int = 50_000,
              batch: int = 4) -> dict:
    """One engine per offload mode (one rank, this process). Memory: each mode built and
    stepped once on its own — memory() by tier after backward, census of the tensors it added,
    peak RSS increase. Time: then all modes step in turn, ``steps`` rounds (a shared machine
    slows them alike), median step time (forward + backward + step)."""
    from zerolab.engine import initialize

    from zerolab.runtime.measure import PeakMeter, census
    from zerolab.book.models import TinyGPT, loss_fn, synthetic_batch
    own_dir = None
    if nvme_path is None:
        own_dir = tempfile.TemporaryDirectory(prefix="zerolab-nvme-", dir=os.getcwd())
        nvme_path = own_dir.name
    out, engines = {}, {}

    def one_step(model, engine, s, report=False):
        x, y = synthetic_batch(model, batch, seed=3, step=s)
        t = time.perf_counter()
        engine.backward(loss_fn(engine(x), y))
        mem = engine.memory() if report else None
        engine.step()
        return time.perf_counter() - t, mem

    try:
        for name in modes:
            oo, op = MODES[name]
            z = {"stage": stage, "sub_group_size": sub_group_size, "stage3_param_persistence_threshold": 0}
            if oo != "none":
                z["offload_optimizer"] = {"device": oo, "nvme_path": nvme_path}
            if op != "none":
                z["offload_param"] = {"device": op, "nvme_path": nvme_path}
            cfg = {"optimizer": {"type": "Adam", "params": {"lr": 1e-3}}, "zero_optimization": z}
            if precision != "fp32":
                cfg["bf16"] = {"enabled": True}
            gc.collect()
            before = census().total
            with PeakMeter("hwm") as meter:
                model = TinyGPT.preset(preset, seed=1)
                engine = initialize(model, cfg)
                _, mem = one_step(model, engine, 0, report=True)
            out[name] = {"memory": mem.as_dict(), "census": census().total - before, "peak_rss": meter.peak,
                         "psi": engine.flat.numel, "padded": engine.flat.padded, "times": []}
            engines[name] = (model, engine)
        for s in range(1, steps + 1):
            for name, (model, engine) in engines.items():
                out[name]["times"].append(one_step(model, engine, s)[0])
        for r in out.values():
            r["step_s"] = statistics.median(r["times"])
    finally:
        for _, engine in engines.values():
            engine.close()
        engines.clear()
        if own_dir is not None:
            own_dir.cleanup()
    return out


def main() -> None:
    torch.set_num_threads(1)
    print("Adam step over 2M fp32 elements, 1 thread (fastest of 5, ms):")
    for name, s in adam_step_times(deepspeed=True).items():
        print(f"  {name:<42}{'n/a' if s is None else f'{s * 1e3:8.2f}'}")
    runs = tier_runs()
    base = runs["no offload"]["step_s"]
    print("\nTinyGPT tiny, stage 3, bf16, one rank (MB = 1e6 bytes):")
    print(f"  {'mode':<20}{'step ms':>9}{'x':>6}{'device':>9}{'host':>8}{'nvme':>8}{'buffers':>9}{'census':>8}{'peak RSS':>10}")
    for name, r in runs.items():
        m = r["memory"]
        print(f"  {name:<20}{r['step_s'] * 1e3:9.1f}{r['step_s'] / base:6.2f}{m['total'] / 1e6:9.2f}"
              f"{m['host'] / 1e6:8.2f}{m['nvme'] / 1e6:8.2f}{m['buffers'] / 1e6:9.2f}{r['census'] / 1e6:8.2f}"
              f"{r['peak_rss'] / 1e6:10.2f}")


if __name__ == "__main__":
    main()
