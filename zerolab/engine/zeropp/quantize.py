"""Block quantization to int8 / int4: the kernel under ZeRO++'s qwZ and qgZ (chapter 9).

Symmetric block quantization: a row of L elements is cut into groups of G
consecutive elements (the last one may be shorter); each group gets one fp32
scale s = max|x| / qmax (qmax = 127 for int8, 7 for int4) and stores
q = round(x / s) in [-qmax, qmax]. Dequantized x' = q * s, so every element's
error is at most s / 2 (half a step). int4 values are stored two per byte.

What travels in a collective is one ``uint8`` row per destination, made by
``pack``: the payload, then the scales' bytes,

    | q (L bytes for int8, ceil(L / 2) for int4) | 4 * ceil(L / G) bytes of fp32 scales |

so one collective carries both and ``packed_bytes(L, bits, G)`` is exactly
what the ledger books. ``unpack`` reverses it. Rows are quantized
independently, so a row never shares a group (or a scale) with another
destination's data. Pure torch, any device; the engine (``zeropp.py``) and the
book's quantization demo (``book/quant.py``) both use it.
"""
from __future__ import annotations

import torch

from zerolab.theory.comm import quantized_bytes

QMAX = {8: 127, 4: 7}


def _check(bits: int, group: int) -> None:
    if bits not in QMAX:
        raise ValueError(f"bits must be one of {tuple(QMAX)}, got {bits!r}")
    if isinstance(group, bool) or not isinstance(group, int) or group < 1:
        raise ValueError(f"group size must be an integer >= 1, got {group!r}")


def n_groups(length: int, group: int) -> int:
    """Groups (scales) in a row of ``length`` elements."""
    return max(1, -(-length // group))


def payload_bytes(length: int, bits: int) -> int:
    return length if bits == 8 else -(-length // 2)


def packed_bytes(length: int, bits: int, group: int) -> int:
    """Bytes ``pack`` makes of one row: payload + 4 bytes per group (the theory's ``quantized_bytes``)."""
    _check(bits, group)
    return quantized_bytes(length, bits, group)


def quantize_rows(x: torch.Tensor, bits: int, group: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(R, L) floats -> (q: int8 (R, L) in [-qmax, qmax], scales: fp32 (R, groups))."""
    _check(bits, group)
    rows, length = x.shape
    ng = n_groups(length, group)
    xf = x.float()
    if ng * group != length:          # pad the last group with zeros (they do not change its max)
        xf = torch.nn.functional.pad(xf, (0, ng * group - length))
    blocks = xf.view(rows, ng, group)                                   # (R, groups, G)
    qmax = QMAX[bits]
    scales = blocks.abs().amax(dim=2) / qmax                            # (R, groups) fp32
    safe = torch.where(scales > 0, scales, torch.ones_like(scales))
    q = torch.round(blocks / safe[:, :, None]).clamp_(-qmax, qmax).to(torch.int8)
    return q.view(rows, ng * group)[:, :length], scales


def dequantize_rows(q: torch.Tensor, scales: torch.Tensor, group: int, dtype=torch.float32) -> torch.Tensor:
    """The inverse of ``quantize_rows``: (R, L) in ``dtype``."""
    rows, length = q.shape
    ng = scales.shape[1]
    vals = q.float()
    if ng * group != length:
        vals = torch.nn.functional.pad(vals, (0, ng * group - length))
    return (vals.view(rows, ng, group) * scales[:, :, None]).view(rows, ng * group)[:, :length].to(dtype)


def pack_int4(q: torch.Tensor) -> torch.Tensor:
    """int8 (R, L) values in [-7, 7] -> uint8 (R, ceil(L/2)): two per byte, offset to 1..15."""
    u = (q + 8).to(torch.uint8)
    if u.shape[1] % 2:
        u = torch.nn.functional.pad(u, (0, 1), value=8)
    return u[:, 0::2] | (u[:, 1::2] << 4)


def unpack_int4(p: torch.Tensor, length: int) -> torch.Tensor:
    lo, hi = (p & 0x0F).to(torch.int8) - 8, (p >> 4).to(torch.int8) - 8
    return torch.stack([lo, hi], dim=2).view(p.shape[0], -1)[:, :length]


def pack(x: torch.Tensor, bits: int, group: int) -> torch.Tensor:
    """(R, L) floats -> uint8 (R, packed_bytes(L)): each row's payload, then its scales' bytes."""
    q, scales = quantize_rows(x, bits, group)
    payload = q.view(torch.uint8) if bits == 8 else pack_int4(q)
    return torch.cat([payload, scales.contiguous().view(torch.uint8)], dim=1)


def unpack(buf: torch.Tensor, length: int, bits: int, group: int, dtype=torch.float32) -> torch.Tensor:
    """uint8 (R, packed_bytes(length)) -> (R, length) in ``dtype``."""
    n = payload_bytes(length, bits)
    payload, scale_bytes = buf[:, :n], buf[:, n:].contiguous()
    q = payload.contiguous().view(torch.int8) if bits == 8 else unpack_int4(payload, length)
    return dequantize_rows(q, scale_bytes.view(torch.float32), group, dtype)
