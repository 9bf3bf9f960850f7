"""``deepspeed.utils``: ``RepeatingLoader``, which restarts a loader whenever it runs out (DeepSpeed's, same behaviour)."""
from __future__ import annotations


class RepeatingLoader:
    """Iterate ``loader`` for ever: on ``StopIteration`` start it again (a new epoch of its sampler's order)."""

    def __init__(self, loader):
        self.loader = loader
        self.data_iter = iter(loader)

    def __iter__(self):
        return self

    def __next__(self):
        try:
            return next(self.data_iter)
        except StopIteration:
            self.data_iter = iter(self.loader)
            return next(self.data_iter)
