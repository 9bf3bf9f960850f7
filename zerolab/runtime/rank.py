"""One rank's side of ``zl.launch`` (chapter 0): what runs inside each child process.

The child ties its life to the launcher's (no orphans), sends its output to
a per-rank log instead of the notebook, initialises ``torch.distributed``
from a FileStore, runs the user's function, and reports the result, the
warnings it raised and any traceback back over a pipe as one message.
"""
from __future__ import annotations

import ctypes
import os
import signal
import sys
import threading
import time
import traceback
import warnings
from datetime import timedelta

import cloudpickle
import torch
import torch.distributed as dist


def log_path(workdir, rank):
    return os.path.join(workdir, f"rank{rank}.log")


def _die_with_parent(parent_pid):
    """No orphans: a rank exits as soon as the process that launched it is gone.

    Where that process is our direct parent (fork, spawn), the kernel sends
    SIGKILL on its death (PR_SET_PDEATHSIG). A forkserver child's parent is
    the server, so a watchdog thread also polls the launcher's pid."""
    if os.getppid() == parent_pid:
        try:
            libc = ctypes.CDLL("libc.so.6", use_errno=True)
            libc.prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG = 1
        except OSError:  # pragma: no cover - not Linux
            pass

    def watch():
        while _alive(parent_pid):
            time.sleep(0.5)
        os._exit(1)

    if not _alive(parent_pid):
        os._exit(1)
    threading.Thread(target=watch, name="zerolab-watchdog", daemon=True).start()


def _alive(pid):
    """True while ``pid`` runs; a zombie (dead, not yet reaped) counts as gone."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        try:
            os.kill(pid, 0)
            return True
        except ProcessLookupError:
            return False


def child_main(payload, rank, world_size, backend, workdir, timeout, threads, conn, parent_pid, ranks_per_node=None):
    _die_with_parent(parent_pid)
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C / kernel interrupt: the parent decides
    signal.signal(signal.SIGTERM, signal.SIG_DFL)  # die at once, even inside a C++ collective
    # children never print into the notebook: stdout/stderr go to a per-rank file
    log = os.open(log_path(workdir, rank), os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
    sys.stdout.flush(), sys.stderr.flush()
    os.dup2(log, 1), os.dup2(log, 2)
    sys.stdout = open(1, "w", buffering=1, closefd=False)
    sys.stderr = open(2, "w", buffering=1, closefd=False)
    k = ranks_per_node or world_size  # simulated node size: ranks m*k .. m*k+k-1 are node m
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world_size), LOCAL_RANK=str(rank % k),
                      LOCAL_WORLD_SIZE=str(k), GROUP_RANK=str(rank // k), OMP_NUM_THREADS=str(threads))
    torch.set_num_threads(threads)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")  # the parent de-duplicates; the fork may have a stale registry
        try:
            fn, args, kwargs = payload if isinstance(payload, tuple) else cloudpickle.loads(payload)
            if backend == "nccl":
                torch.cuda.set_device(rank % torch.cuda.device_count())
            store = dist.FileStore(os.path.join(workdir, "store"), world_size)
            dist.init_process_group(backend, store=store, rank=rank, world_size=world_size,
                                    timeout=timedelta(seconds=timeout))
            # gloo may still be connecting to a peer when init returns: without this
            # barrier a rank whose fn needs no collective can exit (closing its sockets)
            # while a slower peer is still completing its mesh
            dist.barrier()
            message = ("ok", fn(*args, **kwargs))
        except BaseException:  # noqa: BLE001 - report everything, including SystemExit
            message = ("error", traceback.format_exc())
        records = [(w.category, str(w.message), w.filename, w.lineno) for w in caught[:1000]]
    try:
        data = cloudpickle.dumps((*message, records, time.time()))
    except Exception:  # an unpicklable result is a user error worth a clear message
        data = cloudpickle.dumps(("error", "the result of fn could not be pickled:\n" + traceback.format_exc(),
                                  records, time.time()))
    # report first: after an error the peers may be stuck in a collective, and
    # tearing the process group down could block; the parent kills them anyway
    conn.send_bytes(data)
    conn.close()
    if message[0] == "ok" and dist.is_initialized():
        dist.destroy_process_group()
    sys.stdout.flush(), sys.stderr.flush()
    os._exit(0)  # skip atexit/finalizers inherited from the parent (forked Jupyter kernel)
