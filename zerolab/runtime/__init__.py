"""The runtime: ranks, collectives and measurements (chapters 0-2).

Files: ``launch`` (``zl.launch``: one process per rank from a notebook cell or
under torchrun), ``collect`` (the parent waiting for the ranks' results; ``LaunchError``),
``rank`` (the rank's side of launch), ``comm`` (the
Communicator and its byte ledger), ``nodes`` (simulated nodes: groups, which
bytes cross nodes), ``measure`` (census, peak memory,
``MemoryReport``), ``timing`` (step timers), ``gpu_check`` (the nccl path on
GPUs). Imports torch and the theory; never the engine, the book or the bench.
"""
