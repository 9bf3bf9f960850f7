"""Dropout under tensor parallelism: which random numbers each TP rank draws (Megatron-LM's RNG tracker; chapter 10).

A TP group computes one copy of the model. Where the activations are
replicated (outside the split regions: after a row-parallel layer's sum, the
embedding's output, LayerNorms), every TP rank holds the same tensor, and a
dropout there must drop the same elements on every rank, or the ranks'
"replicated" activations — and then their replicated parameters — drift apart.
Where the activations are split (between a column-parallel layer and the
row-parallel layer after it: this rank's heads or MLP columns), each rank
holds different elements of one tensor, and its dropout must draw different
numbers: with one seed every rank's heads would get the same mask, which is no
dropout of the whole tensor.

So the tracker keeps two random states beside the user's: ``"replicated"``,
seeded alike on every TP rank (TP rank 0's ``torch.initial_seed()``, agreed by
one all-reduce at conversion, whatever seeds the ranks set), and ``"split"``,
seeded by that plus 2718 plus the TP rank. Hooks switch the device's global
random state (CPU, or the parameters' CUDA device): the model's forward starts
in ``"replicated"``; a column-parallel layer's output (not gathered) enters
``"split"``; a row-parallel layer's input goes back to ``"replicated"``; at the
end of the forward the user's state is put back, untouched by the model's
dropouts. Each state carries on from where it stopped, so successive steps
draw fresh masks.
"""
from __future__ import annotations

import torch

from zerolab.parallel.layers import ColumnParallelLinear, RowParallelLinear

OFFSET = 2718   # Megatron's offset of the model-parallel seed


class RNGTracker:
    """The ``"replicated"`` and ``"split"`` random states of one TP rank (module docstring)."""

    def __init__(self, seed: int, tp_rank: int, device):
        self.device = torch.device(device)
        self.cuda = self.device.type == "cuda"
        self.seeds = {"replicated": seed, "split": seed + OFFSET + 1 + tp_rank}
        self.states = {k: torch.Generator(device=self.device).manual_seed(s).get_state()
                       for k, s in self.seeds.items()}
        self.current, self.user = None, None

    def _get(self):
        return torch.cuda.get_rng_state(self.device) if self.cuda else torch.get_rng_state()

    def _set(self, state):
        if self.cuda:
            torch.cuda.set_rng_state(state, self.device)
        else:
            torch.set_rng_state(state)

    def enter(self, region: str) -> None:
        """Draw from ``region``'s state from now on (the state left keeps where it stopped)."""
        if self.current == region:
            return
        if self.current is None:
            self.user = self._get()
        else:
            self.states[self.current] = self._get()
        self._set(self.states[region])
        self.current = region

    def leave(self) -> None:
        """Back to the user's state."""
        if self.current is not None:
            self.states[self.current] = self._get()
            self._set(self.user)
            self.current = None


def agreed_seed(comm) -> int:
    """TP rank 0's ``torch.initial_seed()`` on every TP rank (one all-reduce, a bookkeeping collective)."""
    t = torch.tensor([torch.initial_seed() % 2 ** 62 if comm.rank == 0 else 0], dtype=torch.int64)
    comm.all_reduce(t, tag="tp-rng-seed", control=True)
    return int(t.item())


def track_rng(model, comm) -> RNGTracker:
    """Install the tracker's hooks on ``model`` (converted); returns it (also ``model.tp_rng``)."""
    p = next(model.parameters(), None)
    tracker = RNGTracker(agreed_seed(comm), comm.rank, p.device if p is not None else "cpu")
    model.register_forward_pre_hook(lambda m, a: tracker.enter("replicated"))
    model.register_forward_hook(lambda m, a, o: tracker.leave(), always_call=True)
    for m in model.modules():
        if isinstance(m, ColumnParallelLinear) and not m.gather_output:
            m.register_forward_hook(lambda mod, a, o: tracker.enter("split"))
        elif isinstance(m, RowParallelLinear):
            m.register_forward_pre_hook(lambda mod, a: tracker.enter("replicated"))
    model.tp_rng = tracker
    return tracker
