"""Start N ranks from a notebook cell and bring their results back (chapter 0).

``launch(fn, world_size)`` runs ``fn(*args)`` once per rank, each in its own
process with ``torch.distributed`` initialised, and returns the results in
rank order. Design choices, each measured on a 2-core machine:

* Start method: ``fork`` when it is safe (about 0.05 s for 4 ranks, and a
  function defined in a notebook cell just works). Fork is unsafe once CUDA
  is initialised in the parent, and GNU OpenMP hangs a forked child that
  uses more than one thread after the parent has used its thread pool. So a
  rank that gets more than one thread, or a parent with CUDA, starts from a
  ``forkserver`` instead: a clean process with torch preloaded, started once
  per session (a few seconds), from which ranks then fork quickly; the
  function travels serialised *by value* (cloudpickle). ``spawn`` (each rank
  imports torch: 2-6 s) is there on request.
* Rendezvous: a ``FileStore`` in a fresh temporary directory, so re-running a
  cell, or two launches at once, can never collide on a port.
* Output: children never print into the notebook. Their stdout/stderr go to a
  per-rank log file; results, warnings and tracebacks come back as values over
  a pipe and the parent shows them, so stored outputs are deterministic.
* Failure: the first rank that raises ends the launch within a poll interval;
  the parent kills the other ranks (blocked in a collective, they would never
  return) and raises ``LaunchError`` naming the rank, with its traceback
  (waiting for the results and reporting a failure: ``runtime/collect.py``).
  Children also die with the parent (``PR_SET_PDEATHSIG``), so an interrupted
  or crashed kernel leaves no orphans. Ranks are *not* daemonic processes, so a
  rank may start processes of its own (``DataLoader(num_workers=2)``); what
  daemonic would add -- being terminated when the parent exits -- ``launch``
  already does in its ``finally`` (every rank is stopped before it returns or
  raises), and a loader worker left by a killed rank exits by PyTorch's own
  check that its rank is gone (within about 5 s).
* Threads: each rank uses ``max(1, cores // world_size)`` intra-op threads.
* Nodes (chapter 9): ``ranks_per_node=K`` makes ranks ``m*K .. m*K+K-1``
  simulated node ``m`` (``LOCAL_RANK``, ``LOCAL_WORLD_SIZE``, ``GROUP_RANK``
  as torchrun sets them), so the communicator builds intra- and inter-node
  groups and books which bytes cross nodes.

Under ``torchrun`` (multi-node) the same call runs ``fn`` in the current
process with ``env://`` rendezvous and all-gathers the results, so one script
works both ways.
"""
from __future__ import annotations

import os
import shutil
import sys
import tempfile
import time
import warnings
from datetime import timedelta
from multiprocessing import get_context

import cloudpickle
import torch
import torch.distributed as dist

from zerolab.runtime.collect import collect
from zerolab.runtime.rank import child_main

__all__ = ["launch", "cpu_count", "choose_backend"]


def cpu_count() -> int:
    """Cores this process may use (respects affinity masks and cgroup-pinned CPUs)."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # pragma: no cover - macOS
        return os.cpu_count() or 1


def choose_backend(world_size: int, backend: str = "auto") -> str:
    """nccl when there is one CUDA device per rank, else gloo (CPU)."""
    if backend not in ("auto", "gloo", "nccl"):
        raise ValueError(f"backend must be 'auto', 'gloo' or 'nccl', got {backend!r}")
    if backend != "auto":
        return backend
    if torch.cuda.is_available() and torch.cuda.device_count() >= world_size:
        return "nccl"
    return "gloo"


def _under_torchrun() -> bool:
    return "TORCHELASTIC_RUN_ID" in os.environ or (
        "RANK" in os.environ and "WORLD_SIZE" in os.environ and "MASTER_ADDR" in os.environ
    )


def launch(fn, world_size: int = 2, args=(), kwargs=None, backend: str = "auto",
           timeout: float = 120, start_method: str = "auto", threads: int | None = None,
           collective_timeout: float | None = None, ranks_per_node: int | None = None):
    """Run ``fn(*args, **kwargs)`` on ``world_size`` ranks; return results in rank order.

    timeout: seconds for the whole run.
    collective_timeout: torch.distributed's timeout for one collective (``init_process_group``'s
    ``timeout``); default: ``timeout``. A rank waiting longer for its peers raises.
    start_method: "auto" (fork when safe, else forkserver), "fork", "forkserver" or "spawn".
    threads: intra-op threads per rank (default max(1, cores // world_size)).
    ranks_per_node: simulated node size K, dividing world_size (default: all ranks on one node).
    Raises LaunchError if any rank raises, dies, or the timeout passes.
    """
    if not callable(fn):
        raise TypeError(f"fn must be callable, got {type(fn).__name__}")
    if not isinstance(world_size, int) or world_size < 1:
        raise ValueError(f"world_size must be an int >= 1, got {world_size!r}")
    if timeout is None or timeout <= 0:
        raise ValueError(f"timeout must be a positive number of seconds, got {timeout!r}")
    collective_timeout = timeout if collective_timeout is None else collective_timeout
    if isinstance(collective_timeout, bool) or not isinstance(collective_timeout, (int, float)) or \
            collective_timeout <= 0:
        raise ValueError(f"collective_timeout must be a positive number of seconds, got {collective_timeout!r}")
    kwargs = dict(kwargs or {})
    _check_ranks_per_node(ranks_per_node, world_size)
    if _under_torchrun():
        if int(os.environ["WORLD_SIZE"]) != world_size:
            warnings.warn(f"zl.launch(world_size={world_size}) under torchrun: torchrun's WORLD_SIZE="
                          f"{os.environ['WORLD_SIZE']} is used", stacklevel=2)
        return _run_in_torchrun(fn, args, kwargs, backend, collective_timeout)

    backend = choose_backend(world_size, backend)
    threads = threads or max(1, cpu_count() // world_size)
    if start_method == "auto":
        fork_safe = sys.platform == "linux" and not torch.cuda.is_initialized() and threads == 1
        start_method = "fork" if fork_safe else "forkserver" if sys.platform == "linux" else "spawn"
    if start_method not in ("fork", "spawn", "forkserver"):
        raise ValueError(f"start_method must be 'auto', 'fork', 'spawn' or 'forkserver', got {start_method!r}")

    ctx = get_context(start_method)
    if start_method == "fork":
        _prewarm()
    elif start_method == "forkserver":  # takes effect when the server first starts
        ctx.set_forkserver_preload(["torch", "torch.distributed", "torch._dynamo", "cloudpickle", "zerolab.runtime.rank"])
    workdir = tempfile.mkdtemp(prefix="zerolab-launch-")
    # fork shares the function as-is; spawn needs it serialised by value
    payload = (fn, args, kwargs) if start_method == "fork" else cloudpickle.dumps((fn, args, kwargs))
    procs, conns = [], []
    try:
        for rank in range(world_size):
            parent_end, child_end = ctx.Pipe(duplex=False)
            p = ctx.Process(
                target=child_main, name=f"zerolab-rank{rank}", daemon=False,   # may start loader workers
                args=(payload, rank, world_size, backend, workdir, collective_timeout, threads, child_end,
                      os.getpid()),
                kwargs={"ranks_per_node": ranks_per_node or world_size})
            p.start()
            child_end.close()
            procs.append(p)
            conns.append(parent_end)
        results = collect(procs, conns, timeout, workdir)
    finally:
        _terminate(procs)
        for c in conns:
            c.close()
        shutil.rmtree(workdir, ignore_errors=True)
    return results


def _check_ranks_per_node(k, world_size):
    if k is None:
        return
    if isinstance(k, bool) or not isinstance(k, int) or k < 1 or world_size % k:
        raise ValueError(f"ranks_per_node must be an integer >= 1 that divides world_size ({world_size}), got {k!r}")
    if _under_torchrun() and int(os.environ.get("LOCAL_WORLD_SIZE", k)) != k:
        warnings.warn(f"zl.launch(ranks_per_node={k}) under torchrun: torchrun's LOCAL_WORLD_SIZE="
                      f"{os.environ['LOCAL_WORLD_SIZE']} is used", stacklevel=3)


def _prewarm():
    """Import once in the parent what every rank would otherwise import for
    itself after the fork: the first ``torch.optim`` optimizer pulls in
    ``torch._dynamo`` (about 3 s of CPU), and N children would pay it N times."""
    try:
        import torch._dynamo  # noqa: F401
    except Exception:  # pragma: no cover - optional in some builds
        pass


def _terminate(procs, grace: float = 2.0):
    """SIGTERM every live child, then SIGKILL what is left after ``grace`` s."""
    for p in procs:
        if p.is_alive():
            p.terminate()
    end = time.monotonic() + grace
    for p in procs:
        p.join(max(0.0, end - time.monotonic()))
        if p.is_alive():
            p.kill()
            p.join(1.0)


def _run_in_torchrun(fn, args, kwargs, backend, timeout):
    """Inside torchrun: this process is one rank; return every rank's result."""
    world = int(os.environ["WORLD_SIZE"])
    if backend == "auto":
        local = int(os.environ.get("LOCAL_WORLD_SIZE", world))
        backend = choose_backend(local)
    owns_group = not dist.is_initialized()
    if owns_group:
        if backend == "nccl":
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
        dist.init_process_group(backend, init_method="env://", timeout=timedelta(seconds=timeout))
    try:
        result = fn(*args, **kwargs)
        gathered = [None] * dist.get_world_size()
        dist.all_gather_object(gathered, result)
        return gathered
    finally:
        if owns_group:
            dist.destroy_process_group()
