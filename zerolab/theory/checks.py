"""Argument checks every formula of the theory shares (chapters 1-2).

One place for "what is a valid Ψ, N, stage": the memory model (``memory``) and
the communication model (``comm``) both call these, so neither imports the other
for them.
"""
from __future__ import annotations

STAGES = (0, 1, 2, 3)


def choice(name, value, allowed):
    """``value`` if it is one of ``allowed``, else a ValueError naming both."""
    if value not in allowed:
        raise ValueError(f"{name}={value!r} is not allowed; expected one of {allowed}")
    return value


def check_psi_n(psi, n_gpus) -> tuple[int, int]:
    """Validate and normalise Ψ (may be written 7.5e9) and N."""
    if isinstance(psi, bool) or not isinstance(psi, (int, float)) or psi <= 0 or psi != psi:
        raise ValueError(f"psi (number of parameters) must be a number > 0, got {psi!r}")
    if isinstance(n_gpus, bool) or not isinstance(n_gpus, int) or n_gpus < 1:
        raise ValueError(f"n_gpus must be an integer >= 1, got {n_gpus!r}")
    return int(round(psi)), n_gpus
