"""The 3D time model (``time3d.step_time_3d``) against the pipeline replay on the same configuration (chapter 10).

``step_time_3d`` charges one stage's step as (m + p - 1) x (compute + TP + PP sends per micro-batch):
every send in series with the compute, on every micro-batch and in the bubble too. The replay
(``replay_pipe``) runs the schedule's real orders with the same costs — F 2 FLOPs per parameter and
token of the stage (Ψ/p), B the rest of ``flops_per_token``, each send one micro-batch's activation
(tokens x hidden x 2 bytes) on the link ``time3d.mesh_links`` gives PP — and overlaps a send with
the sender's next compute; only a receive that finds its message still in flight waits.

* p2p free (a link of infinite bandwidth, no latency): both are compute x (m + p - 1) / m for 1F1B
  with balanced stages — equal;
* p2p not free: the model's pipeline is longer by 2(m + p - 1) message times d (2m sends of the
  busiest stage, each in series, and the bubble stretched by them); the replay's by k·d, where k
  counts the messages on the schedule's critical path: 2(p - 1) for GPipe (the fill forward, the drain
  backward), more for 1F1B, which keeps no slack in its steady state (a stage's next backward waits
  for the gradient its neighbour sends after a forward and a backward) — read off the replay.

``compare(orders, hardware, psi=, seq=, hidden=, layers=, micro_batch=)``: both, by term (seconds).
TP (tp = 1 here), DP (dp = 1) and the optimizer are the same arithmetic in both and left out.
"""
from __future__ import annotations

from zerolab.theory.hardware import get_hardware
from zerolab.theory.replay_cluster import Cluster
from zerolab.theory.replay_pipe import orders_trace, replay_pipeline
from zerolab.theory.time3d import mesh_links, step_time_3d


def compare(orders, hardware="dgx-h100", psi=6.74e9, seq=4096, hidden=4096, layers=32, micro_batch=1,
            flops_per_token=6) -> dict:
    """``orders``: per stage, 1F1B's (or another schedule's) order from ``parallel.schedule`` (module docstring).
    Returns {"time3d": its pipeline seconds (compute + pp + bubble), "replay": the replay's step, "compute":
    the stage's compute per step, "ideal": compute x (m + p - 1) / m, "message": d, "time3d_messages":
    (time3d - ideal) / d, "replay_messages": (replay - ideal) / d, "terms": step_time_3d's terms}."""
    hw = get_hardware(hardware)
    p = len(orders)
    m = sum(1 for a in orders[0] if a[0] == "F")
    tokens = micro_batch * seq
    terms = step_time_3d(psi=psi, tp=1, pp=p, dp=1, micro_batches=m, micro_batch=micro_batch, seq=seq, hidden=hidden,
                         layers=layers, stage=1, offload_optimizer="none", hardware=hw,
                         recompute=flops_per_token == 8)
    per_token = psi / p * tokens
    nbytes = tokens * hidden * 2
    trace = orders_trace(orders, 2 * per_token, (flops_per_token - 2) * per_token, nbytes=nbytes)
    rep = replay_pipeline(trace, Cluster(hw))
    link = mesh_links(hw.node, p, 1, p)["pp"]
    d = link.latency + nbytes / link.bandwidth
    ideal = terms["compute"] * (m + p - 1) / m
    t3 = terms["compute"] + terms["tp"] + terms["pp"] + terms["bubble"]
    return {"time3d": t3, "replay": rep.step_seconds, "compute": terms["compute"], "ideal": ideal, "message": d,
            "time3d_messages": (t3 - ideal) / d if d else 0.0,
            "replay_messages": (rep.step_seconds - ideal) / d if d else 0.0, "terms": terms, "replayed": rep}
