"""A real pipeline step traced and replayed (parallel/pipeline_trace.py, theory/replay_pipe.py).

TinyGPT (4 layers) on 2 ranks, one traced step of 4 micro-batches under 1F1B, interleaved 1F1B (v = 2)
and ZB-H1 (one launch): every send and receive is in the trace and pairs up, every F/B/W is named with
its FLOPs, and the replay at the recorded size on one DGX H100 equals the replay of the schedule's own
orders with the recorded costs (``orders_trace``) — the trace is the schedule, message by message.
"""
from __future__ import annotations

import pytest

from zerolab.book import runs_schedules as R
from zerolab.parallel import schedule
from zerolab.theory.replay import replay
from zerolab.theory.replay_pipe import orders_trace

CASES = [("1f1b", 1), ("interleaved", 2), ("zb-h1", 1)]


@pytest.fixture(scope="module")
def runs():
    return R.train_runs(CASES, steps=1, m=4)


def _ops(trace):
    return [(e.info["phase"], e.info["micro"], e.info["chunk"]) for e in trace if e[0] == "compute"]


@pytest.mark.parametrize("kind,v", CASES)
def test_the_trace_is_the_schedule_and_its_replay_is_the_schedules(runs, kind, v):
    traces = runs[kind]["traces"]
    short = {"forward": "F", "backward": "B", "weight-grad": "W"}
    for s, tr in enumerate(traces):
        assert tr[0][0] == "trace-meta" and tr[0].info["pipeline"] and tr[0].info["stage"] == s
        order = schedule(kind, 4, 2, s, v) if v > 1 else schedule(kind, 4, 2, s)
        assert [(short[ph], i) + ((c,) if v > 1 else ()) for ph, i, c in _ops(tr)] == order
        assert all(e.info["flops"] > 0 for e in tr if e[0] == "compute")
        msgs = [e.info for e in tr if e[0] == "p2p"]
        assert {m["group"] for m in msgs} == {"pp"} and {m["peer"] for m in msgs} == {1 - s}
        assert all(m["waited"] is not None and m["waited"] >= m["issued"] for m in msgs)
        sends = [m for m in msgs if m["op"] == "send"]
        assert len(sends) == 4 * (2 * v - 1) and len(msgs) == 2 * len(sends)
        assert {m["nbytes"] for m in sends} == {R.ROWS * 16 * 32 * 4}     # rows x seq x d_model, fp32 (TinyGPT micro)
        assert tr[-1][0] == "p2p-drain"
    rep = replay(traces, "dgx-h100")
    # the same step built from the schedule's orders with the recorded costs: identical, bit for bit
    cost = {}
    for tr in traces:
        for e in tr:
            if e[0] == "compute":
                cost.setdefault((e.info["phase"], e.info["stage"]), set()).add(e.info["flops"])
    assert all(len(c) == 1 for c in cost.values())       # every micro-batch costs its stage the same FLOPs
    per = {ph: [cost.get((ph, j), {0}).pop() for j in range(2 * v)] for ph in ("forward", "backward", "weight-grad")}
    built = orders_trace([schedule(kind, 4, 2, s, v) if v > 1 else schedule(kind, 4, 2, s) for s in range(2)],
                         per["forward"], per["backward"], per["weight-grad"], nbytes=R.ROWS * 16 * 32 * 4, v=v)
    again = replay(built, "dgx-h100")
    assert again.ops == rep.ops and again.step_seconds == rep.step_seconds
    assert 0 < rep.bubble < 1 and rep.step_seconds > 0
