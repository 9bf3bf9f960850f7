"""The training loader ``deepspeed.initialize(training_data=...)`` returns: DeepSpeed's batch order.

DeepSpeed 0.19 (``DeepSpeedEngine.deepspeed_io`` and ``DeepSpeedDataLoader``)
gives each rank a ``torch.utils.data.DistributedSampler`` with its own
defaults -- ``shuffle=True``, ``seed=0``, ``drop_last=False``, so the last
batches are padded by repeating samples -- over ``num_replicas`` = the world
size and ``rank`` = the global rank; batches of ``train_micro_batch_size_per_gpu``;
``drop_last`` of the loader from the config's ``"dataloader_drop_last"``
(default false); and a fresh ``DataLoader`` each time the loader is iterated,
with the sampler's epoch left where the script set it (DeepSpeed never calls
``set_epoch``: each epoch repeats the order unless the script calls
``loader.data_sampler.set_epoch(epoch)``). This loader does the same, so both
libraries feed a rank the same samples in the same order.

Workers: DeepSpeed starts ``2 x`` (devices per rank = 1) loader worker
processes by default, and so does this loader, under ``torchrun``, ``python
script.py`` and inside ``zl.launch`` alike (its ranks are not daemonic
processes). Only a daemonic process -- which Python forbids to have children
(``AssertionError: daemonic processes are not allowed to have children``) --
gets 0 workers by default, with a warning (the batches are the same; only who
builds them changes), and an explicit ``num_local_io_workers > 0`` there is
refused by name.
"""
from __future__ import annotations

import math
import multiprocessing
import warnings

import torch
from torch.utils.data import DataLoader, Dataset, DistributedSampler, IterableDataset


def default_workers() -> int:
    """DeepSpeed's ``2 * device_count`` (1 device per rank), or 0 (with a warning) inside a daemonic process."""
    if multiprocessing.current_process().daemon:
        warnings.warn("DeepSpeedDataLoader: this process is daemonic and cannot start loader worker processes; "
                      "loading in the main process (num_local_io_workers=0) instead of DeepSpeed's 2 workers. "
                      "The batches are the same", UserWarning, stacklevel=3)
        return 0
    return 2


class DeepSpeedDataLoader:
    """Iterate for micro-batches; ``len()`` is the number of micro-batches per epoch on this rank."""

    def __init__(self, dataset, batch_size: int, rank: int, world_size: int, collate_fn=None,
                 num_local_io_workers: int | None = None, data_sampler=None, drop_last: bool = False,
                 pin_memory: bool | None = None):
        if isinstance(dataset, IterableDataset) or not isinstance(dataset, Dataset):
            raise ValueError(f"training_data must be a map-style torch.utils.data.Dataset (DeepSpeed's "
                             f"DistributedSampler needs len() and indexing), got {type(dataset).__name__}")
        self.dataset, self.batch_size, self.collate_fn = dataset, batch_size, collate_fn
        self.data_sampler = data_sampler if data_sampler is not None else \
            DistributedSampler(dataset, num_replicas=world_size, rank=rank)   # shuffle=True, seed=0: DeepSpeed's
        self.num_local_io_workers = default_workers() if num_local_io_workers is None else num_local_io_workers
        if self.num_local_io_workers and multiprocessing.current_process().daemon:
            raise ValueError(f"num_local_io_workers={self.num_local_io_workers}: this rank is a daemonic "
                             f"process which cannot start worker processes; use 0")
        self.dataloader_drop_last = bool(drop_last)
        # DeepSpeed pins memory; on a machine without CUDA pinning only warns, so it is left off there
        self.pin_memory = torch.cuda.is_available() if pin_memory is None else pin_memory
        n = len(self.data_sampler)
        self.len = n // batch_size if self.dataloader_drop_last else math.ceil(n / batch_size)
        self.dataloader, self.data = None, None

    def __len__(self) -> int:
        return self.len

    def __iter__(self):
        self.dataloader = DataLoader(self.dataset, batch_size=self.batch_size, sampler=self.data_sampler,
                                     collate_fn=self.collate_fn, num_workers=self.num_local_io_workers,
                                     pin_memory=self.pin_memory, drop_last=self.dataloader_drop_last)
        self.data = iter(self.dataloader)
        return self

    def __next__(self):
        if self.data is None:
            raise TypeError("iterate the loader (for batch in loader / iter(loader)) before calling next() on it")
        return next(self.data)
