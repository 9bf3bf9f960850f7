"""The 3D contenders of ``python -m zerolab bench --meshes``: our TP/PP engine and PyTorch's (chapter 10).

Every contender is built on one rank of a ``dp x tp x pp`` grid (TP innermost,
then PP, DP outermost: the same rank layout for ``zl.mesh`` and torch's
``DeviceMesh``) from the same untied ``TinyGPT`` preset (same seed, so the same
initial parameters), and is driven through ``step(x, y)`` — one optimizer
step on the *global* batch ``(x, y)``: each contender takes its DP rank's rows
and splits them into ``micro`` micro-batches — and ``full_params()`` (a
collective: the whole model, original names and shapes, on every rank).

* ``Ours3D``: ``zl.tensor_parallel`` (``GPT_PLAN``), ``pipeline_stage``, then
  ``zl.initialize(..., mesh=)`` (ZeRO over the DP group); the loss is
  ``vocab_parallel_cross_entropy`` under TP; pp > 1: ``train_batch`` (1F1B).
* ``TorchTP``: DTensor tensor parallelism, ``parallelize_module`` with the
  same plan in torch's styles (``ColwiseParallel``, ``RowwiseParallel``; the
  embedding ``RowwiseParallel``, i.e. split by vocabulary; the head's logits
  stay split, the loss under ``loss_parallel()``) on the ``tp`` dimension of a
  CPU ``DeviceMesh``, then FSDP2 ``fully_shard`` per block and at the root on
  its ``dp`` dimension (ZeRO-3: compare ours at stage 3).
* ``TorchPP``: ``torch.distributed.pipelining`` (pp > 1, tp = 1):
  ``pipeline()`` traces the model (torch.export) and cuts it at the same
  blocks as ``pipeline_stage`` (``SplitPoint.BEGINNING``); this rank's stage
  module (under FSDP2 ``fully_shard`` over the DP dimension of a CPU
  ``DeviceMesh`` when dp > 1: ZeRO-3, where ours can only run ZeRO-0/1 with
  PP; ``probe_ddp`` tries DDP instead) goes into a ``PipelineStage``, and
  ``Schedule1F1B`` runs the micro-batches (it scales the gradients by
  1/micro: the mean loss, as ours).

Adam (lr 1e-3, no weight decay), fp32, no clipping, for all of them (``sgd_lr``: plain SGD instead).
"""
from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F

from zerolab.book.models import TinyGPT, loss_fn

LR = 1e-3


def parse_mesh(text: str) -> tuple:
    """``"2x2x1"`` -> (dp, tp, pp) = (2, 2, 1)."""
    parts = text.lower().split("x")
    if len(parts) != 3 or not all(p.isdigit() and int(p) >= 1 for p in parts):
        raise ValueError(f"--meshes takes DPxTPxPP with positive integers (e.g. 2x2x1, 1x1x2), got {text!r}")
    return tuple(int(p) for p in parts)


def build_model(preset: str) -> TinyGPT:
    """Untied (pipeline stages cannot share the embedding with the head), no key bias (its gradient is 0)."""
    return TinyGPT.preset(preset, key_bias=False, tie_weights=False, seed=0)


def config(stage: int, micro: int, gas: int, sgd_lr: float = 0.0) -> dict:
    opt = {"type": "SGD", "params": {"lr": sgd_lr}} if sgd_lr else {"type": "Adam", "params": {"lr": LR,
                                                                                              "weight_decay": 0.0}}
    return {"train_micro_batch_size_per_gpu": micro, "gradient_accumulation_steps": gas, "gradient_clipping": 0.0,
            "optimizer": opt, "zero_optimization": {"stage": stage}}


def optimizer(params, sgd_lr: float = 0.0):
    """torch's side of ``config``: Adam (the bench), or plain SGD (tests: unlike Adam, it shows a wrong
    gradient scale)."""
    return torch.optim.SGD(params, lr=sgd_lr) if sgd_lr else torch.optim.Adam(params, lr=LR)


class Runner3D:
    """One contender on one rank: its slice of the batch, its micro-batches."""
    kind = library = "?"

    def __init__(self, preset, dims, stage, micro, batch, sgd_lr=0.0):
        self.dp, self.tp, self.pp = dims
        self.sgd_lr = sgd_lr
        if batch % (self.dp * micro):
            raise ValueError(f"a global batch of {batch} rows does not split into dp={self.dp} x {micro} micro-batches")
        self.rows = batch // (self.dp * micro)   # rows per micro-batch
        self.stage, self.micro, self.steps = stage, micro, 0
        if dist.get_world_size() != self.dp * self.tp * self.pp:
            raise ValueError(f"mesh {dims} needs {self.dp * self.tp * self.pp} ranks, the world has "
                             f"{dist.get_world_size()}")
        self.dp_rank = dist.get_rank() // (self.tp * self.pp)
        self.model = build_model(preset)
        self.names = [n for n, _ in self.model.named_parameters()]

    def local_batch(self, x, y):
        rows = x.shape[0] // self.dp
        lo = rows * self.dp_rank
        return x[lo:lo + rows], y[lo:lo + rows]

    def micro_batches(self, x, y):
        return list(zip(x.chunk(self.micro), y.chunk(self.micro)))

    def close(self):
        pass


class Ours3D(Runner3D):
    kind, library = "ours", "zerolab"

    def __init__(self, preset, dims, stage, micro, batch, sgd_lr=0.0):
        super().__init__(preset, dims, stage, micro, batch, sgd_lr)
        from zerolab.engine import initialize
        from zerolab.parallel import pipeline_stage, tensor_parallel, tp_dims, vocab_parallel_cross_entropy
        from zerolab.runtime.mesh import mesh
        self.mesh = mesh(dp=self.dp, tp=self.tp, pp=self.pp)
        model = tensor_parallel(self.model, self.mesh) if self.tp > 1 else self.model
        self.dims = tp_dims(model)
        if self.pp > 1:
            model = pipeline_stage(model, self.mesh)
        self.loss = (lambda out, y: vocab_parallel_cross_entropy(out, y, self.mesh)) if self.tp > 1 else loss_fn
        self.engine = initialize(model, config(stage, 1, micro, sgd_lr), mesh=self.mesh)

    def step(self, x, y):
        from zerolab.parallel import train_batch
        batches = self.micro_batches(*self.local_batch(x, y))
        if self.pp > 1:
            loss = train_batch(self.engine, self.mesh, batches, self.loss, "1f1b")
        else:
            loss = 0.0
            for xb, yb in batches:
                out = self.loss(self.engine(xb), yb)
                self.engine.backward(out)
                self.engine.step()
                loss += float(out.detach()) / len(batches)
        self.steps += 1
        return loss

    def full_params(self):
        from zerolab.parallel import gather_3d
        full = gather_3d(self.engine.full_state_dict(), self.dims, self.mesh)
        return {n: full[n].detach().float().clone() for n in self.names}

    def close(self):
        self.engine.close()


def torch_tp_plan():
    """``GPT_PLAN`` in torch's styles (DTensor tensor parallelism)."""
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel
    plan = {"wte": RowwiseParallel(input_layouts=Replicate(), output_layouts=Replicate()),
            "head": ColwiseParallel(output_layouts=Shard(-1), use_local_output=False)}
    return plan, {"attn.q": ColwiseParallel(), "attn.k": ColwiseParallel(), "attn.v": ColwiseParallel(),
                  "attn.proj": RowwiseParallel(), "fc": ColwiseParallel(), "out": RowwiseParallel()}


class TorchTP(Runner3D):
    kind, library = "torch_tp", "torch"

    def __init__(self, preset, dims, stage, micro, batch, sgd_lr=0.0):
        super().__init__(preset, dims, stage, micro, batch, sgd_lr)
        if self.pp != 1:
            raise ValueError("the torch TP peer runs dp x tp meshes (pp = 1)")
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard
        from torch.distributed.tensor.parallel import parallelize_module
        self.dm = init_device_mesh("cpu", (self.dp, self.tp), mesh_dim_names=("dp", "tp"))
        top, per_block = torch_tp_plan()
        if self.tp > 1:
            parallelize_module(self.model, self.dm["tp"], top)
            for block in self.model.blocks:
                parallelize_module(block, self.dm["tp"], per_block)
                block.attn.n_head //= self.tp    # this rank's heads
        if self.dp > 1:
            for block in self.model.blocks:
                fully_shard(block, mesh=self.dm["dp"])
            fully_shard(self.model, mesh=self.dm["dp"])
        self.opt = optimizer(self.model.parameters(), sgd_lr)

    def step(self, x, y):
        from torch.distributed.tensor.parallel import loss_parallel
        batches = self.micro_batches(*self.local_batch(x, y))
        self.opt.zero_grad(set_to_none=True)
        total = 0.0
        for xb, yb in batches:
            with loss_parallel():
                logits = self.model(xb)
                loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), yb.reshape(-1)) / len(batches)
                loss.backward()
            total += float(loss.full_tensor() if hasattr(loss, "full_tensor") else loss)
        self.opt.step()
        self.steps += 1
        return total

    def full_params(self):
        out = {}
        for n, p in self.model.named_parameters():
            t = p.full_tensor() if hasattr(p, "full_tensor") else p
            out[n] = t.detach().float().clone()
        return {n: out[n] for n in self.names}


class TorchPP(Runner3D):
    kind, library = "torch_pp", "torch"

    def __init__(self, preset, dims, stage, micro, batch, sgd_lr=0.0, schedule="1f1b", dp_wrap="fsdp2"):
        super().__init__(preset, dims, stage, micro, batch, sgd_lr)
        if self.tp != 1:
            raise ValueError("the torch pipelining peer runs dp x 1 x pp meshes (tp = 1)")
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe
        self.dm = init_device_mesh("cpu", (self.dp, self.pp), mesh_dim_names=("dp", "pp"))
        self.pp_rank, self.pp_group = self.dm["pp"].get_local_rank(), self.dm["pp"].get_group()
        self.module = trace_stage(self.model, self.pp, self.pp_rank, self.rows)
        submod = self.module
        if self.dp > 1 and dp_wrap == "fsdp2":   # FSDP2 per stage: gradients reduced after the last micro-batch
            from torch.distributed.fsdp import fully_shard
            submod = fully_shard(self.module, mesh=self.dm["dp"])
        elif self.dp > 1:   # "ddp": DistributedDataParallel per stage (probe_ddp)
            from torch.nn.parallel import DistributedDataParallel
            submod = DistributedDataParallel(self.module, process_group=self.dm["dp"].get_group())
        self.pstage = PipelineStage(submod, self.pp_rank, self.pp, torch.device("cpu"), group=self.pp_group)
        cls = {"1f1b": Schedule1F1B, "gpipe": ScheduleGPipe}[schedule]
        self.schedule = cls(self.pstage, n_microbatches=micro, loss_fn=loss_fn)   # scale_grads: mean over micro
        self.opt = optimizer(self.module.parameters(), sgd_lr)

    def step(self, x, y):
        x, y = self.local_batch(x, y)
        self.opt.zero_grad(set_to_none=True)
        losses = []
        if self.pp_rank == 0:
            self.schedule.step(x)
        elif self.pp_rank == self.pp - 1:
            self.schedule.step(target=y, losses=losses)
        else:
            self.schedule.step()
        self.opt.step()
        self.steps += 1
        loss = torch.tensor(float(torch.stack(losses).detach().mean()) if losses else 0.0)
        dist.broadcast(loss, dist.get_global_rank(self.pp_group, self.pp - 1), group=self.pp_group)
        return float(loss)

    def full_params(self):
        mine = {n: (p.full_tensor() if hasattr(p, "full_tensor") else p).detach().float().clone()
                for n, p in self.module.named_parameters()}   # a collective over DP under FSDP2
        parts = [None] * self.pp
        dist.all_gather_object(parts, mine, group=self.pp_group)
        full = {k: v for part in parts for k, v in part.items()}
        return {n: full[n] for n in self.names}


def probe_ddp(preset, dims, micro, batch, steps=2) -> str | None:
    """On every rank of a dp x 1 x pp mesh: the pipelining peer with DDP per stage instead of FSDP2,
    ``steps`` steps; None if they run, else the error (and its cause) as torch words it."""
    try:
        r = TorchPP(preset, dims, 0, micro, batch, dp_wrap="ddp")
        from zerolab.book.models import synthetic_batch
        for k in range(steps):
            r.step(*synthetic_batch(preset, batch, seed=0, step=k))
        return None
    except Exception as e:   # recorded verbatim; the other ranks fail on their own, or time out waiting
        cause = f" <- {type(e.__cause__).__name__}: {e.__cause__}" if e.__cause__ is not None else ""
        return " ".join(f"{type(e).__name__}: {e}{cause}".split())


def trace_stage(model, pp: int, pp_rank: int, micro_rows: int):
    """torch's tracing front end: ``pipeline()`` (torch.export, for micro-batches of ``micro_rows``
    rows) cut at the first block of each stage but the first (contiguous shares, as
    ``split_blocks``); this rank's stage module."""
    from torch.distributed.pipelining import SplitPoint, pipeline
    from zerolab.book.models import synthetic_batch
    from zerolab.parallel import split_blocks
    x, _ = synthetic_batch(model, micro_rows, seed=0)
    cuts = {f"blocks.{lo}": SplitPoint.BEGINNING for lo, _ in split_blocks(len(model.blocks), pp)[1:]}
    return pipeline(model, mb_args=(x,), split_spec=cuts).get_stage_module(pp_rank)


KINDS = {"ours": Ours3D, "torch_tp": TorchTP, "torch_pp": TorchPP}
