"""zerolab.runtime.measure: census exact to the byte, peak meter within max(3%, 2 MB), timers."""
import sys
import os
import time

import pytest
import torch

from zerolab.runtime.measure import MemoryReport, PeakMeter, Timer, census, peak_memory, rss, time_fn, timed

MiB = 2**20
linux = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="VmHWM is Linux-only")


def grown(before, after, key=None):
    if key is None:
        return after.total - before.total
    return after.by_dtype.get(key, 0) - before.by_dtype.get(key, 0)


def test_census_counts_known_allocations_exactly():
    c0 = census()
    a = torch.zeros(1000)                        # 4000 B
    b = torch.zeros(3, 5, dtype=torch.bfloat16)  # 30 B
    i = torch.arange(7)                          # int64: 56 B
    c1 = census()
    assert grown(c0, c1) == 4000 + 30 + 56
    assert grown(c0, c1, "float32") == 4000
    assert grown(c0, c1, "bfloat16") == 30
    assert grown(c0, c1, "int64") == 56
    assert c1.count - c0.count == 3
    assert c1.by_device["cpu"] - c0.by_device.get("cpu", 0) == 4086
    del a, b, i


def test_views_share_their_storage():
    c0 = census()
    a = torch.zeros(1000)
    views = [a[10:20], a.view(10, 100), a.view(torch.int32), a.t() if a.dim() == 2 else a[::2], a.narrow(0, 5, 5)]
    assert grown(c0, census()) == 4000
    del a
    # a slice keeps the whole storage alive: the census charges its full size
    assert grown(c0, census()) == 4000
    del views
    assert grown(c0, census()) == 0


def test_freed_tensor_disappears():
    c0 = census()
    a = torch.ones(12345)
    assert grown(c0, census()) == 12345 * 4
    del a
    assert grown(c0, census()) == 0


def test_grads_optimizer_state_and_categories():
    model = torch.nn.Linear(10, 6)               # weight 60 + bias 6 floats = 264 B
    opt = torch.optim.Adam(model.parameters())
    params = {id(p) for p in model.parameters()}

    def classify(t):
        if id(t) in params:
            return "params"
        if any(t is p.grad for p in model.parameters()):
            return "grads"
        if any(t is s for st in opt.state.values() for s in st.values()):
            return "optimizer"
        return None

    c0 = census(classify=classify)
    assert c0.by_category.get("params") == 264 and "grads" not in c0.by_category
    model(torch.ones(2, 10)).sum().backward()    # grads exist only inside autograd until read
    opt.step()                                   # exp_avg + exp_avg_sq (+ 2 scalar steps, 4 B each)
    c1 = census(classify=classify)
    assert c1.by_category["params"] == 264
    assert c1.by_category["grads"] == 264
    assert c1.by_category["optimizer"] == 2 * 264 + 2 * 4
    assert census(include_grads=False, classify=classify).by_category.get("grads", 0) == 0


def test_extra_does_not_double_count():
    a = torch.zeros(500)
    c0 = census()
    assert census(extra=[a, {"x": a[:3]}, [a]]).total == c0.total
    model = torch.nn.Linear(4, 4)
    assert census(extra=[model]).total == c0.total + (16 + 4) * 4
    del a, model


def test_memory_report_arithmetic_and_table():
    r = MemoryReport(params=10, grads=20, optimizer=30, buffers=5, host=7, nvme=1)
    assert r.total == 60
    assert r.as_dict() == dict(params=10, grads=20, optimizer=30, buffers=5, host=7, nvme=1, gathered=0, total=60)
    s = MemoryReport(params=1, grads=40, optimizer=3, buffers=9, host=0, nvme=2)
    assert MemoryReport.max([r, s]) == MemoryReport(10, 40, 30, 9, 7, 2)
    assert MemoryReport.sum([r, s]).total == 104
    big = MemoryReport(params=3_000_000)
    assert "3.000 MB" in big.table() and "total" in str(big)
    assert "2.861 MiB" in big.table("MiB")


@linux
@pytest.mark.parametrize("mb", [64, 256])
def test_peak_of_written_allocation_within_tolerance(mb):
    n = mb * MiB
    with peak_memory() as m:
        x = torch.ones(n // 4)                   # written: every page resident
        del x
    assert m.method == "hwm"
    assert abs(m.peak - n) <= max(0.03 * n, 2 * MiB), (m.peak, n)
    assert abs(m.delta) < 2 * MiB                # freed big blocks go back to the OS


@linux
def test_steady_state_step_is_seen():
    """After warm-up a step re-uses freed heap memory; the meter must still see it."""
    from zerolab.book.models import TinyGPT, loss_fn, synthetic_batch
    model = TinyGPT.preset("micro")
    x, y = synthetic_batch(model, 128)

    def step():                                  # plain SGD: torch.optim's first use costs seconds
        loss_fn(model(x), y).backward()
        with torch.no_grad():
            for p in model.parameters():
                p -= 0.1 * p.grad
                p.grad = None

    for _ in range(3):
        step()
    with peak_memory("profiler") as exact:
        step()
    with peak_memory("hwm") as hwm:
        step()
    assert exact.peak > 8 * MiB                  # logits, activations, grads: the tensors' peak
    assert hwm.peak >= 0.9 * exact.peak, (hwm.peak, exact.peak)   # the process needs at least that


@linux
def test_untouched_empty_pages_are_not_resident():
    with peak_memory() as m:
        x = torch.empty(256 * MiB // 4)          # reserved, never written
    assert m.peak < 2 * MiB
    with peak_memory() as m:
        x.fill_(1.0)                             # now the pages exist
    assert abs(m.peak - 256 * MiB) <= 0.03 * 256 * MiB
    del x


@linux
def test_anon_peak_counts_written_memory_and_leaves_out_a_mapped_file(tmp_path):
    """"anon": a freed 64 MiB tensor is seen at its peak; reading a memory-mapped 64 MiB file
    (a safetensors checkpoint) is page cache, not the process's own memory; "hwm" counts it."""
    with peak_memory("anon") as m:
        x = torch.ones(64 * MiB // 4)
        time.sleep(0.01)                         # a few samples while it is held
        del x
    assert abs(m.peak - 64 * MiB) <= 2 * MiB and abs(m.delta) < 2 * MiB, (m.peak, m.delta)
    path = tmp_path / "f.bin"
    path.write_bytes(os.urandom(64 * MiB))
    for method, counts in (("anon", False), ("hwm", True)):
        with peak_memory(method) as m:
            mapped = torch.from_file(str(path), shared=True, size=64 * MiB, dtype=torch.uint8)
            total = int(mapped.max())            # every page read
            del mapped
        assert (m.peak > 32 * MiB) == counts, (method, m.peak, total)


def test_profiler_peak_is_exact_for_tensors():
    with PeakMeter("profiler") as m:
        a = torch.ones(16 * MiB // 4)
        b = torch.empty(64 * MiB // 4)           # profiler counts allocations, touched or not
        del b
        c = torch.ones(8 * MiB // 4)
    assert m.peak == 80 * MiB
    assert m.delta == 24 * MiB
    del a, c


def test_rss_sees_written_memory():
    r0 = rss()
    x = torch.ones(64 * MiB // 4)
    assert rss() - r0 >= 60 * MiB
    del x


def test_bad_method_is_rejected():
    with pytest.raises(ValueError, match="method"):
        PeakMeter("vmhwm")


def test_timers():
    t = Timer()
    for _ in range(3):
        with t:
            time.sleep(0.01)
    assert len(t.times) == 3 and 0.01 <= t.median < 0.1 and t.min <= t.median
    assert "median" in repr(t)
    with timed() as one:
        time.sleep(0.005)
    assert 0.005 <= one.seconds < 0.1
    calls = []
    t2 = time_fn(calls.append, 1, repeat=4, warmup=2)
    assert len(calls) == 6 and len(t2.times) == 4


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_peak():
    with peak_memory(device="cuda") as m:
        x = torch.ones(64 * MiB // 4, device="cuda")
        del x
    assert m.method == "cuda" and m.peak == 64 * MiB and m.delta == 0


def _first_peak_in_rank(mb):
    with peak_memory("hwm") as m:               # the first measurement in this process
        x = torch.ones(mb * MiB // 4)
        del x
    return m.peak


@linux
def test_first_measurement_in_a_fresh_rank():
    """Library code paged in on first use (1-3 MiB of file pages) is not counted."""
    import zerolab as zl
    for peak in zl.launch(_first_peak_in_rank, world_size=2, args=(64,)):
        assert abs(peak - 64 * MiB) <= 2 * MiB, peak / MiB


HOLE = """
import torch
from zerolab.runtime.peak import peak_memory, rss, trim_heap
MiB = 2 ** 20
hole = torch.ones(200 * MiB // 4)   # room for the block three times over: small objects made between
                                    # the three uses may split what a freed block leaves
start, end = hole.data_ptr(), hole.data_ptr() + hole.nbytes
pins = []
for _ in range(256):   # something allocated above the big block: freeing it leaves a hole, not a trimmable top
    pins.append(torch.ones(1000))
    if pins[-1].data_ptr() >= end:
        break
else:
    raise SystemExit("no allocation landed above the 200 MiB block: the heap layout this test needs did not arise")
del hole
trim_heap()   # the hole's pages go back to the OS, as a meter's start does
before = rss()
x = torch.ones(64 * MiB // 4)
assert start <= x.data_ptr() < end, "the block was not served from the hole"
del x
print("raw", 64, (rss() - before) // MiB)   # free() kept the pages: the case the meters must see through
for method in ("hwm", "anon"):
    with peak_memory(method) as m:
        x = torch.ones(64 * MiB // 4)   # served from the hole: its pages become resident again
        assert start <= x.data_ptr() < end, "the block was not served from the hole"
        del x                           # free() keeps them
    print(method, m.peak // MiB, m.delta // MiB)
"""


@linux
def test_memory_glibc_keeps_for_reuse_is_not_the_blocks():
    """A long-lived process (the full test run) has free holes inside glibc's heap; a big tensor is
    served from one, and free() leaves its pages resident. Forced here in a fresh process by raising
    glibc's mmap threshold (every block from the heap), so the case is the same every run."""
    import subprocess
    import sys
    env = {**os.environ, "MALLOC_MMAP_THRESHOLD_": str(1 << 30)}
    r = subprocess.run([sys.executable, "-c", HOLE], capture_output=True, text=True, timeout=120, env=env)
    assert r.returncode == 0, r.stderr[-2000:]
    lines = [line.split() for line in r.stdout.strip().split("\n")]
    assert [m for m, _, _ in lines] == ["raw", "hwm", "anon"], r.stdout
    assert int(lines[0][2]) >= 60, r.stdout   # the situation under test arose: glibc kept the freed pages
    for method, peak, delta in lines[1:]:
        assert abs(int(peak) - 64) <= 2 and abs(int(delta)) <= 1, r.stdout   # seen at its peak, gone after
