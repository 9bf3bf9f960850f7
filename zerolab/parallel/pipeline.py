"""Pipeline parallelism: a model's blocks split into stages, micro-batches sent point to point (chapter 10).

``pipeline_stage(model, mesh)`` keeps this rank's contiguous share of the
blocks — of an ``nn.Sequential`` (or list) of blocks, or of a GPT-shaped model
(``wte``, ``wpe``, ``blocks``, ``ln_f``, ``head``: the embeddings go to the first
stage, the final LayerNorm and head to the last) — under their original names.
``train_batch(stage, mesh, batches, loss_fn)`` runs one step's micro-batches
through the pipeline: the first stage reads the inputs, the last computes the
loss on the targets, activations go forward and their gradients backward
between neighbouring stages of the PP group (one send per micro-batch and
boundary, booked under ``group="pp"``). ``stage`` is the stage module (plain
autograd: the gradients accumulate in ``.grad``, divided by the number of
micro-batches) or a zerolab engine built over it with ``mesh=`` (ZeRO-0/1 over the
DP group; ``engine.step()`` after every backward, so the optimizer steps after
the last micro-batch).

Schedules (lists of ("F" | "B", micro-batch) per stage): ``"gpipe"`` — every
forward, then every backward (m micro-batches' activations in flight);
``"1f1b"`` — p - s - 1 warm-up forwards on stage s, then one forward and one
backward in turn, then the remaining backwards (at most p - s in flight).
The bubble is (p - 1)/(m + p - 1) of the step in both.
"""
from __future__ import annotations

from collections import OrderedDict

import torch
import torch.distributed as dist
from torch import nn

from zerolab.runtime.comm import CommRecord


def schedule(kind: str, m: int, p: int, s: int) -> list:
    """The order stage ``s`` of ``p`` runs ``m`` micro-batches' forwards ("F", i) and backwards ("B", i)."""
    if kind == "gpipe":
        return [("F", i) for i in range(m)] + [("B", i) for i in range(m)]
    if kind != "1f1b":
        raise ValueError(f"pipeline schedule must be 'gpipe' or '1f1b', got {kind!r}")
    if m < p:
        raise ValueError(f"1F1B needs at least as many micro-batches as stages: {m} micro-batches, pp={p}")
    warm = p - s - 1
    out = [("F", i) for i in range(warm)]
    for i in range(m - warm):
        out += [("F", warm + i), ("B", i)]
    return out + [("B", i) for i in range(m - warm, m)]


def split_blocks(n_blocks: int, pp: int) -> list:
    """(first, last + 1) block index of each of ``pp`` stages: contiguous, sizes differing by at most one."""
    if pp > n_blocks:
        raise ValueError(f"pp={pp} is larger than the number of blocks ({n_blocks}): every stage needs a block")
    q, r = divmod(n_blocks, pp)
    bounds, lo = [], 0
    for s in range(pp):
        bounds.append((lo, lo + q + (s < r)))
        lo = bounds[-1][1]
    return bounds


class GPTStage(nn.Module):
    """Stage ``s`` of a GPT-shaped model: its blocks (original indices), plus the embeddings on the
    first stage and the final LayerNorm and head on the last."""

    def __init__(self, model, lo, hi, first, last):
        super().__init__()
        self.first, self.last = first, last
        if first:
            self.wte, self.wpe = model.wte, model.wpe
        self.blocks = nn.ModuleDict(OrderedDict((str(i), model.blocks[i]) for i in range(lo, hi)))
        if last:
            self.ln_f, self.head = model.ln_f, model.head

    def forward(self, x):
        if self.first:
            x = self.wte(x) + self.wpe(torch.arange(x.shape[1], device=x.device))
        for block in self.blocks.values():
            x = block(x)
        return self.head(self.ln_f(x)) if self.last else x


def pipeline_stage(model, mesh) -> nn.Module:
    """This rank's stage of ``model`` (``mesh.pp`` stages, ``mesh.pp_rank`` this one)."""
    p, s = mesh.pp, mesh.pp_rank
    if all(hasattr(model, a) for a in ("wte", "wpe", "blocks", "ln_f", "head")):
        lo, hi = split_blocks(len(model.blocks), p)[s]
        if p > 1 and model.head.weight is model.wte.weight:
            raise ValueError("the head is tied to the embedding, which sit on the first and the last stage: "
                             "tied weights across pipeline stages are not implemented yet (tie_weights=False)")
        return GPTStage(model, lo, hi, s == 0, s == p - 1)
    if isinstance(model, (list, nn.ModuleList)):
        model = nn.Sequential(*model)
    if not isinstance(model, nn.Sequential):
        raise ValueError(f"pipeline_stage: a model is split by its blocks: an nn.Sequential (or list) of blocks, "
                         f"or a GPT-shaped model (wte, wpe, blocks, ln_f, head); got {type(model).__name__}")
    lo, hi = split_blocks(len(model), p)[s]
    return nn.Sequential(OrderedDict((str(i), model[i]) for i in range(lo, hi)))


class _P2P:
    """Sends (non-blocking, waited at the end) and blocking receives to the neighbouring stages;
    each payload booked in the mesh's ledger under "pp" (a 4-int64 header with the shape is not)."""

    def __init__(self, mesh):
        self.mesh, self.ranks, self.pending = mesh, mesh.ranks("pp"), []

    def _book(self, op, t, peer):
        k = self.mesh.ranks_per_node
        nbytes = t.numel() * t.element_size()
        self.mesh.ledger.records.append(CommRecord(op, nbytes if op == "send" else 0, 0.0, t.numel(),
                                                   str(t.dtype).replace("torch.", ""), 2, "pipeline",
                                                   inter_bytes=nbytes * (op == "send" and peer // k != self.mesh.rank // k),
                                                   group="pp"))

    def send(self, t, stage):
        peer, t = self.ranks[stage], t.detach().contiguous()
        head = torch.tensor(list(t.shape) + [0] * (4 - t.dim()) + [t.dim()], dtype=torch.int64)
        self.pending += [(dist.isend(head, peer), head), (dist.isend(t, peer), t)]
        self._book("send", t, peer)

    def recv(self, stage, dtype):
        peer = self.ranks[stage]
        head = torch.empty(5, dtype=torch.int64)
        dist.recv(head, peer)
        t = torch.empty(head[:int(head[4])].tolist(), dtype=dtype)
        dist.recv(t, peer)
        self._book("recv", t, peer)
        return t

    def wait(self):
        for work, _ in self.pending:
            work.wait()
        self.pending.clear()


def train_batch(stage, mesh, batches, loss_fn, schedule_kind: str = "1f1b", dtype=None) -> float:
    """One step over ``batches`` (a list of (inputs, targets), the same on every stage) through the
    pipeline; returns the mean loss on every rank of the PP group. ``stage``: this rank's stage
    module, or an engine over it (then ``len(batches)`` must be its gradient_accumulation_steps).
    ``dtype``: of the activations passed between stages (default: the engine's compute dtype, else fp32)."""
    p, s, m = mesh.pp, mesh.pp_rank, len(batches)
    engine = stage if hasattr(stage, "backward") and hasattr(stage, "gas") else None
    if engine is not None and engine.gas != m:
        raise ValueError(f"train_batch: {m} micro-batches, but the engine's gradient_accumulation_steps is "
                         f"{engine.gas}; they must be equal (one optimizer step per batch list)")
    dtype = dtype or (engine.precision.compute_dtype if engine is not None else torch.float32)
    order = schedule(schedule_kind, m, p, s)
    link, first, last = _P2P(mesh), s == 0, s == p - 1
    inputs, outputs, losses = {}, {}, []
    for op, i in order:
        if op == "F":
            x = batches[i][0] if first else link.recv(s - 1, dtype).requires_grad_()
            y = stage(x)
            if last:
                y = loss_fn(y, batches[i][1])
                losses.append(y.detach().float())
            else:
                link.send(y, s + 1)
            inputs[i], outputs[i] = x, y
            continue
        x, y = inputs.pop(i), outputs.pop(i)
        if last:
            target = y if engine is not None else y / m   # an engine divides by its gas itself
        else:
            grad = link.recv(s + 1, y.dtype)
            # an engine divides what it is given by gas: the gradient received already was
            target = (y.float() * grad.float()).sum() * (m if engine is not None else 1)
        if engine is not None:
            engine.backward(target)
        else:
            target.backward()
        if not first:   # before the step: at the boundary it all-reduces the norm over the PP group too
            link.send(x.grad, s - 1)
        if engine is not None:
            engine.step()
    link.wait()
    loss = torch.stack(losses).mean() if last else torch.zeros((), dtype=torch.float32)
    if p > 1:
        mesh.communicator("pp").broadcast(loss, src=p - 1, tag="pipeline-loss")
    return float(loss)
