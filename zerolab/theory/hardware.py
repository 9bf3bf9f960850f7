"""One hardware model for the whole book: GPUs, NICs, PCIe, NVMe, CPU Adam (chapters 7, 9, 11, 12).

A ``Hardware`` preset is a node (``theory.nodes``: GPUs per node, NVLink, NICs) plus
what the offload tiers and the compute need:

* ``flops``: bf16 FLOP/s one GPU achieves on a transformer step (an assumption, about half
  the datasheet peak, stated per preset);
* ``pcie``: host <-> device bytes/s per GPU and direction, achieved;
* ``host_memory``: the node's CPU memory bandwidth, achieved; the CPU Adam is bound by
  it: one mixed-precision Adam update reads fp32 master, m, v and the gradient (16 B per
  parameter) and writes master, m, v and the 16-bit parameter (14 B), ``ADAM_HOST_BYTES``
  = 30 bytes per parameter, so the node updates ``host_memory / 30`` parameters per second
  (``cpu_adam``), shared by its GPUs;
* ``nvme_drives`` x ``nvme_drive``: the node's local NVMe drives and the bytes/s of one.

``GPUS`` holds single accelerators' datasheet peaks (A100, H100, H200, B200: bf16 FLOP/s,
HBM bandwidth and size, NVLink, the NIC per GPU) for chapter 12's roofline.

Chapters 7, 9, 11, 12 and ``choose_stage`` take these presets (``HARDWARE[name]``);
nothing else in the book states a bandwidth of its own. Every number is a line rate or a
datasheet figure (cited beside it) or an *assumption* (achieved fractions, said so).
"""
from __future__ import annotations

from dataclasses import dataclass, replace

from zerolab.theory.nodes import NODES, Node, get_node

GB = 10**9
ADAM_HOST_BYTES = 30      # bytes through host memory per parameter per mixed-precision Adam update


@dataclass(frozen=True)
class Hardware:
    """A node and its offload tiers (module docstring). Bandwidths in bytes/s."""
    name: str
    node: Node
    flops: float             # achieved bf16 FLOP/s per GPU
    pcie: float              # per GPU, per direction, achieved
    host_memory: float       # per node, achieved
    nvme_drives: int         # per node
    nvme_drive: float        # one drive, sequential
    gpu: str = "A100"        # the accelerator, a ``GPUS`` key: its datasheet peak (MFU) and HBM bandwidth

    def __post_init__(self):
        for key in ("flops", "pcie", "host_memory", "nvme_drive"):
            if not getattr(self, key) > 0:
                raise ValueError(f"Hardware {key} must be > 0, got {getattr(self, key)!r}")
        if isinstance(self.nvme_drives, bool) or not isinstance(self.nvme_drives, int) or self.nvme_drives < 1:
            raise ValueError(f"Hardware nvme_drives must be an integer >= 1, got {self.nvme_drives!r}")

    @property
    def gpus_per_node(self) -> int:
        return self.node.gpus

    @property
    def accelerator(self) -> "GPU":
        """The GPU's datasheet figures (``GPUS[self.gpu]``)."""
        return GPUS[self.gpu]

    @property
    def nvme(self) -> float:
        """The node's NVMe bandwidth, all drives together."""
        return self.nvme_drives * self.nvme_drive

    @property
    def cpu_adam(self) -> float:
        """Parameters per second the node's CPUs update with mixed-precision Adam (memory-bound)."""
        return self.host_memory / ADAM_HOST_BYTES

    def sharing(self, n_gpus: int | None = None) -> int:
        """GPUs that share the node's host memory and NVMe when a job runs on ``n_gpus`` of them (all of
        the job's GPUs, model-parallel ones too): min(n_gpus, gpus_per_node); ``None``: a full node."""
        if n_gpus is None:
            return self.gpus_per_node
        if isinstance(n_gpus, bool) or not isinstance(n_gpus, int) or n_gpus < 1:
            raise ValueError(f"n_gpus must be None (a full node) or an integer >= 1, got {n_gpus!r}")
        return min(n_gpus, self.gpus_per_node)

    def per_gpu(self, n_gpus: int | None = None) -> dict:
        """Bytes/s (and parameters/s) one GPU's rank gets of each shared tier when the job has ``n_gpus``
        GPUs: the node's tiers divided among the GPUs on it (``sharing``); ``None``: a full node."""
        g = self.sharing(n_gpus)
        return {"pcie": self.pcie, "host_memory": self.host_memory / g, "nvme": self.nvme / g,
                "cpu_adam": self.cpu_adam / g}

    def with_(self, **changes) -> "Hardware":
        """A variant: ``HARDWARE["dgx-a100"].with_(nvme_drives=8, name="...")``."""
        return replace(self, **changes)

    def __str__(self):
        return (f"{self.name}: {self.node.gpus} GPUs at {self.flops / 1e12:.0f} TFLOP/s achieved, "
                f"NICs {self.node.network_bandwidth / GB:g} GB/s per node, PCIe {self.pcie / GB:g} GB/s per GPU, "
                f"host memory {self.host_memory / GB:g} GB/s, NVMe {self.nvme_drives} x {self.nvme_drive / GB:g} GB/s "
                f"per node")


A100_BF16, H100_BF16 = 312e12, 989e12     # dense bf16 peaks of the A100 and H100 SXM (sources at GPUS below)
A100_ACHIEVED = 150e12                    # assumed: about half the peak, what well-tuned large-model runs report
H100_ACHIEVED = 450e12                    # assumed: the same fraction of the H100's peak, rounded down

HARDWARE = {
    # DGX A100: 8 A100 on NVLink3, 8 x 200 Gb/s HDR NICs (theory.nodes); 2 x AMD EPYC 7742; 15 TB of
    # internal NVMe = 4 x 3.84 TB U.2 ("NVIDIA's Ampere Based DGX A100 Servers Leverage AMD EPYC Rome CPUs",
    # https://www.hardwaretimes.com/nvidias-ampere-based-dgx-a100-servers-leverage-amd-epyc-rome-cpus-instead-of-intel-xeon/).
    # PCIe 4.0 x16 = 31.5 GB/s line rate per direction ("PCI Express bus", https://hpc-notes.pages.dev/reference/pcie),
    # about 25 GB/s achieved by pinned copies (assumed). EPYC 7002: 8 channels of DDR4-3200 = 204.8 GB/s
    # per socket ("AMD Confirms Twelve DDR5 Memory Channels For Zen 4 EPYC CPUs",
    # https://www.tomshardware.com/uk/news/amd-confirms-12-ddr5-memory-channels-on-genoa), 410 GB/s for
    # two, 150 GB/s assumed achieved by the CPU Adam; about 6 GB/s sequential per PCIe 4.0 x4 drive (assumed).
    "dgx-a100": Hardware("DGX A100", NODES["dgx-a100"], A100_ACHIEVED, 25 * GB, 150 * GB, 4, 6 * GB),
    # DGX H100: 8 H100 on NVLink4, 8 single-port ConnectX-7 at 400 Gb/s, 2 x Xeon Platinum 8480C with
    # PCIe 5.0, 2 TB DDR5, 8 x 3.84 TB U.2 NVMe ("DGX BasePOD: Core Components", NVIDIA,
    # https://docs.nvidia.com/dgx-basepod/reference-architecture-infrastructure-foundation-enterprise-ai/latest/core-components.html).
    # PCIe 5.0 x16 = 63 GB/s line rate (hpc-notes, above), 50 GB/s assumed achieved; Sapphire Rapids:
    # 8 channels of DDR5-4800 ("Intel Sapphire Rapids-SP Xeon ... 8 channel DDR5 memory with speeds of up
    # to 4800 MHz", https://wccftech.com/intel-xeon-sapphire-rapids-sp-cpus-feature-up-to-56-cores-on-350w-tdp/)
    # = 307 GB/s per socket, 614 GB/s for two, 300 GB/s assumed achieved; about 6 GB/s per drive (assumed).
    "dgx-h100": Hardware("DGX H100", NODES["dgx-h100"], H100_ACHIEVED, 50 * GB, 300 * GB, 8, 6 * GB, "H100"),
    # A cloud VM: the DGX A100's GPUs, PCIe and CPUs, one 100 GbE NIC (theory.nodes) and one local
    # NVMe drive for the whole node (an example configuration, not a product).
    "cloud-100gbe": Hardware("cloud 8 x A100, 1 x 100 GbE", NODES["cloud-100gbe"], A100_ACHIEVED,
                             25 * GB, 150 * GB, 1, 6 * GB),
}


def get_hardware(hw) -> Hardware:
    """A ``Hardware``, or a preset name from ``HARDWARE``."""
    if isinstance(hw, Hardware):
        return hw
    try:
        return HARDWARE[hw]
    except (KeyError, TypeError):
        raise ValueError(f"unknown hardware {hw!r}; presets: {sorted(HARDWARE)} "
                         f"(or pass a zerolab.theory.Hardware)") from None


def with_node(hw, node) -> Hardware:
    """``hw`` on another node (a ``Node`` or ``NODES`` preset name): same PCIe, CPU and NVMe."""
    return replace(get_hardware(hw), node=get_node(node))


def offload_step_seconds(psi, n_gpus, grad_accum=1, optimizer="none", params="none", hw="dgx-a100", *,
                         gpus=None) -> dict:
    """Seconds per optimizer step one rank spends on offload: ``{"offload": PCIe + NVMe traffic,
    "optimizer": the CPU Adam}`` (nothing overlapped; ``theory.offload`` itemises the same terms). The
    shard is ``psi / n_gpus``; host memory and NVMe are shared by the job's GPUs on the node, min(``gpus``,
    GPUs per node), ``gpus`` defaulting to ``n_gpus`` (3D: all GPUs, of which n_gpus are DP ranks)."""
    hw, shard, g = get_hardware(hw), psi / n_gpus, grad_accum
    share = hw.per_gpu(n_gpus if gpus is None else gpus)
    traffic = cpu = 0.0
    if optimizer != "none":
        traffic += 4 * shard / hw.pcie                      # 16-bit grads down, 16-bit params up
        cpu += shard / share["cpu_adam"]
    if optimizer == "nvme":
        traffic += 24 * shard / share["nvme"]               # fp32 master, m, v read and written
    if params == "cpu":
        traffic += 4 * shard * g / hw.pcie                  # the 16-bit shard up for forward and backward
    elif params == "nvme":
        traffic += (4 * shard * g + 2 * shard) / share["nvme"]
    return {"offload": traffic, "optimizer": cpu}


@dataclass(frozen=True)
class GPU:
    """One accelerator's peaks (datasheet figures, dense, per GPU): the roofline's inputs (chapter 12)."""
    name: str
    bf16: float          # dense bf16 tensor FLOP/s (no sparsity)
    hbm: float           # memory bandwidth, bytes/s
    memory: float        # bytes of HBM
    nvlink: float        # per GPU, per direction, bytes/s
    nic: float           # the network card per GPU in the vendor's 8-GPU system, per direction, bytes/s

    @property
    def ridge(self) -> float:
        """FLOPs per HBM byte above which a kernel is compute-bound (the roofline's knee)."""
        return self.bf16 / self.hbm


GPUS = {
    # A100 SXM 80GB: 312 TFLOPS bf16 dense (624 with sparsity), 2,039 GB/s HBM2e, 80 GB ("A100",
    # G. Lockwood, https://glennklockwood.com/garden/processors/A100, citing NVIDIA's A100 datasheet,
    # https://www.nvidia.com/content/dam/en-zz/Solutions/Data-Center/a100/pdf/nvidia-a100-datasheet-us-nvidia-1758950-r4-web.pdf);
    # NVLink3 300 + 300 GB/s (same page); DGX A100: one 200 Gb/s HDR NIC per GPU (theory.nodes; not
    # checked against a stored NVIDIA page).
    "A100": GPU("A100 SXM 80GB", 312e12, 2.039e12, 80 * GB, 300 * GB, 200e9 / 8),
    # H100 SXM: 989.4 TFLOPS bf16 dense (1,978.9 with sparsity), 3.35 TB/s HBM3, 80 GB, NVLink4 900 GB/s
    # both directions ("H100", G. Lockwood, https://glennklockwood.com/garden/processors/h100); DGX H100:
    # eight ConnectX-7 at 400 Gb/s, one per GPU ("DGX BasePOD: Core Components", NVIDIA, cited above).
    "H100": GPU("H100 SXM", 989e12, 3.35e12, 80 * GB, 450 * GB, 400e9 / 8),
    # H200 SXM: the H100's GH100 compute, 141 GB HBM3e at 4.8 TB/s, NVLink4 900 GB/s ("NVIDIA H200 GPU
    # Specifications and Features", https://lzwjava.github.io/nvidia-h200-gpu-specs-en; "NVIDIA H200",
    # https://aiwiki.ai/wiki/nvidia_h200); DGX H200: eight ConnectX-7 at 400 Gb/s (DGX BasePOD, above).
    "H200": GPU("H200 SXM", 989e12, 4.8e12, 141 * GB, 450 * GB, 400e9 / 8),
    # NVIDIA HGX B200 datasheet: 36 PFLOPS bf16 with sparsity for 8 GPUs = 2.25 PFLOPS dense per GPU
    # (the same 2,250 TFLOPS dense bf16 at 1,000 W: "B200", G. Lockwood,
    # https://glennklockwood.com/garden/processors/B200), 8 TB/s HBM3e, 180 GB (DGX B200: "1.4TB of GPU
    # memory" for 8, DGX BasePOD above); NVLink5 1.8 TB/s both directions; DGX B200: eight ConnectX-7 at
    # 400 Gb/s, one per GPU (DGX BasePOD, above).
    "B200": GPU("B200", 2.25e15, 8e12, 180 * GB, 900 * GB, 400e9 / 8),
}
