"""``deepspeed.runtime.utils.set_random_seed``: seed Python's, NumPy's and torch's generators, as DeepSpeed does."""
from __future__ import annotations

import random

import torch


def set_random_seed(seed: int) -> None:
    """``random.seed``, ``numpy.random.seed`` (if NumPy is installed) and ``torch.manual_seed`` with ``seed``."""
    random.seed(seed)
    try:
        import numpy as np
    except ImportError:
        pass
    else:
        np.random.seed(seed)
    torch.manual_seed(seed)
