"""The contenders of ``python -m zerolab bench``: our engine and its peers (chapter 12).

Each contender is built on one rank from the same ``TinyGPT`` preset (same
seed, so the same initial parameters) and the same DeepSpeed-style config
(``ds_config``), and is driven through one small interface, ``Runner``:

    runner.step(x, y)        one optimizer step on this rank's slice of the batch
    runner.full_params()     collective: {name: full fp32 parameter} (names as in TinyGPT)
    runner.bytes_per_step    bytes this rank sends per step: our ledger, the peers' from theory
    runner.close()

Every contender does the same maths: Adam (torch.optim.Adam's update — the
fused kernel for the torch peers, as ours uses — L2 weight
decay 0), the same lr, fp32 everywhere. DeepSpeed's "Adam" is AdamW with
weight decay unless ``"adam_w_mode": false, "weight_decay": 0``; with
``"torch_adam": true`` it uses ``torch.optim.Adam`` itself (its FusedAdam is a
CUDA kernel); and DeepSpeed clips gradients at norm 1.0 by default, so the
config says ``"gradient_clipping": 0``. The same config dict goes to ``zl.initialize`` and to
``deepspeed.initialize``.

Peers (``KINDS``): torch DDP; ``ZeroRedundancyOptimizer(Adam)`` + DDP (ZeRO-1);
FSDP2 ``fully_shard`` per block and at the root (ZeRO-3); DeepSpeed ZeRO-1/2/3
(optional: ``pip install zerolab[bench]``; run with ``DS_ACCELERATOR=cpu``).
"""
from __future__ import annotations

import importlib.util
import os

import torch
import torch.distributed as dist

from zerolab.book.models import TinyGPT, loss_fn

LR = 1e-3
BENCH_MODELS = ("tiny", "small", "medium", "large")  # TinyGPT presets: ~0.3M, 3.7M, 26M, 98M parameters


def ds_config(stage: int, micro_batch: int, lr: float = LR, overlap_comm=None, bucket: int | None = None,
              link: str | None = None, **zero_extra) -> dict:
    """One DeepSpeed JSON config for ours and DeepSpeed: plain Adam, fp32, one micro-batch per step.
    ``zero_extra``: more zero_optimization keys (e.g. stage3_prefetch_bucket_size=0)."""
    zero = {"stage": stage, **zero_extra}
    if overlap_comm is not None:
        zero["overlap_comm"] = overlap_comm
    if bucket is not None:
        zero.update(reduce_bucket_size=bucket, allgather_bucket_size=bucket)
    cfg = {
        "train_micro_batch_size_per_gpu": micro_batch,
        "gradient_accumulation_steps": 1,
        "gradient_clipping": 0.0,  # DeepSpeed 0.19 clips at 1.0 unless told otherwise; ours: 0 = off
        "optimizer": {"type": "Adam", "params": {"lr": lr, "betas": [0.9, 0.999], "eps": 1e-8,
                                                 "weight_decay": 0.0, "adam_w_mode": False,
                                                 "torch_adam": True}},
        "zero_optimization": zero,
        "steps_per_print": 10**9,
        "wall_clock_breakdown": False,
    }
    if link is not None:
        cfg["zerolab"] = {"link": link}
    return cfg


def deepspeed_available() -> bool:
    """True when the real DeepSpeed package is installed. A folder named ``deepspeed`` without an
    ``__init__.py`` on ``sys.path`` (a test fixture's, an example's) is found by ``find_spec`` as a
    namespace package with no origin: that is not DeepSpeed."""
    try:
        spec = importlib.util.find_spec("deepspeed")
    except (ImportError, ValueError):
        return False
    return spec is not None and spec.origin is not None


def ours_available(stage: int) -> bool:
    from zerolab.engine import ENGINES
    return stage in ENGINES


def build_model(preset: str) -> TinyGPT:
    """The benchmark model: ``key_bias=False`` because the attention key bias has a true
    gradient of exactly zero, and Adam turns rounding noise there into ±lr steps,
    which would hide real disagreements in the cross-check (docs/MEASUREMENTS.md)."""
    return TinyGPT.preset(preset, key_bias=False, seed=0)


def param_names(model) -> list[str]:
    return [n for n, _ in model.named_parameters()]  # tied weights appear once


def theory_bytes(psi: int, n: int, stage: int, kind: str, persistent: int = 0) -> int:
    """Bytes one rank sends per step under ring algorithms, fp32 gradients and parameters.
    ``persistent``: DeepSpeed ZeRO-3's elements in parameters kept whole (no gathers: 2x, not 3x)."""
    from zerolab.theory.network import ring_bytes
    from zerolab.theory.comm import comm_volume
    if kind == "deepspeed" and stage == 3 and persistent:
        parts = ((persistent, 2), (psi - persistent, 3))
        return sum(comm_volume(p, n, s, dtype_bytes=4) for p, s in parts if p > 0)
    if kind == "zero_redundancy":  # DDP all-reduce, then each rank broadcasts its shard of parameters
        shard = -(-psi // n) * 4
        return ring_bytes("all_reduce", psi * 4, n) + sum(ring_bytes("broadcast", shard, n, 0, src)
                                                         for src in range(n))
    return comm_volume(psi, n, stage, dtype_bytes=4)


class Runner:
    """One contender on one rank (subclasses fill in ``step`` and ``full_params``)."""
    kind = "?"
    library = "?"

    def __init__(self, preset: str, stage: int, cfg: dict):
        self.stage, self.cfg = stage, cfg
        self.model = build_model(preset)
        self.names = param_names(self.model)
        self.world_size = dist.get_world_size()
        self.numels = [p.numel() for p in self.model.parameters()]  # before any engine partitions them
        self.psi = sum(self.numels)
        self.steps = 0

    @property
    def bytes_per_step(self) -> int:
        threshold = self.cfg["zero_optimization"].get("stage3_param_persistence_threshold", 100_000)
        persistent = sum(n for n in self.numels if n <= threshold)
        return theory_bytes(self.psi, self.world_size, self.stage, self.kind, persistent)

    bytes_source = "theory"

    def full_params(self) -> dict:
        params = dict(self.model.named_parameters())
        return {n: params[n].detach().float().clone() for n in self.names}

    def reset_bytes(self) -> None:
        """Forget the bytes counted so far (only our ledger counts)."""

    def close(self) -> None:
        pass


class Ours(Runner):
    kind, library = "ours", "zerolab"
    bytes_source = "ledger"

    def __init__(self, preset, stage, cfg):
        super().__init__(preset, stage, cfg)
        from zerolab.engine import initialize
        self.engine = initialize(self.model, cfg)
        self._bytes, self._counted = 0, 0

    def step(self, x, y):
        self.engine.comm.reset()
        loss = loss_fn(self.engine(x), y)
        self.engine.backward(loss)
        self.engine.step()
        self._bytes += self.engine.comm.total_bytes()
        self._counted += 1
        self.steps += 1

    @property
    def bytes_per_step(self) -> int:
        return self._bytes // max(1, self._counted)

    def reset_bytes(self):
        self._bytes = self._counted = 0

    def full_params(self):
        full = self.engine.full_state_dict()
        return {n: full[n] for n in self.names}

    def close(self):
        self.engine.close()


class DDP(Runner):
    kind, library = "ddp", "torch"

    def __init__(self, preset, stage, cfg):
        super().__init__(preset, stage, cfg)
        from torch.nn.parallel import DistributedDataParallel
        self.ddp = DistributedDataParallel(self.model)
        self.opt = self.make_optimizer()

    def make_optimizer(self):
        return torch.optim.Adam(self.ddp.parameters(), lr=self.cfg["optimizer"]["params"]["lr"], fused=True)

    def step(self, x, y):
        self.opt.zero_grad(set_to_none=True)
        loss_fn(self.ddp(x), y).backward()
        self.opt.step()
        self.steps += 1


class ZeroRedundancy(DDP):
    kind, library = "zero_redundancy", "torch"

    def make_optimizer(self):
        from torch.distributed.optim import ZeroRedundancyOptimizer
        return ZeroRedundancyOptimizer(self.ddp.parameters(), optimizer_class=torch.optim.Adam,
                                       lr=self.cfg["optimizer"]["params"]["lr"], fused=True)


class FSDP2(Runner):
    kind, library = "fsdp2", "torch"

    def __init__(self, preset, stage, cfg):
        super().__init__(preset, stage, cfg)
        from torch.distributed.fsdp import fully_shard
        for block in self.model.blocks:
            fully_shard(block)
        fully_shard(self.model)
        self.opt = torch.optim.Adam(self.model.parameters(), lr=cfg["optimizer"]["params"]["lr"], fused=True)

    def step(self, x, y):
        self.opt.zero_grad(set_to_none=True)
        loss_fn(self.model(x), y).backward()
        self.opt.step()
        self.steps += 1

    def full_params(self):
        params = dict(self.model.named_parameters())
        return {n: params[n].full_tensor().detach().float().clone() for n in self.names}


class DeepSpeed(Runner):
    kind, library = "deepspeed", "deepspeed"

    def __init__(self, preset, stage, cfg):
        super().__init__(preset, stage, cfg)
        os.environ.setdefault("DS_ACCELERATOR", "cpu")
        import deepspeed  # stage 3 partitions the built model at initialize (no zero.Init: same init)
        import deepspeed.comm.torch as ds_torch
        # DeepSpeed JIT-compiles a shared-memory all-reduce for CPU at start-up (about 90 s the
        # first time); only inference_all_reduce uses it, training goes through gloo: skip it
        ds_torch.build_shm_op = lambda: None
        self.engine, *_ = deepspeed.initialize(model=self.model, model_parameters=self.model.parameters(),
                                               config=cfg)

    def step(self, x, y):
        loss = loss_fn(self.engine(x), y)
        self.engine.backward(loss)
        self.engine.step()
        self.steps += 1

    def full_params(self):
        params = dict(self.engine.module.named_parameters())
        if self.stage < 3:
            return {n: params[n].detach().float().clone() for n in self.names}
        import deepspeed
        with deepspeed.zero.GatheredParameters([params[n] for n in self.names]):
            return {n: params[n].detach().float().clone() for n in self.names}


KINDS = {"ours": Ours, "ddp": DDP, "zero_redundancy": ZeroRedundancy, "fsdp2": FSDP2, "deepspeed": DeepSpeed}

# stage -> peers run against our engine at that stage
PEERS = {0: ["ddp"], 1: ["zero_redundancy", "deepspeed"], 2: ["deepspeed"], 3: ["fsdp2", "deepspeed"]}

LABELS = {"ours": "zerolab", "ddp": "torch DDP", "zero_redundancy": "ZeroRedundancyOptimizer+DDP",
          "fsdp2": "FSDP2 fully_shard", "deepspeed": "DeepSpeed"}


def label(kind: str, stage: int, extra: str = "") -> str:
    ds = f" ZeRO-{stage}" if kind == "deepspeed" else ""
    ours = f" stage {stage}" if kind == "ours" else ""
    return f"{LABELS[kind]}{ds}{ours}{extra}"


def build(kind: str, preset: str, stage: int, cfg: dict) -> Runner:
    return KINDS[kind](preset, stage, cfg)


def fsdp_beside_ours(preset: str = "micro", steps: int = 3, batch_per_rank: int = 2) -> dict:
    """Inside a launched rank (chapter 12, "FSDP beside ZeRO"): our ZeRO-3 and FSDP2 ``fully_shard``
    trained on the same batches from the same initial parameters; the largest parameter difference
    and the bytes each keeps per rank for parameters and optimizer state (local shards only)."""
    from zerolab.book.models import synthetic_batch
    rank, n = dist.get_rank(), dist.get_world_size()
    cfg = ds_config(3, batch_per_rank, stage3_param_persistence_threshold=0)   # FSDP2 keeps nothing whole
    runners = {kind: build(kind, preset, 3, cfg) for kind in ("ours", "fsdp2")}
    start = runners["ours"].full_params()
    for step in range(steps):
        for r in runners.values():
            x, y = synthetic_batch(r.model, batch_per_rank * n, step=step, rank=rank, world_size=n)
            r.step(x, y)
    full = {kind: r.full_params() for kind, r in runners.items()}
    fsdp = runners["fsdp2"]
    local = [p.to_local() for p in fsdp.model.parameters()]
    state = [t for s in fsdp.opt.state.values() for t in s.values() if torch.is_tensor(t) and t.dim() > 0]
    mem = runners["ours"].engine.memory()
    out = {"rank": rank, "psi": fsdp.psi,
           "max_abs_diff": max(float((full["ours"][k] - full["fsdp2"][k]).abs().max()) for k in fsdp.names),
           "moved": max(float((full["ours"][k] - start[k]).abs().max()) for k in fsdp.names),
           "bytes": {"ours": {"params": mem.params, "optimizer": mem.optimizer},
                     "fsdp2": {"params": sum(t.numel() * t.element_size() for t in local),
                               "optimizer": sum(t.to_local().numel() * t.element_size() if hasattr(t, "to_local")
                                                else t.numel() * t.element_size() for t in state)}},
           "fsdp_param_type": type(next(fsdp.model.parameters())).__name__}
    for r in runners.values():
        r.close()
    return out
