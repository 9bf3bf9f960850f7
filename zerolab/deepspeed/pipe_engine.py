"""The engine ``deepspeed.initialize(model=PipelineModule(...))`` returns: DeepSpeed's ``PipelineEngine`` calls.

``train_batch(data_iter=None)`` takes ``gradient_accumulation_steps``
micro-batches ``(inputs, labels)`` from ``data_iter`` (or from the engine's own
loader over ``training_data``) on the first and last stages (the stages between
read nothing, as in DeepSpeed), runs them through zerolab's pipeline
(``zerolab.parallel.pipeline_run.train_batch``, what ``engine.train_batch``
runs, with the gradient-norm report around the step: 1F1B unless the config's
``zerolab.pipeline_schedule`` says ``"gpipe"``, and GPipe when there are fewer
micro-batches than stages) with the ``PipelineModule``'s
``loss_fn``, takes one optimizer step, and returns DeepSpeed's value: the mean
loss over the micro-batches and the data-parallel ranks, a 0-dim float32 tensor
on every rank. ``eval_batch`` runs the forwards only (no gradient, no step)
and returns the same mean (``return_logits=True``: also the last micro-batch's
outputs on the last stage, None elsewhere). As in DeepSpeed, ``engine(x)``,
``engine.backward`` and ``engine.step`` are refused in pipeline mode.

The training loader (``training_data``) is DeepSpeed's pipeline loader: a
``DistributedSampler`` over the DP group *without* shuffling, restarted when it
runs out (``RepeatingLoader``).
"""
from __future__ import annotations

import torch

from zerolab.deepspeed.engine import DeepSpeedEngine
from zerolab.deepspeed.reports import GradNormHook
from zerolab.parallel.pipeline_run import train_batch as pipeline_train_batch
from zerolab.parallel.pipeline_schedule import P2P


class PipelineError(Exception):
    """DeepSpeed's exception for calls that pipeline mode does not allow."""


class PipelineEngine(DeepSpeedEngine):
    def __init__(self, engine, pipe_module, training_dataloader=None, local_rank=0, has_optimizer=True):
        super().__init__(engine, training_dataloader, local_rank, has_optimizer)
        d = self.__dict__
        d["pipe_module"], d["mesh"] = pipe_module, pipe_module.mesh
        d["num_stages"], d["stage_id"] = pipe_module.num_stages, pipe_module.stage_id
        d["micro_batches"] = engine.gas
        d["data_iterator"] = iter(training_dataloader) if training_dataloader is not None and \
            (self.is_first_stage() or self.is_last_stage()) else None

    # ---------------------------------------------------------------- DeepSpeed's pipeline calls
    def is_first_stage(self):
        return self.stage_id == 0

    def is_last_stage(self):
        return self.stage_id == self.num_stages - 1

    def set_dataiterator(self, iterator):
        if self.is_first_stage() or self.is_last_stage():
            self.__dict__["data_iterator"] = iterator

    def is_gradient_accumulation_boundary(self):
        """DeepSpeed's pipeline engine: True only while it takes the optimizer step inside train_batch."""
        return False

    def _micro_batches(self, n, data_iter):
        if not (self.is_first_stage() or self.is_last_stage()):
            return [(None, None)] * n
        it = data_iter if data_iter is not None else self.data_iterator
        if it is None:
            raise ValueError("train_batch()/eval_batch(): no data; pass data_iter= or give deepspeed.initialize "
                             "training_data=")
        out = []
        for _ in range(n):
            batch = next(it)
            if not (isinstance(batch, (tuple, list)) and len(batch) == 2):
                raise ValueError(f"a pipeline micro-batch must be (inputs, labels), got "
                                 f"{type(batch).__name__} of length {len(batch) if hasattr(batch, '__len__') else '?'}")
            out.append((batch[0], batch[1]))
        return out

    def _dp_mean(self, t):
        if self.mesh.dp > 1:
            self.mesh.communicator("dp").all_reduce(t, op="avg", tag="pipeline-loss-dp")
        return t

    def train_batch(self, data_iter=None):
        if not torch.is_grad_enabled():
            raise RuntimeError("train_batch() requires gradients enabled. Use eval_batch() instead.")
        self._need_optimizer("train_batch")
        if data_iter is not None:
            self.set_dataiterator(data_iter)
        if self.pipe_module.loss_fn is None:
            raise ValueError("train_batch(): the PipelineModule has no loss_fn; give PipelineModule(loss_fn=...)")
        batches = self._micro_batches(self.engine.gas, None)
        self.engine.train(True)
        sched = self.engine.config.pipeline_schedule
        if sched == "1f1b" and self.engine.gas < self.num_stages:
            sched = "gpipe"   # 1F1B needs a micro-batch per stage; DeepSpeed runs fewer too (the same maths)
        # engine.train_batch(batches, loss_fn) is this call on the bare engine; the hook adds the norm report
        loss = pipeline_train_batch(GradNormHook(self), self.mesh, batches, self.pipe_module.loss_fn, sched)
        return torch.tensor(loss, dtype=torch.float32)   # already the mean over the micro-batches and DP ranks

    @torch.no_grad()
    def eval_batch(self, data_iter, return_logits=False, compute_loss=True, reduce_output="avg", bcast_loss=True,
                   num_micro_batches=None):
        if reduce_output not in ("avg", None):
            raise NotImplementedError(f"reduction type {reduce_output} not supported.")   # DeepSpeed's message
        m = self.micro_batches if num_micro_batches is None else num_micro_batches
        self.engine.train(False)
        batches = self._micro_batches(m, data_iter)
        link, first, last, s = P2P(self.mesh), self.is_first_stage(), self.is_last_stage(), self.stage_id
        outputs, logits = [], None
        for x, y in batches:
            h = self.engine(x if first else link.recv(s - 1))   # the engine's forward: bf16 casts the inputs
            if last:
                logits = h
                outputs.append(self.pipe_module.loss_fn(h, y).float() if compute_loss else h)
            else:
                link.send(h, s + 1)
        link.wait()
        result = None
        if last:
            result = outputs if reduce_output is None else self._dp_mean(sum(outputs) / m)
        if compute_loss and bcast_loss and reduce_output is not None and self.num_stages > 1:
            t = result.detach().float().reshape(()) if last else torch.zeros((), dtype=torch.float32)
            self.mesh.communicator("pp").broadcast(t, src=self.num_stages - 1, tag="pipeline-eval-loss")
            result = t
        return (result, logits if last else None) if return_logits else result

    # ---------------------------------------------------------------- refused in pipeline mode, as DeepSpeed
    def __call__(self, *args, **kwargs):
        raise PipelineError("Only train_batch() is accessible in pipeline mode.")

    forward = __call__

    def backward(self, *args, **kwargs):
        raise PipelineError("Only train_batch() is accessible in pipeline mode.")

    def step(self, *args, **kwargs):
        raise PipelineError("Only train_batch() is accessible in pipeline mode.")
