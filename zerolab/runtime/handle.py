"""An issued collective (``Handle``), and what a failed one usually means (chapters 0, 2).

``Communicator`` (``comm.py``) returns a ``Handle`` for every collective; waiting on
it records the call in the ledger. A collective that fails or times out raises with
the call named and the usual cause spelled out (``DIFFERENT_COLLECTIVES``), which
``zl.launch`` also appends when gloo aborts a rank on a size mismatch.
"""
from __future__ import annotations

import time

DIFFERENT_COLLECTIVES = (
    "\n--- what it usually means ---\nThe ranks issued different collectives: every rank must call the same "
    "collectives in the same order, whatever its data. Under ZeRO-3 the usual cause is a module whose forward "
    "runs on some ranks only (an expert that got no tokens, a layer behind a data-dependent `if`): make its "
    "parent one unit that runs on every rank, zl.set_leaf_modules(model, [ParentClass]) before zl.initialize "
    "(chapter 6). Otherwise a rank is slower than collective_timeout, or a peer died first (see its error).")


def failed(r, err: BaseException) -> RuntimeError:
    """The error for collective record ``r`` that did not complete (``err``: the backend's)."""
    return RuntimeError(f"{r.op} '{r.tag}' ({r.numel} elements, {r.world_size} ranks) did not complete: "
                        f"{err}{DIFFERENT_COLLECTIVES}")


class Handle:
    """An issued collective. ``wait()`` blocks until it is done (and, on a
    simulated link, until the link would have delivered it); idempotent."""

    def __init__(self, work, record: CommRecord, ledger: CommLedger, t_issue: float,
                 t_link_done: float, after=None, book=None, trace=(None, None)):
        self._work, self._record, self._ledger = work, record, ledger
        self._book = ledger.records if book is None else book   # where the record goes once done
        self._t_issue, self._t_link_done, self._after = t_issue, t_link_done, after
        self._t_complete = []   # filled by the backend's completion callback, where it has one
        self._trace, self._polled = trace, False   # (recorder, sequence no.): a traced run's wait is recorded
        self.done = False
        if work is not None:
            try:
                work.get_future().add_done_callback(lambda _: self._t_complete.append(time.perf_counter()))
            except RuntimeError:  # gloo's list-form reduce-scatter has no future: completion = when waited on
                pass

    def is_completed(self) -> bool:
        """Has the collective finished (and would a simulated link have delivered
        it)? Never blocks. gloo's reduce-scatter only reports done once waited on."""
        if self.done:
            return True
        if self._work is not None and not self._work.is_completed():
            return False
        self._polled = time.perf_counter() >= self._t_link_done
        return self._polled

    def wait(self):
        if self.done:
            return
        rec, seq = self._trace
        if rec is not None:   # the engine waits here (or only collects what a poll found finished)
            rec.waited(seq, soft=self._polled)
        if self._work is not None:
            try:
                self._work.wait()
            except RuntimeError as e:   # a timeout, a closed peer: say which collective, and the usual cause
                raise failed(self._record, e) from e
        t_backend = self._t_complete[0] if self._t_complete else time.perf_counter()
        delay = self._t_link_done - time.perf_counter()
        if delay > 0:
            time.sleep(delay)
        if self._after is not None:
            self._after()
        self._record.seconds = max(t_backend, self._t_link_done) - self._t_issue
        self._book.append(self._record)
        self.done = True
