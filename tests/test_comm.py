"""zerolab.runtime.comm: values agree with torch.distributed, bytes with the ring algorithm."""
import time

import pytest
import torch
import torch.distributed as dist

import zerolab as zl
from zerolab.runtime.comm import Communicator
from zerolab.theory.network import LINKS, Link, get_link, ring_bytes


def _collectives(n_elems_per_rank):
    c = Communicator()
    r, n = c.rank, c.world_size
    out = {}
    # all_reduce (sum, avg, max) of a rank-dependent tensor
    t = torch.arange(6, dtype=torch.float32) + r
    c.all_reduce(t)
    out["all_reduce"] = t.tolist()
    t = torch.full((4,), float(r))
    c.all_reduce(t, op="avg")
    out["avg"] = t.tolist()
    t = torch.tensor([float(r)])
    c.all_reduce(t, op="max")
    out["max"] = t.item()
    # reduce_scatter of N*S elements
    s = n_elems_per_rank
    full = torch.arange(n * s, dtype=torch.float32) * (r + 1)
    shard = torch.empty(s)
    c.reduce_scatter(shard, full)
    out["reduce_scatter"] = shard.tolist()
    # all_gather, async
    gathered = torch.empty(n * s)
    h = c.all_gather(gathered, torch.full((s,), float(r)), async_op=True)
    h.wait()
    out["all_gather"] = gathered.tolist()
    # broadcast from the last rank, bf16
    b = torch.full((5,), float(r), dtype=torch.bfloat16)
    c.broadcast(b, src=n - 1)
    out["broadcast"] = b.float().tolist()
    # all_to_all
    a_in = torch.arange(n * 2, dtype=torch.float32) + 100 * r
    a_out = torch.empty_like(a_in)
    c.all_to_all(a_out, a_in)
    out["all_to_all"] = a_out.tolist()
    out["ledger"] = [(rec.op, rec.bytes, rec.numel, rec.dtype) for rec in c.ledger.records]
    out["total"] = c.ledger.total_bytes()
    return out


@pytest.mark.parametrize("n", [2, 3, 4])
def test_values_and_bytes(n):
    s = 5
    res = zl.launch(_collectives, n, args=(s,))
    for r, o in enumerate(res):
        assert o["all_reduce"] == [sum(i + k for k in range(n)) for i in range(6)]
        assert o["avg"] == pytest.approx([(n - 1) / 2] * 4)
        assert o["max"] == n - 1
        tri = n * (n + 1) // 2
        assert o["reduce_scatter"] == [float((r * s + i) * tri) for i in range(s)]
        assert o["all_gather"] == [float(k) for k in range(n) for _ in range(s)]
        assert o["broadcast"] == [float(n - 1)] * 5
        assert o["all_to_all"] == [float(100 * src + 2 * r + i) for src in range(n) for i in range(2)]
        # hand-computed ring bytes (float32 = 4 bytes, bf16 = 2)
        expect = {
            "all_reduce": [2 * 24 * (n - 1) // n, 2 * 16 * (n - 1) // n, 2 * 4 * (n - 1) // n],
            "reduce_scatter": [4 * n * s * (n - 1) // n],
            "all_gather": [4 * n * s * (n - 1) // n],
            "broadcast": [0 if r == n - 2 else 10],   # chain from rank n-1: rank n-2 is last
            "all_to_all": [4 * 2 * n * (n - 1) // n],
        }
        got = {}
        for op, nbytes, _, _ in o["ledger"]:
            got.setdefault(op, []).append(nbytes)
        assert got == expect
        assert o["total"] == sum(sum(v) for v in expect.values())


def test_ring_bytes_formulas():
    assert ring_bytes("all_reduce", 1000, 4) == 1500
    assert ring_bytes("reduce_scatter", 1000, 4) == 750
    assert ring_bytes("all_gather", 1000, 1) == 0
    assert ring_bytes("all_reduce", 1000, 4) == ring_bytes("reduce_scatter", 1000, 4) + ring_bytes("all_gather", 1000, 4)
    with pytest.raises(ValueError, match="unknown collective"):
        ring_bytes("gather", 10, 2)


def test_link_time_model():
    link = Link("x", bandwidth=1e9, latency=1e-5)
    # all-reduce of 1 GB on 4 ranks: 6 latency steps + 1.5 GB / 1 GB/s
    assert link.time("all_reduce", 10**9, 4) == pytest.approx(6e-5 + 1.5)
    assert LINKS["nvlink3"].bandwidth == 300e9  # the "600 GB/s" figure is both directions
    with pytest.raises(ValueError, match="bandwidth"):
        Link("bad", bandwidth=0)
    with pytest.raises(ValueError, match="unknown link"):
        get_link("warp-drive")


def _simulated(link_bw):
    link = Link("slow", bandwidth=link_bw, latency=0.0)
    c = Communicator(link=link)
    x = torch.ones(250_000)                     # 1 MB
    t0 = time.perf_counter()
    c.all_reduce(x)                             # 2 * 1 MB * 1/2 = 1 MB at 10 MB/s = 0.1 s
    sync = time.perf_counter() - t0
    # two async collectives share one channel: 0.2 s in all, and work done meanwhile hides
    t0 = time.perf_counter()
    h1 = c.all_reduce(torch.ones(250_000), async_op=True)
    h2 = c.all_reduce(torch.ones(250_000), async_op=True)
    time.sleep(0.15)                            # "compute" overlapping the transfers
    h1.wait(), h2.wait()
    both = time.perf_counter() - t0
    return sync, both, [r.simulated for r in c.ledger.records], c.ledger.link.name


def test_simulated_link_delays_and_overlaps():
    res = zl.launch(_simulated, 2, args=(10e6,))
    for sync, both, flags, name in res:
        assert 0.1 <= sync < 0.3
        assert 0.2 <= both < 0.35            # not 0.15 + 0.2: the sleep overlapped the link
        assert flags == [True, True, True] and name == "slow"


def _bad_sizes():
    c = Communicator()
    with pytest.raises(ValueError, match="pad the input"):
        c.reduce_scatter(torch.empty(3), torch.empty(7))
    with pytest.raises(ValueError, match="pad shards"):
        c.all_gather(torch.empty(7), torch.empty(3))
    with pytest.raises(ValueError, match="op must be one of"):
        c.all_reduce(torch.empty(2), op="mean")
    return True


def test_bad_sizes_raise_clear_errors_not_hangs():
    assert zl.launch(_bad_sizes, 2, timeout=30) == [True, True]


def _single():
    c = Communicator()
    x = torch.arange(4.0)
    out = torch.empty(4)
    c.reduce_scatter(out, x)
    g = torch.empty(4)
    c.all_gather(g, out)
    return out.tolist(), g.tolist(), c.ledger.total_bytes(), dist.get_world_size()


def test_world_size_one_is_a_copy_with_zero_bytes():
    assert zl.launch(_single, 1) == [([0.0, 1.0, 2.0, 3.0], [0.0, 1.0, 2.0, 3.0], 0, 1)]


def test_communicator_without_torch_distributed_is_one_local_rank():
    assert not dist.is_initialized()
    c = Communicator()
    x, out = torch.arange(6.0), torch.empty(6)
    c.reduce_scatter(out, x)
    c.all_reduce(x, op="avg")
    assert (c.rank, c.world_size) == (0, 1)
    assert out.tolist() == x.tolist() == [0.0, 1.0, 2.0, 3.0, 4.0, 5.0]
    assert c.ledger.total_bytes() == 0 and c.ledger.count() == 2


def _uneven_chunks_dtype(dtype):
    c = Communicator()
    n = c.world_size
    inp = (torch.arange(n * 3) + c.rank).to(dtype)
    out = torch.empty(3, dtype=dtype)
    c.reduce_scatter(out, inp, async_op=True).wait()
    return out.float().tolist()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_reduce_scatter_list_form_values(dtype):
    n = 3
    res = zl.launch(_uneven_chunks_dtype, n, args=(dtype,))
    for r, got in enumerate(res):
        assert got == [float(sum(r * 3 + i + k for k in range(n))) for i in range(3)]
