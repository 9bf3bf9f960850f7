"""Stage 0: data parallelism (DDP) from scratch (chapter 3).

Every rank holds the whole model, all gradients and the whole optimizer.
The one idea: after backward, every rank must hold the *same* gradient, the
mean over ranks, so each rank's update is identical. Gradients are
accumulated in place in one flat buffer (``p.grad`` is a view into it), and
as soon as a bucket of ``reduce_bucket_size`` elements has all its gradients
(hooks count them during backward), that slice of the buffer is all-reduced;
with ``overlap_comm`` the all-reduce runs while backward computes the
gradients of earlier layers. With gradient accumulation only the boundary
micro-batch's backward communicates (DDP's ``no_sync``).

Bytes per step: one all-reduce of Ψ gradient elements, 2Ψ(N-1)/N x dtype bytes.
Gradients are reduced in their accumulation dtype (see ``precision``).
"""
from __future__ import annotations

import torch

from zerolab.engine.base import Engine
from zerolab.runtime.measure import storage_bytes


class Stage0Engine(Engine):
    stage = 0

    def own(self, buf: torch.Tensor, u) -> torch.Tensor:
        """The part of unit ``u`` this rank updates: all of it."""
        return self.flat.unit_view(buf, u)

    def build_grads(self) -> None:
        """Full gradients, accumulated in place through ``p.grad`` views."""
        # flat grads, grad dtype: padded Ψ elements (every parameter, on every rank)
        self.grads = torch.zeros(self.flat.padded, dtype=self.precision.grad_dtype, device=self.flat.device)
        self._grad_views = self.flat.param_views(self.grads)
        self._views_are_grads = self.precision.grad_dtype == self.precision.compute_dtype
        if self._views_are_grads:
            for p in self.flat.params():
                p.grad = self._grad_views[id(p)]

    def local_grad(self, p) -> torch.Tensor:
        if not self.keeps_full_grads:   # stage 2 and up inherit this file but keep shards only
            return super().local_grad(p)
        return self._grad_views[id(p)]

    def keep_grad(self, p) -> None:
        """Autograd accumulated into ``p.grad``: make sure the gradient is in the flat buffer."""
        view = self._grad_views[id(p)]
        g = p.grad
        if g is None or g.data_ptr() == view.data_ptr():
            return  # already accumulated in place
        view.add_(g)  # a 16-bit gradient into fp32 accumulation, or p.grad was reset by the user
        p.grad = view if self._views_are_grads else None

    def reduce_bucket(self, i: int) -> None:
        self.all_reduce_grads(i)

    def all_reduce_grads(self, i: int) -> None:
        """All-reduce (sum) bucket ``i``: one contiguous slice of the flat gradients, in place."""
        b = self.buckets[i]
        start, end = b[0].offset, b[-1].offset + b[-1].padded
        h = self.communicator.all_reduce(self.grads[start:end], async_op=self.overlap_comm, tag=f"grad-bucket-{i}")
        self.track(h, index=i)

    def owned_grads(self) -> list[torch.Tensor]:
        """The reduced gradients the optimizer reads: all of them."""
        return [self.own(self.grads, u) for u in self.flat.units]

    def zero_grads(self) -> None:
        self.grads.zero_()

    def after_update(self) -> None:
        """Every rank updated every parameter identically: nothing to exchange."""

    def grad_bytes(self) -> int:
        return storage_bytes(self.grads)
