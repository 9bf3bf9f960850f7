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


def mesh_share(psi, n_gpus, tp=1, pp=1, replicated=0) -> tuple[int, int]:
    """3D (chapter 10): (the parameters one rank's model-parallel slice holds, the DP size).

    TP and PP split the model ``tp * pp`` ways, except the ``replicated`` parameters every TP
    rank keeps whole (LayerNorms, row-parallel biases): ceil((Ψ - R) / (tp·pp)) + ceil(R / pp).
    Exact for pp = 1 with even splits; under PP it assumes the stages hold equal shares. ZeRO then
    shards that slice over the DP group of ``n_gpus / (tp * pp)`` ranks."""
    psi, n = check_psi_n(psi, n_gpus)
    for name, v in (("tp", tp), ("pp", pp)):
        if isinstance(v, bool) or not isinstance(v, int) or v < 1:
            raise ValueError(f"{name} must be an integer >= 1, got {v!r}")
    if n % (tp * pp):
        raise ValueError(f"n_gpus={n} is not a multiple of tp*pp = {tp * pp}: the DP size n_gpus/(tp*pp) "
                         f"must be a whole number")
    if isinstance(replicated, bool) or not isinstance(replicated, (int, float)) or not 0 <= replicated <= psi \
            or replicated != int(replicated):
        raise ValueError(f"replicated must be a whole number of parameters in 0..psi ({psi}), got {replicated!r}")
    r = int(replicated)
    return -(-(psi - r) // (tp * pp)) + -(-r // pp), n // (tp * pp)
