"""Mutants of chapter 7's replayed offload step (book/replayed_offload.py)."""
from mutants import Mutant

T = "tests/test_replay_offload.py"
F = "zerolab/book/replayed_offload.py"
MUTANTS = [
    Mutant("offload-single-gpu-is-a-node", F,
           'node = Node(f"one {hw.accelerator.name}", 1, 1,',
           'node = Node(f"one {hw.accelerator.name}", hw.node.gpus, 1,',
           (f"{T}::test_single_gpu_is_one_gpu_with_the_whole_host",),
           "the single-GPU cluster is a whole node: its host memory divided by 8 GPUs that are not there"),
    Mutant("offload-host-share-of-one-gpu", F,
           "t = offload_seconds(1e9, cluster.gpus, 1, 1, device, hw=cluster.hardware)",
           "t = offload_seconds(1e9, 1, 1, 1, device, hw=cluster.hardware)",
           (f"{T}::test_on_a_node_the_gpus_share_the_host_memory",),
           "the split gives each GPU of a node the whole host: CPU Adam drawn 8x too short, PCIe too long"),
    Mutant("offload-split-swaps-terms", F,
           '("CPU Adam", shares["CPU Adam"], "host CPU")',
           '("CPU Adam", shares["PCIe"], "host CPU")',
           (f"{T}::test_one_gpu_cpu_adam_and_pcie_are_theory_offloads_terms",),
           "the CPU Adam piece is drawn with the PCIe share"),
    Mutant("offload-pcie-lane-always", F,
           "return base + HOST_LANES if self.offload != \"none\" else base",
           "return base + HOST_LANES",
           (f"{T}::test_no_offload_no_pcie_lane_and_nothing_on_the_host",),
           "a run without offload is drawn with an (empty) PCIe and host lane"),
    Mutant("offload-pcie-ignores-precision", F,
           'parts = {"PCIe": t[PCIE[0]] * meta.get("dtype_bytes", 2) / 2,',
           'parts = {"PCIe": t[PCIE[0]],',
           (f"{T}::test_fp32_copies_cross_pcie_at_four_bytes",),
           "an fp32 run's copies are split as if they were 16-bit"),
    Mutant("offload-measured-not-from-zero", F,
           "t0 = min((s for row in rows.values() for _, s, _ in row), default=0.0)",
           "t0 = 0.0",
           (f"{T}::test_a_recorded_step_replays_cpu_adam_as_theory_offload_at_the_target_size",),
           "the laptop's timeline is drawn at perf_counter's absolute seconds, not from the step's start"),
]
