"""Speed and memory against the peers (``python -m zerolab bench``, ``make bench``).

Files: ``specs`` (who runs: one ``Spec`` per contender), ``runner`` (contenders
side by side in one process tree, interleaved rounds, ``bench.json``), ``cli``
(the command's arguments), ``sweep`` (``--sweep``: Ψ x N x stage, strong and weak
scaling, memory against the formula; ``sweep_report``, ``activations``), ``where``
(one point's step, profiled), ``peers`` (torch DDP, ZeroRedundancyOptimizer, FSDP2,
DeepSpeed built on the same model), ``report`` (ratios, plot), ``offload``
(``python -m zerolab.bench.offload``: the CPU Adam step and each offload tier),
``mesh3d`` and ``peers3d`` (``--meshes`` / ``--3d``: ours under TP and PP beside
DTensor TP + FSDP2 and ``torch.distributed.pipelining``).
"""
from zerolab.bench.report import ratios, speedups
from zerolab.bench.runner import bench, run_world
from zerolab.bench.specs import Spec, compare_specs, model_params, overlap_specs

__all__ = ["Spec", "bench", "compare_specs", "model_params", "overlap_specs", "run_world", "ratios", "speedups"]
