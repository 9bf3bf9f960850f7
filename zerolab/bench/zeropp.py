"""``python -m zerolab.bench.zeropp``: ZeRO++ against ZeRO-3 on simulated nodes (chapter 9, README).

Four CPU ranks as 2 nodes x 2 (``launch(..., ranks_per_node=2)``), TinyGPT,
bf16, the measurement settings of ``zerolab.book.zeropp`` (every micro-step
gathers each unit for forward and backward and reduces its gradients once):

* bytes: inter- and intra-node algorithm bytes per step, measured by the
  ledger, next to ``zl.comm_breakdown``'s prediction;
* speed: median step time with the intra-node link ``demo`` and a slow
  inter-node link (``--inter-gbps``, default 0.1 Gb/s = 12.5 MB/s, 200 us:
  a network sized so that a 0.3M-parameter model's traffic weighs on a CPU
  step as a large model's does on a 100 Gb/s cluster), next to the time
  model (an upper bound: the step measured without a link + alpha-beta time of the predicted
  collectives), ratio printed;
* accuracy: ``--steps`` (default 200) Adam steps per variant, the final loss
  (mean of the last 10 steps) against exact ZeRO-3; the error of one SGD
  update from the same weights; curves saved to ``zeropp.json``.

``--deepspeed`` tries DeepSpeed's own ZeRO++ on the same CPU ranks and prints
what happens (``deepspeed_probe``).
"""
from __future__ import annotations

import argparse
import json
import os
import traceback

from zerolab.book import zeropp as zp
from zerolab.runtime.launch import launch
from zerolab.theory.network import Link


def links(inter_gbps: float, latency_us: float = 200) -> dict:
    return {"intra": "demo", "inter": Link(f"inter-{inter_gbps:g}gbps", inter_gbps * 1e9 / 8, latency_us * 1e-6)}


def bytes_and_accuracy(preset: str, steps: int, timeout: float = 3600) -> dict:
    return launch(zp.measure_variants, 4, kwargs=dict(preset=preset, steps=steps), ranks_per_node=2,
                     timeout=timeout)[0]


def speed(preset: str, steps: int, inter_gbps: float, timeout: float = 1800) -> dict:
    return launch(zp.time_variants, 4, kwargs=dict(preset=preset, steps=steps, links=links(inter_gbps)),
                     ranks_per_node=2, timeout=timeout)[0]


def final_loss(row: dict, last: int = 10) -> float:
    """Mean of the last ``last`` steps' losses (one step's loss is noisy)."""
    tail = row["losses"][-last:]
    return sum(tail) / len(tail)


def report(acc: dict, times: dict, inter_gbps: float) -> str:
    lines = ["4 CPU ranks as 2 nodes x 2, bf16 TinyGPT; algorithm bytes per step per rank (measured | comm_breakdown)",
             f"{'variant':<8}{'inter-node':>22}{'intra-node':>22}{'final loss':>12}{'gap':>8}{'update err':>12}"]
    ref = final_loss(acc["ZeRO-3"])
    for name, r in acc.items():
        lines.append(f"{name:<8}{r['inter']:>11,.0f} | {r['predicted']['inter']:>8,}{r['intra']:>11,.0f} | "
                     f"{r['predicted']['intra']:>8,}{final_loss(r):>12.4f}{(final_loss(r) - ref) / ref:>8.2%}"
                     f"{r['update_error']:>12.2e}")
    lines += ["", f"step time, median of slowest rank (links: intra demo, inter {links(inter_gbps)['inter']})",
              f"{'variant':<8}{'no link':>10}{'on links':>10}{'vs ZeRO-3':>11}{'model':>10}{'measured/model':>16}"]
    base = times["ZeRO-3"]["link"]
    for name, t in times.items():
        lines.append(f"{name:<8}{t['nolink']:>9.3f}s{t['link']:>9.3f}s{base / t['link']:>10.2f}x"
                     f"{t['modelled']:>9.3f}s{t['link'] / t['modelled']:>16.2f}")
    return "\n".join(lines)


ALL_THREE = {"zero_quantized_weights": True, "zero_hpz_partition_size": 2, "zero_quantized_gradients": True}


def deepspeed_probe(flags=None, timeout: float = 300) -> str:
    """Run DeepSpeed's ZeRO++ (default: qwZ + hpZ + qgZ) for one step on 4 CPU ranks as 2 x 2;
    the outcome or the exact error (its last lines)."""
    flags = ALL_THREE if flags is None else flags

    def run():
        import deepspeed
        import torch
        from zerolab.book.models import TinyGPT, loss_fn, synthetic_batch
        model = TinyGPT.preset("micro", seed=1)
        cfg = {"train_micro_batch_size_per_gpu": 2, "bf16": {"enabled": True},
               "optimizer": {"type": "Adam", "params": {"lr": 1e-3, "torch_adam": True}},
               "zero_optimization": {"stage": 3, **flags}}
        try:
            eng, *_ = deepspeed.initialize(model=model, config=cfg, dist_init_required=False)
            x, y = synthetic_batch(model, 2, seed=0)
            loss = loss_fn(eng(x), y)
            eng.backward(loss)
            eng.step()
            return f"ran: loss {float(loss):.4f} (deepspeed {deepspeed.__version__}, torch {torch.__version__})"
        except Exception:
            return "\n".join(traceback.format_exc().strip().splitlines()[-12:])
    try:
        return launch(run, 4, ranks_per_node=2, timeout=timeout)[0]
    except Exception as err:  # noqa: BLE001 - what happened is the result
        return f"{type(err).__name__}: {err}"


def main(argv=None) -> None:
    p = argparse.ArgumentParser(prog="python -m zerolab.bench.zeropp", description=__doc__.split("\n")[0])
    p.add_argument("--preset", default="tiny")
    p.add_argument("--steps", type=int, default=200, help="training steps per variant (accuracy)")
    p.add_argument("--time-steps", type=int, default=8, help="timed steps per variant (speed)")
    p.add_argument("--inter-gbps", type=float, default=0.1)
    p.add_argument("--out", default="build/bench")
    p.add_argument("--deepspeed", action="store_true", help="also try DeepSpeed's ZeRO++ on CPU")
    a = p.parse_args(argv)
    acc = bytes_and_accuracy(a.preset, a.steps)
    times = speed(a.preset, a.time_steps, a.inter_gbps)
    print(report(acc, times, a.inter_gbps))
    result = {"preset": a.preset, "steps": a.steps, "inter_gbps": a.inter_gbps, "accuracy": acc, "speed": times}
    if a.deepspeed:
        result["deepspeed"] = {name: deepspeed_probe(flags) for name, flags in (
            ("all three", ALL_THREE), ("qwZ", {"zero_quantized_weights": True}),
            ("hpZ", {"zero_hpz_partition_size": 2}), ("qgZ", {"zero_quantized_gradients": True}))}
        for name, outcome in result["deepspeed"].items():
            print(f"\nDeepSpeed ZeRO++ on CPU, {name}:\n{outcome}")
    os.makedirs(a.out, exist_ok=True)
    with open(os.path.join(a.out, "zeropp.json"), "w") as f:
        json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
