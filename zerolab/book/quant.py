"""Blockwise int8 / int4 quantization of a flat tensor: ZeRO++'s qwZ and qgZ, measured (chapter 9).

The kernel is the engine's (``zerolab.engine.zeropp.quantize``, which ZeRO++'s
collectives use); this module wraps it for one flat tensor so the book can
measure bytes and errors on real tensors, single process.

Symmetric block quantization: the flat tensor is cut into blocks of ``block``
elements; each block gets one fp32 scale s = max|x| / qmax (qmax = 127 for
int8, 7 for int4) and stores q = round(x / s) in [-qmax, qmax]. Dequantized
x' = q * s, so every element's error is at most s / 2 (half a step). int4
values are packed two per byte. Bytes sent = payload + 4 bytes per block.

``reduce_quantized`` simulates a gradient sum over N ranks when every
transfer is quantized: a ring reduce-scatter re-quantizes the partial sum at
each of its N-1 hops (errors pile up), while qgZ's all-to-all quantizes each
rank's contribution once and sums in full precision on arrival.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from zerolab.engine.zeropp.quantize import QMAX, dequantize_rows, pack_int4, quantize_rows, unpack_int4


@dataclass
class Quantized:
    """A quantized flat tensor: what would go over the wire."""
    data: torch.Tensor     # int8 (numel,) for 8 bits; uint8 (ceil(numel/2),) packed nibbles for 4 bits
    scales: torch.Tensor   # fp32 (n_blocks,): one scale per block
    numel: int
    bits: int
    block: int
    dtype: torch.dtype     # dtype of the original tensor

    @property
    def nbytes(self) -> int:
        """Payload + scales: the bytes a transfer of this tensor sends."""
        return self.data.numel() * self.data.element_size() + self.scales.numel() * 4


def _check(x: torch.Tensor, bits: int, block: int):
    if bits not in QMAX:
        raise ValueError(f"bits must be one of {tuple(QMAX)}, got {bits!r}")
    if isinstance(block, bool) or not isinstance(block, int) or block < 1:
        raise ValueError(f"block must be an integer >= 1, got {block!r}")
    if not torch.is_tensor(x) or not x.is_floating_point():
        raise ValueError("x must be a floating-point tensor")


def quantize(x: torch.Tensor, bits: int = 8, block: int = 2048) -> Quantized:
    """Symmetric blockwise quantization of ``x`` (flattened) to ``bits`` (8 or 4)."""
    _check(x, bits, block)
    flat = x.detach().reshape(1, -1)                        # (1, numel)
    q, scales = quantize_rows(flat, bits, block)            # int8 (1, numel), fp32 (1, n_blocks)
    data = q[0] if bits == 8 else pack_int4(q)[0]           # (numel,) int8 or (ceil(numel/2),) uint8
    return Quantized(data, scales[0], flat.shape[1], bits, block, x.dtype)


def dequantize(qt: Quantized, dtype: torch.dtype | None = None) -> torch.Tensor:
    """The flat tensor ``qt`` stands for, in ``dtype`` (default: the original dtype)."""
    q = qt.data.view(1, -1) if qt.bits == 8 else unpack_int4(qt.data.view(1, -1), qt.numel)
    return dequantize_rows(q, qt.scales.view(1, -1), qt.block, dtype or qt.dtype)[0]


def roundtrip(x: torch.Tensor, bits: int = 8, block: int = 2048) -> torch.Tensor:
    """dequantize(quantize(x)) reshaped like ``x``."""
    return dequantize(quantize(x, bits, block)).reshape(x.shape)


def error_report(x: torch.Tensor, bits: int = 8, block: int = 2048) -> dict:
    """Bytes and errors of one quantized transfer of ``x``."""
    qt = quantize(x, bits, block)
    xf = x.detach().reshape(-1).float()
    err = (dequantize(qt, torch.float32) - xf).abs()
    return {"bits": bits, "block": block, "numel": qt.numel,
            "bytes_original": xf.numel() * x.element_size(), "bytes_quantized": qt.nbytes,
            "max_abs_error": float(err.max()), "max_half_step": float(qt.scales.max() / 2),
            "relative_error": float(err.norm() / xf.norm()) if float(xf.norm()) > 0 else 0.0}


def reduce_quantized(chunks: list[torch.Tensor], bits: int = 4, block: int = 2048,
                     scheme: str = "all_to_all") -> torch.Tensor:
    """Sum of N ranks' tensors when every transfer is quantized (simulated in one process).

    ``"ring"``: the running sum travels rank 0 -> 1 -> ... -> N-1 and is quantized
    before each of the N-1 sends, so the last rank receives an error added N-1 times.
    ``"all_to_all"`` (qgZ): each of the other ranks quantizes its own tensor once; the
    receiver dequantizes them and sums in fp32 with its own, unquantized, tensor.
    """
    if scheme not in ("ring", "all_to_all"):
        raise ValueError(f"scheme must be 'ring' or 'all_to_all', got {scheme!r}")
    if not chunks:
        raise ValueError("chunks must hold at least one tensor")
    if scheme == "ring":
        acc = chunks[0].float()
        for c in chunks[1:]:
            acc = roundtrip(acc, bits, block).float() + c.float()   # receive quantized partial sum, add own
        return acc
    acc = chunks[-1].float().clone()                                 # the receiver's own part
    for c in chunks[:-1]:
        acc += roundtrip(c.float(), bits, block).float()
    return acc
