"""Mutants the replay-against-analytic check (tests/test_replay_vs_analytic.py) kills: the analytic time model
and the replay must agree on the bytes and the link."""
from mutants import Mutant

T = "tests/test_replay_vs_analytic.py"
MUTANTS = [
    Mutant("analytic-no-ring-factor", "zerolab/theory/comm.py",
           "        one = lk.time(op.op, op.nbytes, op.group)                     # whole tensor at once",
           "        one = lk.time(op.op, 0, op.group) + op.nbytes / lk.bandwidth",
           (T,),
           "step_comm_time sends the whole tensor per rank, forgetting the ring's (N-1)/N"),
    Mutant("replay-always-intra-link", "zerolab/theory/replay.py",
           "        link = node.group_link(size=size, per_node=per_node)",
           "        link = node.intra",
           (T,),
           "the replay runs a DP ring that crosses nodes at the NVLink speed instead of the NICs' share"),
]
