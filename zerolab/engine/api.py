"""The engine's methods beyond the training loop: inspection, state dicts, checkpoints (chapters 1, 6, 8).

``EngineAPI`` is the part of ``Engine`` a user calls around training rather
than in it, each a thin door to the file that does the work:

    memory()                 bytes this rank holds, by category (chapter 1's Table 1, measured)
    comm                     the ledger of algorithm bytes (``runtime/comm.py``)
    full_state_dict()        consolidated fp32 parameters (``checkpoint/state.py``)
    save_checkpoint() ...    sharded, atomic checkpoints at any world size (``checkpoint/``, chapter 8)
    load_state_dict()        a dict or file, each rank copying only its shard (``bigmodel/load.py``)
    train_batch()            one step over a list of micro-batches, pipelined when pp > 1 (``parallel/pipeline``)
    train() / eval() / close()
"""
from __future__ import annotations

import torch

from zerolab.engine.bigmodel.load import load_state_dict
from zerolab.engine.checkpoint.ds_engine import save_deepspeed
from zerolab.engine.checkpoint.load import load_checkpoint
from zerolab.engine.checkpoint.mesh import (is_mesh_checkpoint, load_mesh_checkpoint, save_16bit_mesh,
                                           save_mesh_checkpoint)
from zerolab.engine.checkpoint.mesh_state import full_state_dict as full_state_dict_3d, is_3d, original_layout
from zerolab.engine.checkpoint.save import save_16bit_model, save_checkpoint
from zerolab.engine.checkpoint.state import consolidated_state_dict
from zerolab.parallel.pipeline import train_batch as pipeline_train_batch
from zerolab.runtime.comm import CommLedger
from zerolab.runtime.measure import MemoryReport, storage_bytes


class EngineAPI:
    """Inspection, state dicts and checkpoints of an engine (mixed into ``Engine``)."""

    @property
    def comm(self) -> CommLedger:
        return self.communicator.ledger

    def memory(self) -> MemoryReport:
        """Bytes this rank holds right now, by category (chapter 1's Table 1, measured).

        params: the flat 16-bit (or fp32) parameters, padded, plus frozen ones; grads: the
        gradient buffer (stage 2: the shard); optimizer: fp32 master + state; buffers: the
        model's buffers, staging buckets and in-flight temporaries."""
        frozen = {p.untyped_storage().data_ptr(): storage_bytes(p) for _, p in self.flat.frozen}
        buffers = {b.untyped_storage().data_ptr(): storage_bytes(b) for b in self.module.buffers()}
        return MemoryReport(
            params=storage_bytes(self.flat.flat) + sum(frozen.values()),
            grads=self.grad_bytes(),
            optimizer=storage_bytes(self.master) + self.optimizer.nbytes(),
            buffers=sum(buffers.values()) + self.transient_bytes())

    def train_batch(self, batches, loss_fn) -> float:
        """Collective: one optimizer step over ``batches`` (a list of (inputs, targets), as many as
        gradient_accumulation_steps), through the pipeline when the mesh has pp > 1 (schedule:
        ``config["zerolab"]["pipeline_schedule"]``, "1f1b" or "gpipe"), else plain accumulation.
        Returns the mean loss over the micro-batches and the DP group, the same on every rank;
        ``self.pipeline_stats`` then holds what the step measured (``parallel/pipeline_stats.py``)."""
        return pipeline_train_batch(self, getattr(self, "mesh", None), batches, loss_fn,
                                    self.config.pipeline_schedule)

    def train(self, mode: bool = True):
        self.module.train(mode)
        return self

    def eval(self):
        return self.train(False)

    def parameters(self):
        return self.module.parameters()

    def param_shape(self, p) -> torch.Size:
        """A trainable parameter's full shape (stage 3 overrides it: a released parameter is empty)."""
        return p.shape

    def full_state_dict(self, rank0_only: bool = False) -> dict | None:
        """Collective: the model's state dict with consolidated fp32 parameters, on every rank; with
        ``rank0_only`` on rank 0 only (the others hold one unit at a time and get None). Under a 3D
        mesh: gathered over TP, PP and DP, original names and full shapes (checkpoint/mesh_state.py)."""
        if is_3d(self):
            return full_state_dict_3d(self, rank0_only)
        return original_layout(self.module, consolidated_state_dict(self, rank0_only))

    # ---------------------------------------------------------------- checkpoints (chapter 8)
    def save_checkpoint(self, save_dir, tag=None, client_state=None, exclude_frozen_parameters=False,
                        format="zerolab") -> str:
        """Collective: save to ``save_dir/<tag>`` (default ``global_step{N}``), atomically (checkpoint/save.py;
        under a 3D mesh, one folder per (tp, pp) coordinate and ``mesh.json``: checkpoint/mesh.py);
        ``format="deepspeed"``: DeepSpeed's ZeRO files (checkpoint/ds_engine.py; not under a 3D mesh)."""
        if format != "zerolab":
            if is_3d(self):
                raise NotImplementedError(f"save_checkpoint(format={format!r}) under a 3D mesh: zerolab's only")
            return save_deepspeed(self, save_dir, tag, client_state, exclude_frozen_parameters, format)
        if is_3d(self):
            return save_mesh_checkpoint(self, save_dir, tag, client_state, exclude_frozen_parameters)
        return save_checkpoint(self, save_dir, tag, client_state, exclude_frozen_parameters)

    def load_checkpoint(self, load_dir, tag=None, load_optimizer_states=True, load_lr_scheduler_states=True):
        """Collective: load ``load_dir/<tag>`` (default: ``latest``), at any world size and stage, and any
        mesh (checkpoint/mesh.py); returns ``(path, client_state)``, ``(None, None)`` if there is none."""
        if is_3d(self) or is_mesh_checkpoint(load_dir, tag):
            return load_mesh_checkpoint(self, load_dir, tag, load_optimizer_states, load_lr_scheduler_states)
        return load_checkpoint(self, load_dir, tag, load_optimizer_states, load_lr_scheduler_states)

    def save_16bit_model(self, save_dir, filename="pytorch_model.bin", exclude_frozen_parameters=False):
        """Collective: rank 0 writes the whole model in its compute dtype (gathered at stage 3)."""
        if is_3d(self):   # the whole model from every (tp, pp) coordinate, written by global rank 0
            return save_16bit_mesh(self, save_dir, filename)
        return save_16bit_model(self, save_dir, filename, exclude_frozen_parameters)

    def load_state_dict(self, state_dict_or_path, strict: bool = True):
        """Load a dict, a ``.pt`` or a ``.safetensors`` file (memory-mapped) into the parameters:
        each rank copies only its own shard's elements (``bigmodel/load.py``). Call on every rank."""
        return load_state_dict(self, state_dict_or_path, strict)

    def close(self) -> None:
        """Remove the hooks (the model keeps its flat-buffer parameters)."""
        for h in self._hooks:
            h.remove()
        self._hooks = []
