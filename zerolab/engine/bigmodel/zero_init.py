"""``zl.zero_init()``: build a model partitioned, keeping the values its own constructor gives (chapter 6).

A model built on the meta device has shapes and no values; ``initialize`` then
fills it unit by unit from each module's ``reset_parameters()`` (and a Hugging
Face model's ``_init_weights``). Whatever else a constructor does — a custom
``nn.init`` call in ``__init__``, a buffer computed from the config — is lost
unless a hook redoes it. ``zero_init`` is the other way in, the idea of
DeepSpeed's ``zero.Init``: every module is built for real, and as soon as it
is complete (when it is attached to its parent; the root's own parameters when
the ``with`` block ends) each of its parameters is cut into N pieces, this
rank keeps its piece and the parameter goes to the meta device. So no rank
ever holds more than one module whole, and the values that are sharded are the
constructor's own. ``initialize`` gathers the pieces unit by unit into its flat
buffers (``materialize``). Rank 0's values win (each parameter is broadcast
from it before it is cut), so ranks need not share a random seed. Buffers are
left as built (they are not partitioned).

A module is complete when it is attached to its parent: a parent that changes
a child's values after ``self.child = ...`` changes a partitioned parameter (a
no-op on the meta device), as under DeepSpeed's ``zero.Init`` — set them before
attaching, or afterwards inside ``zl.gathered_parameters``. A Hugging Face
model's ``post_init`` is such a change (``_init_weights`` on every module after
all are built), so for one ``initialize`` applies it unit by unit, as for a
meta-device model (``materialize.construct``).

Every rank must build the same model inside the block (the broadcasts pair up
in construction order). One rank (no process group): the pieces are the whole
parameters and nothing is communicated.
"""
from __future__ import annotations

import itertools
from contextlib import contextmanager

import torch
import torch.distributed as dist
from torch import nn


def rank_world():
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


_ORDER = itertools.count()   # partition order, the same on every rank: collectives over pieces follow it


def cut_piece(flat: torch.Tensor, rank: int, world: int) -> torch.Tensor:
    """This rank's piece of the flattened values ``flat``: ceil(numel / N) elements, zero-padded at the end."""
    n = flat.numel()
    size = -(-n // world)
    mine = torch.zeros(size, dtype=flat.dtype, device=flat.device)
    lo, hi = min(rank * size, n), min((rank + 1) * size, n)
    mine[: hi - lo].copy_(flat[lo:hi])
    return mine


def partition(p: nn.Parameter, rank: int, world: int, dtype: torch.dtype | None = None) -> None:
    """Keep this rank's piece of ``p`` (rank 0's values; a floating one in ``dtype`` if given) and move
    ``p`` to the meta device, the same Python object; ``p._zl_order`` is its place in partition order."""
    if p.is_meta or getattr(p, "_zl_piece", None) is not None:
        return
    data = p.detach()
    if world > 1:
        data = data.contiguous()
        dist.broadcast(data, src=0)
    if dtype is not None and data.dtype.is_floating_point:
        data = data.to(dtype)
    mine = cut_piece(data.reshape(-1), rank, world)
    meta = nn.Parameter(torch.empty(p.shape, dtype=data.dtype, device="meta"), requires_grad=p.requires_grad)
    torch.utils.swap_tensors(p, meta)
    p._zl_piece, p._zl_order = mine, next(_ORDER)


def gather_piece(p: nn.Parameter, communicator) -> torch.Tensor:
    """The whole of a ``zero_init`` parameter, (numel,), from every rank's piece (a collective)."""
    mine = p._zl_piece
    if communicator.world_size == 1:
        return mine[: p.numel()]
    out = torch.empty(mine.numel() * communicator.world_size, dtype=mine.dtype, device=mine.device)
    communicator.all_gather(out, mine, tag="zero-init")
    return out[: p.numel()]


@contextmanager
def zero_init(dtype: torch.dtype | None = None):
    """Inside the block, every module is partitioned as soon as it is built (module docstring);
    ``dtype``: floating parameters are kept in it (``deepspeed.zero.Init(dtype=)``)."""
    rank, world = rank_world()

    def on_register(parent, name, child):
        if child is not None:   # the child's __init__ has finished: its values are final
            for p in child.parameters():
                partition(p, rank, world, dtype)
        return None

    handle = nn.modules.module.register_module_module_registration_hook(on_register)
    roots = []
    original = nn.Module.__init__

    def track(self, *args, **kwargs):
        original(self, *args, **kwargs)
        roots.append(self)

    try:
        nn.Module.__init__ = track
        yield
    finally:
        nn.Module.__init__ = original
        handle.remove()
    for m in roots:   # the root's (and any unattached module's) own parameters, now that __init__ is done
        for p in m.parameters(recurse=False):
            partition(p, rank, world, dtype)
    for m in roots:
        where_it_runs(m)


def where_it_runs(module: nn.Module) -> None:
    """Tell a Hugging Face model the device its partitioned parameters will run on. Its ``device``
    property reads the first parameter, here a meta placeholder (DeepSpeed's placeholders are empty
    tensors on the accelerator), and transformers >= 5.25 picks hub kernels for that device when
    ``from_pretrained`` ends, refusing "meta". ``_kernels_device`` is the attribute transformers itself
    sets for a model whose offloaded parameters are on the meta device."""
    if not hasattr(type(module), "set_use_kernels"):
        return
    pieces = [p._zl_piece for p in module.parameters() if getattr(p, "_zl_piece", None) is not None]
    if pieces and getattr(module, "_kernels_device", None) is None:
        module._kernels_device = pieces[0].device.type
