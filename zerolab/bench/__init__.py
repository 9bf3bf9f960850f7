"""Speed and memory against the peers (``python -m zerolab bench``, ``make bench``).

Files: ``runner`` (contenders side by side in one process tree, interleaved
rounds, ``bench.json``), ``peers`` (torch DDP, ZeroRedundancyOptimizer, FSDP2,
DeepSpeed built on the same model), ``report`` (ratios, plot), ``offload``
(``python -m zerolab.bench.offload``: the CPU Adam step and each offload tier).
"""
from zerolab.bench.report import ratios, speedups
from zerolab.bench.runner import Spec, bench, compare_specs, model_params, overlap_specs, run_world

__all__ = ["Spec", "bench", "compare_specs", "model_params", "overlap_specs", "run_world", "ratios", "speedups"]
