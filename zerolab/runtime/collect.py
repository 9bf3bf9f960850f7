"""Bringing the ranks' results back to the notebook cell (chapter 0): the parent's side of
``zl.launch`` once its ranks run.

Each rank sends one message over its pipe: its result or its traceback, the warnings it
raised and when it finished (``runtime/rank.py`` writes it). ``collect`` waits for all of
them and fails fast: the first rank that raises, dies or outlives the timeout ends the wait
within a poll interval with a ``LaunchError`` naming the rank. When several ranks fail, the
one that failed *first* is reported (its peers' errors are usually echoes, a closed
connection). The tail of a failed rank's log file comes with the error, and the ranks'
warnings are shown once each, in rank order, naming the ranks that raised them. Stopping
the ranks afterwards is ``launch``'s job (``runtime/launch.py``).
"""
from __future__ import annotations

import pickle
import time
import warnings
from multiprocessing import connection

from zerolab.runtime.handle import DIFFERENT_COLLECTIVES
from zerolab.runtime.rank import log_path

__all__ = ["collect", "LaunchError"]

_POLL = 0.1  # seconds between liveness checks of the children


class LaunchError(RuntimeError):
    """A rank failed, died or timed out. ``.rank`` names it (None for a timeout
    of several ranks); ``.remote_traceback`` is the rank's own traceback."""

    def __init__(self, message, rank=None, remote_traceback="", log=""):
        super().__init__(message)
        self.rank = rank
        self.remote_traceback = remote_traceback
        self.log = log


def collect(procs, conns, timeout, workdir):
    """Wait for every rank's message; fail fast on the first error or death."""
    n = len(procs)
    results, warned, errors = [None] * n, [None] * n, {}
    pending = set(range(n))
    deadline = time.monotonic() + timeout
    while pending:
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            ranks = sorted(pending)
            raise LaunchError(
                f"timed out after {timeout:g} s: rank(s) {ranks} of {n} did not finish "
                f"(a hang in a collective usually means the ranks disagree on what to call; "
                f"raise `timeout` if the work is simply slow)\n" + _logs_tail(workdir, ranks),
                rank=ranks[0] if len(ranks) == 1 else None)
        ready = connection.wait([conns[r] for r in pending], timeout=min(_POLL, remaining))
        for conn in ready:
            rank = conns.index(conn)
            try:
                status, value, caught, when = pickle.loads(conn.recv_bytes())
            except (EOFError, OSError):  # the pipe closed without a message: the rank died
                _raise_death(procs[rank], rank, n, workdir)
            pending.discard(rank)
            warned[rank] = caught
            if status == "error":
                errors[rank] = (when, value)
            else:
                results[rank] = value
        if errors:
            _raise_first_error(errors, conns, pending, warned, workdir, n)
    _replay_warnings(warned)
    return results


# gloo aborts the process (no Python exception) when two ranks' collectives differ in size
MISMATCH = ("Received data size doesn't match expected size", "collective mismatch")
MISMATCH_HINT = DIFFERENT_COLLECTIVES


def _raise_death(proc, rank, n, workdir):
    proc.join(2.0)
    code = proc.exitcode
    how = f"was killed by signal {-code}" if code and code < 0 else f"exited with code {code}"
    tail = _logs_tail(workdir, [rank])
    hint = MISMATCH_HINT if any(m in tail for m in MISMATCH) else ""
    raise LaunchError(f"rank {rank} of {n} {how} before returning a result "
                      f"(out of memory? os._exit? a crash in native code?)\n" + tail + hint, rank=rank)


def _raise_first_error(errors, conns, pending, warned, workdir, n):
    """Report the rank that failed *first*: its peers often fail a moment later
    with a secondary error (a closed connection) that would hide the cause."""
    settle = time.monotonic() + 0.2
    while pending and time.monotonic() < settle:
        for conn in connection.wait([conns[r] for r in pending], timeout=0.05):
            rank = conns.index(conn)
            try:
                status, value, caught, when = pickle.loads(conn.recv_bytes())
            except (EOFError, OSError):
                continue
            pending.discard(rank)
            warned[rank] = caught
            if status == "error":
                errors[rank] = (when, value)
    _replay_warnings(warned)
    rank = min(errors, key=lambda r: errors[r][0])
    others = sorted(set(errors) - {rank})
    also = f" (rank(s) {others} failed after it)" if others else ""
    raise LaunchError(f"rank {rank} of {n} failed{also}:\n{errors[rank][1]}", rank=rank,
                      remote_traceback=errors[rank][1], log=_read_log(workdir, rank))


def _replay_warnings(per_rank):
    """Show each distinct warning once, in rank order, naming the ranks that raised it."""
    seen = {}
    for rank, caught in enumerate(per_rank):
        for category, message, filename, lineno in caught or ():
            ranks = seen.setdefault((category, message), [filename, lineno, []])[2]
            if rank not in ranks:  # a warning raised in a loop is one warning
                ranks.append(rank)
    for (category, message), (filename, lineno, ranks) in seen.items():
        who = f"rank {ranks[0]}" if len(ranks) == 1 else f"ranks {', '.join(map(str, ranks))}"
        warnings.warn_explicit(f"[{who}] {message}", category, filename, lineno)



def _read_log(workdir, rank, limit=4000):
    try:
        with open(log_path(workdir, rank), errors="replace") as f:
            return f.read()[-limit:]
    except OSError:
        return ""


def _logs_tail(workdir, ranks):
    parts = []
    for r in ranks:
        text = _read_log(workdir, r, 2000).strip()
        if text:
            parts.append(f"--- rank {r} output (last lines) ---\n{text}")
    return "\n".join(parts)
