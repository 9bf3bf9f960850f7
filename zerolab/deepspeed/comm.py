"""``deepspeed.comm`` for zerolab: ``init_distributed`` and the process-group calls training scripts make.

DeepSpeed's ``comm`` module is a thin layer over ``torch.distributed`` with
the same function names; so is this one. ``init_distributed`` follows
DeepSpeed 0.19's rules: nothing to do when ``torch.distributed`` is already
initialised (inside ``zl.launch`` it is); ``env://`` when a launcher set
``RANK``, ``WORLD_SIZE``, ``MASTER_ADDR`` and ``MASTER_PORT`` (torchrun).
One difference: where DeepSpeed would try MPI discovery (``python script.py``
without a launcher), zerolab starts a one-rank group, so the same script runs
as a single process.
"""
from __future__ import annotations

import os
import tempfile
from datetime import timedelta

import torch
import torch.distributed as dist

from zerolab.runtime.group_exit import close_at_exit

ReduceOp = dist.ReduceOp
TORCH_DISTRIBUTED_DEFAULT_PORT = 29500    # DeepSpeed's constant of that name
# DeepSpeed's default_pg_timeout: DEEPSPEED_TIMEOUT minutes, 30 when unset
default_pg_timeout = timedelta(minutes=int(os.environ.get("DEEPSPEED_TIMEOUT", "30")))
_LAUNCHER_ENV = ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")


def init_distributed(dist_backend: str | None = None, auto_mpi_discovery: bool = True,
                     distributed_port: int = TORCH_DISTRIBUTED_DEFAULT_PORT, verbose: bool = True,
                     timeout: timedelta = default_pg_timeout, init_method: str | None = None,
                     dist_init_required: bool | None = None, config=None, rank: int = -1,
                     world_size: int = -1) -> None:
    """Initialise ``torch.distributed`` if it is not (DeepSpeed's signature and defaults).

    ``dist_backend``: None picks nccl when CUDA is available, else gloo. Already initialised:
    returns (``dist_init_required=True`` too, as DeepSpeed, which only logs). ``dist_init_required
    =False`` with no process group raises, as DeepSpeed's assertion does.
    """
    if dist.is_initialized():
        return
    if dist_init_required is False:
        raise RuntimeError("deepspeed.init_distributed(dist_init_required=False): torch.distributed is not "
                           "initialised; set dist_init_required=True (or None) or initialise it first")
    if not isinstance(timeout, timedelta):
        raise TypeError(f"timeout must be a datetime.timedelta, got {type(timeout).__name__}")
    backend = dist_backend or ("nccl" if torch.cuda.is_available() else "gloo")
    if init_method is not None or all(k in os.environ for k in _LAUNCHER_ENV):
        dist.init_process_group(backend, init_method=init_method or "env://", timeout=timeout,
                                rank=rank, world_size=world_size)
        os.environ.setdefault("LOCAL_RANK", str(dist.get_rank()))   # DeepSpeed requires it; torchrun sets it
        close_at_exit()
        return
    if rank > 0 or world_size > 1:
        raise ValueError(f"init_distributed(rank={rank}, world_size={world_size}) needs init_method= or a "
                         f"launcher's environment ({', '.join(_LAUNCHER_ENV)}); start the script with torchrun")
    # no launcher: a one-rank group over a private FileStore (DeepSpeed would attempt MPI discovery here)
    store = dist.FileStore(os.path.join(tempfile.mkdtemp(prefix="zerolab-ds-"), "store"), 1)
    dist.init_process_group(backend, store=store, rank=0, world_size=1, timeout=timeout)
    close_at_exit()
    for k, v in (("RANK", "0"), ("WORLD_SIZE", "1"), ("LOCAL_RANK", "0"), ("LOCAL_WORLD_SIZE", "1")):
        os.environ.setdefault(k, v)


def destroy_process_group(group=None):
    _check()
    dist.destroy_process_group(group)


def _check():
    if not dist.is_initialized():
        raise RuntimeError("deepspeed.comm: the distributed backend is not initialised; call "
                           "deepspeed.init_distributed() or deepspeed.initialize() first")


def is_initialized() -> bool:
    return dist.is_initialized()


def get_rank(group=None) -> int:
    _check()
    return dist.get_rank(group)


def get_world_size(group=None) -> int:
    _check()
    return dist.get_world_size(group)


def get_local_rank() -> int:
    """The launcher's ``LOCAL_RANK`` (the device index on a GPU node)."""
    _check()
    return int(os.environ.get("LOCAL_RANK", "0"))


def barrier(group=None, async_op=False, device_ids=None, prof=False, log_name="barrier", debug=None):
    _check()
    return dist.barrier(group=group, async_op=async_op, device_ids=device_ids)


def all_reduce(tensor, op=ReduceOp.SUM, group=None, async_op=False, prof=False, log_name="all_reduce", debug=None):
    _check()
    return dist.all_reduce(tensor, op=op, group=group, async_op=async_op)


def broadcast(tensor, src, group=None, async_op=False, prof=False, log_name="broadcast", debug=None):
    _check()
    return dist.broadcast(tensor, src, group=group, async_op=async_op)


def all_gather(tensor_list, tensor, group=None, async_op=False, prof=False, log_name="all_gather", debug=None):
    _check()
    return dist.all_gather(tensor_list, tensor, group=group, async_op=async_op)
