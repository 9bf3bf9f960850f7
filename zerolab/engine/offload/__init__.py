"""Offload (chapter 7): ZeRO-Offload's optimizer on the CPU and ZeRO-Infinity's parameters off the device.

    optimizer.py        ``OffloadOptimizer``: the rank's optimizer state and step on the host, state in RAM or on NVMe
    optimizer_mixin.py  ``OffloadMixin``: what an engine changes for it (gradients to the host during backward)
    params.py           ``ParamOffloadMixin``: stage 3's parameter shard in host RAM or on NVMe
    nvme.py             the swap files: chunks read ahead and written behind
    engines.py          the named engine classes (``Stage2OffloadEngine`` ...) and ``offload_engine``
"""
