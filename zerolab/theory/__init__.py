"""The theory: pure arithmetic on Ψ, N and links, no torch (chapters 1, 2, 7, 11).

    from zerolab import theory
    theory.estimate(7.5e9, 64, stage=3).total     # bytes per GPU       (memory)
    theory.comm_volume(7.5e9, 64, stage=3)        # bytes sent per step (comm)
    theory.ring_bytes("all_reduce", 4e9, 8)       # one collective      (network)
    theory.slowdown(...)                          # offload's PCIe/NVMe time (offload)

Files: ``checks`` (argument checks both models share), ``memory`` (model states: 16Ψ by
stage, Table 1), ``activations``, ``ds_estimate`` (DeepSpeed's estimator), ``comm``,
``network`` (links and the ring's bytes), ``nodes`` (GPUs and NICs per node: the one
topology model), ``published`` (the node model against published figures), ``plan``
(``choose_stage``), ``offload``, ``hardware`` (the presets: nodes, PCIe, NVMe, CPU Adam), ``replay`` (a traced
run's schedule on a modelled cluster; ``replay_scale``: placement and a target's size; ``shapes``: transformer
shapes and presets; ``bubble``: pipeline schedules simulated with unit costs against their bubble formulas). Nothing here imports
anything of zerolab's outside this folder.
"""
from zerolab.theory.activations import activation_memory
from zerolab.theory.checks import STAGES, check_psi_n
from zerolab.theory.comm import CommOp, comm_breakdown, comm_volume, split_intra_inter, step_comm_time
from zerolab.theory.ds_estimate import DeepSpeedEstimate, deepspeed_estimate
from zerolab.theory.memory import (DEVICES, GB, OPTIMIZERS, PRECISIONS, TABLE1_DP, TABLE1_MODELS, Estimate,
                                   bytes_per_param, estimate, format_paper_gb, gathered_working_set, table1_text,
                                   zero_table1)
from zerolab.theory.network import LINKS, OPS, Link, get_link, ring_bytes, ring_steps
from zerolab.theory.nodes import NODES, Node, get_node
from zerolab.theory.hardware import GPU, GPUS, HARDWARE, Hardware, get_hardware, offload_step_seconds
from zerolab.theory.offload import offload_seconds, slowdown
from zerolab.theory.plan import Plan, choose_stage
from zerolab.theory.replay import Cluster, Replay, ReplayError, get_cluster, replay
from zerolab.theory.shapes import SHAPES, ModelShape, get_shape

__all__ = ["STAGES", "check_psi_n", "CommOp", "comm_breakdown", "comm_volume", "split_intra_inter",
           "step_comm_time", "DEVICES", "GB", "OPTIMIZERS", "PRECISIONS", "TABLE1_DP", "TABLE1_MODELS",
           "DeepSpeedEstimate", "Estimate", "activation_memory", "bytes_per_param", "deepspeed_estimate", "estimate",
           "gathered_working_set",
           "format_paper_gb", "table1_text", "zero_table1", "LINKS", "OPS", "Link", "get_link", "ring_bytes",
           "ring_steps", "NODES", "Node", "get_node", "GPU", "GPUS", "HARDWARE", "Hardware", "get_hardware", "offload_step_seconds", "offload_seconds", "slowdown", "Plan",
           "choose_stage", "Cluster", "Replay", "ReplayError", "get_cluster", "replay", "SHAPES", "ModelShape",
           "get_shape"]
