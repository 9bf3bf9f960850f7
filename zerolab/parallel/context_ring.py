"""Ring attention: context parallelism by passing keys and values around a ring (chapter 11).

Liu, Zaharia and Abbeel 2023 ("Ring Attention with Blockwise Transformers").
Each of the cp ranks of a ``"cp"`` group holds s/cp consecutive tokens: its chunk of
q, k and v (chunk r on rank r). Its queries must meet every key, so the key/value
chunks travel: at each of cp - 1 steps every rank sends the K/V chunk it holds to
the next rank and receives one from the previous (at step j rank r holds chunk
(r - j) mod cp). Nothing is gathered: a rank never holds more than two K/V chunks.

The partial results are combined exactly with the *online softmax*: for each chunk
the block's output o_j (softmax over that chunk's keys only) and its log-sum-exp
l_j = log Σ exp(scores) (the running maximum is inside ``logsumexp``). Two partial
results combine as

    l = log(exp(l_a) + exp(l_b)),    o = o_a · exp(l_a - l) + o_b · exp(l_b - l)

— the running sum rescaled to the new normaliser — so the result equals softmax
over all keys. Causal masking goes by chunk index: chunk r's own block is masked
inside (the diagonal), chunks of earlier ranks are seen whole, later ones not at all
(their K/V still pass through: rank 0 idles while rank cp-1 works; the zig-zag
layouts that balance this are not modelled here).

Backward is a second ring pass (as in ring-flash-attention): from the saved output
and log-sum-exp each block's probabilities are recomputed, dQ stays home, and each
chunk's dK, dV accumulators travel with its K/V, every rank adding its queries' part;
after the last step one more hop brings each accumulator home. Per layer a rank sends
(``theory/context.py``): forward (cp - 1) K/V chunks, backward (cp - 1) K/V chunks with
their dK/dV and one last dK/dV. Every send is booked in the ``"cp"`` group's ledger
(``group="cp"``, op ``"send"``); receives book nothing.
"""
from __future__ import annotations

import time

import torch
import torch.distributed as dist

from zerolab.parallel.context_ulysses import expand_kv
from zerolab.runtime.comm import CommRecord


def shift(t, comm, tag: str):
    """Send ``t`` to the next rank of the ring, return what the previous rank sent (same shape)."""
    n, r = comm.world_size, comm.rank
    t, out = t.contiguous(), torch.empty_like(t)
    start = time.perf_counter()
    reqs = [dist.isend(t, comm.members[(r + 1) % n]), dist.irecv(out, comm.members[(r - 1) % n])]
    for q in reqs:
        q.wait()
    nbytes, k = t.numel() * t.element_size(), comm.ranks_per_node
    comm.ledger.records.append(CommRecord("send", nbytes, time.perf_counter() - start, t.numel(),
                                          str(t.dtype).replace("torch.", ""), 2, tag,
                                          inter_bytes=nbytes * (comm.members[(r + 1) % n] // k != comm.members[r] // k),
                                          group=comm.name))
    return out


def _scores(q, k, diagonal: bool):
    s = q @ k.transpose(-1, -2) * q.shape[-1] ** -0.5
    if diagonal:   # this rank's own chunk: token i sees tokens <= i
        n = s.shape[-1]
        s = s.masked_fill(torch.ones(n, n, dtype=torch.bool, device=s.device).triu(1), float("-inf"))
    return s


def _visible(src: int, r: int, causal: bool) -> bool:
    return not causal or src <= r


class RingAttention(torch.autograd.Function):
    """q ``[b, H, s/cp, d]``, k, v ``[b, Hkv, s/cp, d]`` -> ``[b, H, s/cp, d]`` (module docstring)."""

    @staticmethod
    def forward(ctx, q, k, v, comm, causal):
        n, r, heads = comm.world_size, comm.rank, q.shape[1]
        kv, out, lse = torch.stack([k, v]), None, None
        for j in range(n):
            if j:
                kv = shift(kv, comm, "ring-kv")
            src = (r - j) % n
            if not _visible(src, r, causal):
                continue
            s = _scores(q, expand_kv(kv[0], heads), causal and src == r)
            l_j = torch.logsumexp(s, -1, keepdim=True)
            o_j = torch.exp(s - l_j) @ expand_kv(kv[1], heads)
            if out is None:   # j = 0: the own chunk, always visible
                out, lse = o_j, l_j
            else:             # the online softmax: both partial sums rescaled to the new normaliser
                new = torch.logaddexp(lse, l_j)
                out = out * torch.exp(lse - new) + o_j * torch.exp(l_j - new)
                lse = new
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.comm, ctx.causal = comm, causal
        return out

    @staticmethod
    def backward(ctx, dout):
        q, k, v, out, lse = ctx.saved_tensors
        comm, causal = ctx.comm, ctx.causal
        n, r, heads, hkv = comm.world_size, comm.rank, q.shape[1], k.shape[1]
        dout = dout.contiguous()
        delta = (dout * out).sum(-1, keepdim=True)   # Σ_d dO·O: the softmax backward's row term
        dq = torch.zeros_like(q)
        kv = torch.stack([k, v])
        dkv = torch.zeros_like(kv)   # the accumulators of the chunk held: they travel with it
        for j in range(n):
            if j:   # K/V and their accumulators move on together: one message
                both = shift(torch.cat([kv, dkv]), comm, "ring-kv-dkv")
                kv, dkv = both[:2], both[2:].clone()
            src = (r - j) % n
            if not _visible(src, r, causal):
                continue
            kk, vv = expand_kv(kv[0], heads), expand_kv(kv[1], heads)
            p = torch.exp(_scores(q, kk, causal and src == r) - lse)   # the block's probabilities
            ds = p * (dout @ vv.transpose(-1, -2) - delta)
            scale = q.shape[-1] ** -0.5
            dq += ds @ kk * scale
            g = heads // hkv   # the query heads sharing one key/value head: their gradients summed
            dkv[0] += (ds.transpose(-1, -2) @ q * scale).unflatten(1, (hkv, g)).sum(2)
            dkv[1] += (p.transpose(-1, -2) @ dout).unflatten(1, (hkv, g)).sum(2)
        dkv = shift(dkv, comm, "ring-dkv") if n > 1 else dkv   # home: rank r holds chunk r+1's
        return dq, dkv[0], dkv[1], None, None


def ring_attention(q, k, v, comm, causal: bool = True):
    """Attention over the whole sequence from this rank's ``[b, s/cp, H, d]`` q, k, v (k, v may have
    fewer heads); returns this rank's ``[b, s/cp, H, d]`` output (module docstring)."""
    if q.shape[2] % k.shape[2]:
        raise ValueError(f"ring attention: {k.shape[2]} key/value heads do not divide {q.shape[2]} query heads")
    out = RingAttention.apply(*(t.transpose(1, 2).contiguous() for t in (q, k, v)), comm, causal)
    return out.transpose(1, 2)
