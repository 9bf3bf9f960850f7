"""Headless tests of the book's widgets (zerolab.book.widgets, zerolab.book.ring): moving a
control changes the data and the figure; the ring stepper's state is the ring algorithm's."""
import hashlib
import random

import pytest

from zerolab.theory import network
from zerolab.book.ring import RingAllReduceStepper, ring_allreduce_states, ring_sends


def digest(png: bytes) -> str:
    return hashlib.sha256(png).hexdigest()


# -- ring all-reduce ---------------------------------------------------------

def expected_holdings(n, k, r, c):
    """Closed form, derived independently of the stepper (chapter 2).

    Reduce-scatter: chunk c leaves rank c at step 0 and travels right, so after
    k <= n-1 steps rank c+j (1 <= j <= k) holds ranks c..c+j of it. After the
    reduce-scatter chunk c is complete on rank c-1; the all-gather then carries
    the finished chunk right, one rank per step.
    """
    if k <= n - 1:
        j = (r - c) % n
        return frozenset((c + i) % n for i in range(j + 1)) if 1 <= j <= k else frozenset([r])
    t = k - (n - 1)
    if (r - (c - 1)) % n <= t:
        return frozenset(range(n))
    return expected_holdings(n, n - 1, r, c)


@pytest.mark.parametrize("n", [2, 3, 4, 5, 8])
def test_ring_states_match_closed_form(n):
    states = ring_allreduce_states(n)
    assert len(states) == 2 * (n - 1) + 1
    for k, state in enumerate(states):
        for r in range(n):
            for c in range(n):
                assert state[r][c] == expected_holdings(n, k, r, c), (n, k, r, c)


@pytest.mark.parametrize("n", [2, 3, 4, 7])
def test_ring_moves_real_numbers_to_the_sum(n):
    """Run the sends on numbers: after RS rank r owns the sum of chunk r+1; after AG all do."""
    rng = random.Random(n)
    data = [[rng.randint(-100, 100) for _ in range(n)] for _ in range(n)]   # data[rank][chunk]
    total = [sum(data[r][c] for r in range(n)) for c in range(n)]
    buf = [row[:] for row in data]
    for step in range(2 * (n - 1)):
        sends = ring_sends(n, step)
        assert sorted(s for s, _, _ in sends) == list(range(n))            # every rank sends once
        assert all(d == (s + 1) % n for s, d, _ in sends)                  # to its right neighbour
        payload = [(d, c, buf[s][c]) for s, d, c in sends]                 # all sends happen at once
        for d, c, v in payload:
            buf[d][c] = buf[d][c] + v if step < n - 1 else v
        if step == n - 2:
            assert all(buf[r][(r + 1) % n] == total[(r + 1) % n] for r in range(n))
    assert buf == [total] * n


@pytest.mark.parametrize("n", [2, 5])
def test_stepper_widget_follows_the_algorithm(n):
    s = RingAllReduceStepper(n=n, nbytes=8_000_000)
    assert s.step.max == 2 * (n - 1)
    seen = {digest(s.png)}
    for k in range(1, 2 * (n - 1) + 1):
        s.next.click()
        assert s.step.value == k
        assert s.state == ring_allreduce_states(n)[k]
        assert s.bytes_sent() == k * 8_000_000 // n
        seen.add(digest(s.png))
    assert len(seen) == 2 * (n - 1) + 1                                    # every step drew a new picture
    assert s.bytes_sent() == network.ring_bytes("all_reduce", 8_000_000, n)
    s.next.click()                                                         # already done: stays
    assert s.step.value == 2 * (n - 1) and s.sends == []
    s.back.click()
    assert s.step.value == 2 * (n - 1) - 1


def test_stepper_shrinking_n_keeps_step_in_range():
    s = RingAllReduceStepper(n=5)
    s.step.value = 8
    s.n.value = 3
    assert s.step.value == 4 and s.step.max == 4
    assert all(len(cell) == 3 for row in s.state for cell in row)


def test_ring_sends_rejects_bad_step():
    with pytest.raises(ValueError, match="step"):
        ring_sends(4, 6)


# -- Memory Explorer ---------------------------------------------------------

@pytest.fixture
def explorer():
    from zerolab.book.widgets import MemoryExplorer
    return MemoryExplorer(psi=7.5e9, n_gpus=64, precision="mixed")


def test_explorer_draws_on_creation(explorer):
    assert explorer.renders == 1 and explorer.png.startswith(b"\x89PNG")
    assert explorer.figure.axes[0].get_title().startswith("Ψ = 7.5B, N = 64")


def test_explorer_psi_slider_changes_data_and_figure(explorer):
    psi0 = 7.5e9
    before, data0 = digest(explorer.png), explorer.data
    # the seeds' numbers, from 2 + 2 + 12 bytes per parameter (ZeRO paper, mixed precision Adam)
    assert [data0["params"][0], data0["grads"][0], data0["optimizer"][0]] == [2 * psi0, 2 * psi0, 12 * psi0]
    states = [p + g + o for p, g, o in zip(data0["params"], data0["grads"], data0["optimizer"])]
    assert [round(x / 1e9, 1) for x in states] == [120.0, 31.4, 16.6, 1.9]
    explorer.psi.value = 175e9
    assert explorer.renders == 2
    assert digest(explorer.png) != before
    assert explorer.data["params"][0] == 2 * 175e9
    assert explorer.figure.axes[0].get_title().startswith("Ψ = 175B")


def test_explorer_preset_buttons(explorer):
    explorer.presets[3].click()
    assert explorer.psi.value == pytest.approx(175e9)
    explorer.presets[1].click()
    assert explorer.data["params"][0] == 2 * 13e9


def test_explorer_n_precision_and_offload(explorer):
    explorer.n_gpus.value = 4
    assert explorer.data["optimizer"][3] == 12 * 7.5e9 / 4
    explorer.precision.value = "fp32"
    assert explorer.data["params"][0] == 4 * 7.5e9 and explorer.data["optimizer"][0] == 8 * 7.5e9
    explorer.offload_optimizer.value = "cpu"
    assert explorer.data["optimizer"][1:] == [0, 0, 0]
    assert explorer.data["host"][1] == (8 + 4) * 7.5e9 / 4      # moments + the fp32 gradient shard
    assert explorer.data["grads"][2:] == [0, 0]                  # stages 2-3: gradients left the device
    assert explorer.data["host"][0] == 0                 # DDP has no offload
    explorer.offload_param.value = "nvme"
    assert explorer.data["params"][3] == 0 and explorer.data["nvme"][3] == 4 * 7.5e9 / 4
    assert explorer.data["params"][2] == 4 * 7.5e9       # param offload is ZeRO-3 only


def test_explorer_activations_and_capacity(explorer):
    act0 = explorer.data["activations"][0]
    assert act0 > 0 and len(set(explorer.data["activations"])) == 1   # ZeRO does not shard activations
    explorer.seq_len.value = 4096
    assert explorer.data["activations"][0] > 1.9 * act0
    explorer.checkpointing.value = True
    assert explorer.data["activations"][0] < act0
    before = digest(explorer.png)
    explorer.gpu_gb.value = 24
    assert digest(explorer.png) != before                # the capacity line moved


def test_explorer_comm_volume(explorer):
    comm = explorer.data["comm"]
    n, psi = 64, 7.5e9
    assert comm[0] == comm[1] == comm[2] == pytest.approx(2 * 2 * psi * (n - 1) / n, rel=1e-9)
    assert comm[3] == pytest.approx(3 * 2 * psi * (n - 1) / n, rel=1e-9)


def test_explorer_nodes_and_grad_accum(explorer):
    psi, n, m = 7.5e9, 64, 2 * 7.5e9                  # M: 16-bit model bytes
    t8 = explorer.data["comm_seconds"][0]
    # DDP on 8 DGX A100 nodes: one ring all-reduce of M bytes at min(NVLink 300, 8 NICs x 25) = 200 GB/s:
    # 2(N-1) latencies of 5 us + 2(N-1)/N M / bandwidth
    assert t8 == pytest.approx(2 * (n - 1) * 5e-6 + 2 * (n - 1) / n * m / 200e9, rel=1e-6)
    explorer.node.value = "dgx-a100-1nic"                # one NIC per node: the ring runs at 25 GB/s
    assert explorer.data["comm_seconds"][0] == pytest.approx(2 * (n - 1) * 5e-6 + 2 * (n - 1) / n * m / 25e9, rel=1e-6)
    assert "1 x 200 Gb/s NIC" in explorer.figure.axes[1].get_title()
    explorer.node.value = "dgx-a100"
    base = explorer.data["comm"][:]
    explorer.grad_accum.value = 4
    c = explorer.data["comm"]
    assert c[0] == base[0] and c[1] == base[1]           # reduce once per optimizer step
    assert c[2] == pytest.approx(base[2] * (4 + 1) / 2)  # reduce-scatter every micro-batch + one all-gather
    assert c[3] == pytest.approx(base[3] * 4)            # gather, gather, reduce-scatter every micro-batch
    assert "(g = 4)" in explorer.figure.axes[1].get_title()


# -- plots ---------------------------------------------------------------------

def _labelled(ax):
    return ax.get_title() and ax.get_xlabel() and ax.get_ylabel()


def test_plots_are_titled_and_labelled_with_units():
    from zerolab import theory
    from zerolab.book import plots
    ests = [theory.estimate(1e6, 4, 3) for _ in range(4)]
    ax = plots.memory_bars(ests, measured=[e.as_dict() for e in ests])
    assert _labelled(ax) and "bytes" in ax.get_ylabel()
    # stage 3, Ψ = 1e6, N = 4: params 2Ψ/N = 0.5 MB, grads 0.5 MB, optimizer 12Ψ/N = 3 MB
    assert len(ax.patches) == 2 * 3 * 4                               # (predicted, measured) x 3 kinds x 4 ranks
    assert sorted({round(p.get_height(), 6) for p in ax.patches}) == [0.5, 3.0]
    ax = plots.comm_bars([{"all_gather": 3_000_000, "reduce_scatter": 1_000_000}] * 2, expected=4_000_000)
    assert _labelled(ax) and "(MB)" in ax.get_ylabel()
    assert [round(p.get_height(), 3) for p in ax.patches] == [3.0, 3.0, 1.0, 1.0]
    ax = plots.bandwidth_curves(["demo"], n=4)
    line = ax.get_lines()[0]
    assert _labelled(ax) and ax.get_ylabel() == "time (s)"
    from zerolab.theory.network import LINKS
    x, y = line.get_data()
    assert y[-1] == pytest.approx(LINKS["demo"].time("all_reduce", int(x[-1] * 1e6), 4), rel=1e-6)


def test_plot_timeline_draws_one_box_per_event():
    from zerolab.book import plots
    events = [[{"kind": "forward", "start": 1.0, "end": 1.010}, ("all_gather", 1.002, 1.004)],
              [("forward", 1.001, 1.011)]]
    ax = plots.plot_timeline(events)
    assert _labelled(ax) and "(ms)" in ax.get_xlabel()
    boxes = [(round(x, 6), round(w, 6)) for coll in ax.collections for path in coll.get_paths()
             for (x, w) in [(path.vertices[:, 0].min(), path.vertices[:, 0].max() - path.vertices[:, 0].min())]]
    assert sorted(boxes) == [(0.0, 10.0), (1.0, 10.0), (2.0, 2.0)]    # ms since the first event
    assert [t.get_text() for t in ax.get_legend().get_texts()] == ["all_gather", "forward"]
    ax = plots.plot_timeline(events, labels=["rank 0 compute", "rank 1 compute"])
    assert [t.get_text() for t in ax.get_yticklabels()] == ["rank 0 compute", "rank 1 compute"]
    assert plots.plot_timeline([[], []]).get_legend() is None        # empty rows draw, no legend


def test_folded_captures_prints_into_a_details_block(capsys, monkeypatch):
    import zerolab.book.widgets as w
    shown = []
    monkeypatch.setattr(w, "display", lambda obj, raw=False: shown.append(obj))
    with w.folded("numbers for Q1"):
        print("a < b")
    assert capsys.readouterr().out == ""                  # nothing printed under the question
    assert shown == [{"text/plain": "numbers for Q1:\na < b\n",
                      "text/html": "<details><summary>numbers for Q1</summary><pre>a &lt; b\n</pre></details>"}]
