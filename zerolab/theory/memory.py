"""Where the memory goes: exact per-device bytes of ZeRO stages 0-3 (chapter 1).

Pure arithmetic, no torch. Notation as in the book: ``psi`` parameters, ``n_gpus``
= N data-parallel ranks, K optimizer bytes per parameter. Bytes everywhere;
"GB" means 1e9 bytes, as in the ZeRO paper.

Per parameter (params + grads + optimizer state, bytes):

    precision           params grads  adam/adamw  sgd_momentum  sgd
    "fp32"                 4     4        8            4          0
    "mixed"                2     2       12            8          4
    "mixed_fp32_grads"     2     4       12            8          4

In "fp32" the parameters are the update target, so there is no master copy;
in the mixed modes the optimizer keeps an fp32 master copy (4) plus its
moments (Adam: m and v, 4 + 4; SGD with momentum: 4; plain SGD: none).

Per device, with shards of ceil(psi / N) elements (a padded flat partition):

    stage 0 (DDP)   params, grads, optimizer whole
    stage 1         optimizer / N
    stage 2         optimizer / N, grads / N
    stage 3         everything / N

Offload (ZeRO-Offload / ZeRO-Infinity), as ZeRO-Offload and DeepSpeed do it:
``offload_optimizer`` ("cpu" | "nvme", stages 1-3) moves the optimizer bytes
(master + moments) of the rank's shard to host RAM or NVMe, and the reduced
gradient shard goes to host RAM as fp32 during backward (the CPU optimizer reads
it there): 4Ψ/N on the host. The device keeps the parameters, and at stage 1 the
whole gradient buffer it accumulates into:

    offload_optimizer   device (mixed)      device (fp32)     host (mixed)   host (fp32)
    stage 1             2Ψ + 2Ψ             4Ψ + 4Ψ           16Ψ/N          12Ψ/N
    stage 2             2Ψ                  4Ψ                16Ψ/N          12Ψ/N
    stage 3             2Ψ/N                4Ψ/N              16Ψ/N          12Ψ/N

(fp32 has no master copy: the device parameters are the update target.) With
"nvme" the 12Ψ/N (8Ψ/N) of optimizer state is on NVMe and the 4Ψ/N of gradients
stays in host RAM. ``offload_param`` (stage 3 only) moves the rank's parameter
shard too. ``.total`` is model states only; stage 3 also needs the working set of
gathered layers beside it (``gathered_working_set``).

Beside it: ``activations`` (what the model keeps for backward, on top of ``.total``),
``ds_estimate`` (DeepSpeed's own estimator, for comparison) and ``comm`` (the
communication half of the model); ``zerolab.theory`` exports them all.

``fp8=True`` (beside "mixed" or "mixed_fp32_grads"): the weights the GEMMs read are held in FP8, 1 byte
instead of 2; gradients, the fp32 master and the moments as before — 15Ψ instead of 16Ψ with Adam.
Which source says which byte, and what is this book's choice: ``theory.fp8``.
"""
from __future__ import annotations

from dataclasses import asdict, dataclass, replace
from decimal import ROUND_DOWN, ROUND_HALF_UP, Decimal

from zerolab.theory.checks import STAGES, check_psi_n, mesh_share
from zerolab.theory.checks import choice as _choice

GB = 10**9
PRECISIONS = ("fp32", "mixed", "mixed_fp32_grads")
OPTIMIZERS = ("adam", "adamw", "sgd_momentum", "sgd")
DEVICES = ("none", "cpu", "nvme")

# precision -> (param bytes, grad bytes)
_PARAM_GRAD_BYTES = {"fp32": (4, 4), "mixed": (2, 2), "mixed_fp32_grads": (2, 4)}
FP8_WEIGHT_BYTES = 1     # fp8=True: the weights in E4M3/E5M2, one byte each (``theory.fp8``: sources, choices)
# optimizer -> fp32 state bytes per parameter besides a master copy (moments)
_MOMENT_BYTES = {"adam": 8, "adamw": 8, "sgd_momentum": 4, "sgd": 0}


def bytes_per_param(precision: str = "mixed", optimizer: str = "adam", fp8: bool = False) -> tuple[int, int, int]:
    """(param, grad, K) bytes per parameter; K counts master copy + moments. ``fp8``: the weights in FP8."""
    if precision == "fp8":
        raise ValueError(f"precision must be one of {PRECISIONS}, got 'fp8': FP8 is the separate argument "
                         f"fp8=True beside precision='mixed' (its weights in FP8, the fp32 master kept)")
    _choice("precision", precision, PRECISIONS)
    _choice("optimizer", optimizer, OPTIMIZERS)
    if not isinstance(fp8, bool):
        raise ValueError(f"fp8 must be True or False, got {fp8!r}")
    if fp8 and precision == "fp32":
        raise ValueError("fp8=True needs precision 'mixed' or 'mixed_fp32_grads' (an fp32 master beside the FP8 "
                         "weights); got precision='fp32'")
    p, g = _PARAM_GRAD_BYTES[precision]
    p = FP8_WEIGHT_BYTES if fp8 else p
    master = 0 if precision == "fp32" else 4
    return p, g, master + _MOMENT_BYTES[optimizer]


@dataclass(frozen=True)
class Estimate:
    """Bytes one rank holds for model states. ``total`` is the device tier."""
    psi: int
    n_gpus: int
    stage: int
    precision: str
    optimizer_name: str
    offload_optimizer: str
    offload_param: str
    params: int       # bytes on the device: 16-bit (or fp32) parameters
    grads: int        # bytes on the device: gradients
    optimizer: int    # bytes on the device: master copy + moments
    host: int         # bytes in host RAM (offload to "cpu")
    nvme: int         # bytes on NVMe (offload to "nvme")
    hpz: int = 0      # of ``params``: ZeRO++ hpZ's secondary partition (chapter 9)
    frozen_params: int = 0   # of ``params`` (or of the offload tier): frozen weights (chapter 6, LoRA)
    fp8: bool = False        # weights held in FP8 (``theory.fp8``)

    @property
    def total(self) -> int:
        return self.params + self.grads + self.optimizer

    @property
    def all_tiers(self) -> int:
        """Device + host + NVMe: what the rank's model states take anywhere."""
        return self.total + self.host + self.nvme

    def gb(self, field: str = "total") -> float:
        """A field in GB (1e9 bytes), e.g. ``est.gb("grads")``."""
        return getattr(self, field) / GB

    def as_dict(self) -> dict:
        return {**asdict(self), "total": self.total}


def estimate(psi, n_gpus, stage, precision="mixed", optimizer="adam",
             offload_optimizer="none", offload_param="none", hpz_partition_size=1, frozen=0,
             tp=1, pp=1, replicated=0, cp=1, ep=1, expert_params=0, fp8=False) -> Estimate:
    """Per-rank bytes of params, grads and optimizer state under ZeRO ``stage``.

    Chapter 1 derives it (16Ψ in mixed-precision Adam, split by stage).
    ``zl.estimate(7.5e9, 64, 1).gb()`` -> 31.4 (the ZeRO paper's Table 1).
    ``hpz_partition_size=H`` (ZeRO++, stage 3): each rank also keeps a secondary 1/H
    partition of the (padded) parameters, on top of its 1/N primary shard.
    ``frozen``: parameters that do not train (a LoRA model's base), on top of the ``psi``
    trainable ones: 16-bit (or fp32) weights only, no gradient or optimizer state; whole on
    every rank at stages 0-2, partitioned (1/N each) at stage 3.
    ``tp``, ``pp`` (3D, chapter 10): ``n_gpus`` counts every GPU; ZeRO shards each rank's
    model-parallel slice over n_gpus/(tp·pp) ranks (``checks.mesh_share``; ``replicated``: the
    parameters every TP rank keeps whole).
    ``cp`` (context parallelism): the cp ranks of one (dp, pp, tp) coordinate hold the same
    parameters, so ZeRO shards over dp·cp = n_gpus/(tp·pp) ranks, as before; ``cp`` only has to
    divide that (Megatron's distributed optimizer shards over data x context parallel ranks too).
    ``ep``, ``expert_params`` (mixture of experts): ``expert_params`` of the ``psi`` are expert
    weights. Expert parallelism is carved out of the data-parallel ranks (it does not multiply
    n_gpus): each rank holds 1/ep of the experts (1/(tp·pp·ep) of ``expert_params``) and ZeRO
    shards them over the n_gpus/(tp·pp·ep) ranks that hold the same experts; the dense
    ``psi - expert_params`` are counted as above.
    ``fp8=True``: the weights in FP8 (1 byte; sharded at stage 3), the rest as ``precision`` says.
    """
    if (cp, ep, expert_params) != (1, 1, 0):
        return _with_experts(psi, n_gpus, stage, precision, optimizer, offload_optimizer, offload_param,
                             hpz_partition_size, frozen, tp, pp, replicated, cp, ep, expert_params, fp8)
    if (tp, pp, replicated) != (1, 1, 0):
        psi_mp, n_dp = mesh_share(psi, n_gpus, tp, pp, replicated)
        est = estimate(psi_mp, n_dp, stage, precision, optimizer, offload_optimizer, offload_param,
                       hpz_partition_size, frozen, fp8=fp8)
        return replace(est, psi=check_psi_n(psi, n_gpus)[0], n_gpus=n_gpus)
    psi, n = check_psi_n(psi, n_gpus)
    _choice("stage", stage, STAGES)
    _choice("offload_optimizer", offload_optimizer, DEVICES)
    _choice("offload_param", offload_param, DEVICES)
    if offload_optimizer != "none" and stage < 1:
        raise ValueError(f"offload_optimizer={offload_optimizer!r} needs stage 1, 2 or 3 (got stage={stage})")
    if offload_param != "none" and stage < 3:
        raise ValueError(f"offload_param={offload_param!r} needs stage 3 (got stage={stage}); "
                         f"allowed at stage {stage}: ('none',)")
    p, g, k = bytes_per_param(precision, optimizer, fp8)
    if isinstance(frozen, bool) or not isinstance(frozen, (int, float)) or frozen < 0 or frozen != int(frozen):
        raise ValueError(f"frozen must be a whole number of parameters >= 0, got {frozen!r}")
    frozen = int(frozen)
    frozen_bytes = p * (-(-frozen // n) if stage >= 3 else frozen)
    shard = -(-psi // n)                       # elements per rank, padded partition
    h = hpz_partition_size
    if isinstance(h, bool) or not isinstance(h, int) or h < 1 or n % h:
        raise ValueError(f"hpz_partition_size must be an integer >= 1 dividing n_gpus ({n}), got {h!r}")
    if h > 1 and (stage < 3 or offload_param != "none"):
        raise ValueError(f"hpz_partition_size={h} needs stage 3 without offload_param (got stage={stage}, "
                         f"offload_param={offload_param!r})")
    hpz = p * shard * n // h if h > 1 else 0   # secondary partition: padded Ψ / H elements
    params = p * (shard if stage >= 3 else psi) + frozen_bytes
    grads = g * (shard if stage >= 2 else psi)
    optim = k * (shard if stage >= 1 else psi)
    off = {"none": 0, "cpu": 0, "nvme": 0}
    off[offload_optimizer] += optim
    off[offload_param] += params
    host_grads = 4 * shard if offload_optimizer != "none" else 0   # fp32 gradient shard, in host RAM
    return Estimate(psi, n, stage, precision, optimizer, offload_optimizer, offload_param,
                    params=0 if offload_param != "none" else params + hpz,
                    grads=grads if stage < 2 or not host_grads else 0,
                    host=off["cpu"] + host_grads, nvme=off["nvme"],
                    optimizer=0 if offload_optimizer != "none" else optim, hpz=hpz, frozen_params=frozen_bytes,
                    fp8=fp8)


def _with_experts(psi, n, stage, precision, optimizer, offload_optimizer, offload_param, hpz, frozen,
                  tp, pp, replicated, cp, ep, experts, fp8=False) -> Estimate:
    """``estimate`` with context and expert parallelism: the dense and the expert parameters each
    sharded over their own data-parallel group, the bytes added."""
    psi, n = check_psi_n(psi, n)
    for name, v in (("cp", cp), ("ep", ep)):
        if isinstance(v, bool) or not isinstance(v, int) or v < 1:
            raise ValueError(f"{name} must be an integer >= 1, got {v!r}")
    if isinstance(experts, bool) or not isinstance(experts, (int, float)) or not 0 <= experts < psi \
            or experts != int(experts):
        raise ValueError(f"expert_params must be a whole number of parameters in 0..psi-1 ({psi - 1}), "
                         f"got {experts!r}")
    experts = int(experts)
    if n % (tp * pp * cp):
        raise ValueError(f"n_gpus={n} is not a multiple of tp*pp*cp = {tp * pp * cp}: the DP size "
                         f"n_gpus/(tp*pp*cp) must be a whole number")
    if (n // (tp * pp * cp)) % ep:
        raise ValueError(f"ep={ep} must divide dp = n_gpus/(tp*pp*cp) = {n // (tp * pp * cp)}: expert "
                         f"parallelism is carved out of the data-parallel ranks")
    if ep > 1 and not experts:
        raise ValueError(f"ep={ep} needs expert_params > 0: the parameters expert parallelism splits")
    args = (precision, optimizer, offload_optimizer, offload_param, hpz)
    dense = estimate(psi - experts, n, stage, *args, frozen, tp, pp, replicated, fp8=fp8)
    if not experts:
        return replace(dense, psi=psi)
    slice_, n_edp = mesh_share(experts, n, tp, pp * ep)
    moe = estimate(slice_, n_edp, stage, *args, fp8=fp8)
    add = {k: getattr(dense, k) + getattr(moe, k) for k in ("params", "grads", "optimizer", "host", "nvme", "hpz")}
    return replace(dense, psi=psi, **add)


def gathered_working_set(largest_layer, precision="mixed") -> int:
    """Bytes of ZeRO-3's gathered layers beside ``.total``: DeepSpeed's 4 x largest layer, the
    16-bit parameters and gradients of the largest layer while it computes (8 x in fp32)."""
    if isinstance(largest_layer, bool) or not isinstance(largest_layer, (int, float)) or largest_layer <= 0:
        raise ValueError(f"largest_layer (parameters of the largest layer) must be > 0, got {largest_layer!r}")
    p, g, _ = bytes_per_param(precision)
    return (p + g) * int(largest_layer)


# ---- the ZeRO paper's Table 1 ----

TABLE1_MODELS = (7.5e9, 128e9, 1e12)
TABLE1_DP = (1, 4, 16, 64, 256, 1024)
TABLE1_STAGES = (1, 2, 3)   # P_os, P_os+g, P_os+g+p


def zero_table1(models=TABLE1_MODELS, dp=TABLE1_DP) -> dict:
    """{(psi, N, stage): GB per device} for mixed-precision Adam (K = 12).

    Rajbhandari et al. 2020, Table 1: stage 1 = 4Ψ + 12Ψ/N, stage 2 =
    2Ψ + 14Ψ/N, stage 3 = 16Ψ/N, in GB = 1e9 bytes.
    """
    return {(psi, n, s): estimate(psi, n, s).total / GB
            for psi in models for n in dp for s in TABLE1_STAGES}


def format_paper_gb(gb: float) -> str:
    """Format a GB figure as Table 1 prints it.

    Below 10: two decimals; below 100: one decimal; from 100: whole GB,
    truncated (the paper prints 4011.7 as 4011 and 513.5 as 513). Trailing
    zeros are dropped (30, 7.5, 2).
    """
    d = Decimal(repr(gb))
    if gb >= 100:
        text = str(d.quantize(Decimal(1), rounding=ROUND_DOWN))
    else:
        text = str(d.quantize(Decimal("0.01") if gb < 10 else Decimal("0.1"), rounding=ROUND_HALF_UP))
    return text.rstrip("0").rstrip(".") if "." in text else text


def table1_text(models=TABLE1_MODELS, dp=TABLE1_DP) -> str:
    """Table 1 laid out as in the paper, computed by ``estimate`` and printed by ``format_paper_gb``."""
    table = zero_table1(models, dp)
    names = [f"{psi / 1e9:g}B" if psi < 1e12 else f"{psi / 1e12:g}T" for psi in models]
    head = ["DP"] + [f"{m} {s}" for m in names for s in ("Pos", "Pos+g", "Pos+g+p")]
    rows = [[str(n)] + [format_paper_gb(table[(psi, n, s)]) for psi in models for s in TABLE1_STAGES] for n in dp]
    widths = [max(len(r[i]) for r in [head] + rows) for i in range(len(head))]
    return "\n".join("  ".join(c.rjust(w) for c, w in zip(r, widths)) for r in [head] + rows)
