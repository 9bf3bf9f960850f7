"""zl.launch: results in rank order, failures named fast, no orphans, no collisions."""
import os
import signal
import subprocess
import sys
import textwrap
import threading
import time
import warnings

import psutil
import pytest
import torch
import torch.distributed as dist

import zerolab as zl
from zerolab.runtime.launch import cpu_count

PY = sys.executable


def rank_processes():
    """Our live child processes, less multiprocessing's long-lived helpers
    (the forkserver and the resource tracker), which are not ranks."""
    helpers = ("forkserver", "resource_tracker")
    return [p for p in psutil.Process().children(recursive=True)
            if p.status() != psutil.STATUS_ZOMBIE and not any(h in " ".join(p.cmdline()) for h in helpers)]


def _rank_info(x):
    t = torch.tensor([float(dist.get_rank())])
    dist.all_reduce(t)
    return dist.get_rank(), dist.get_world_size(), x, t.item(), torch.get_num_threads(), os.getpid()


@pytest.mark.parametrize("n", [1, 2, 3, 4])
def test_results_in_rank_order_and_threads(n):
    res = zl.launch(_rank_info, n, args=("hi",))
    cores = cpu_count()
    assert [r[0] for r in res] == list(range(n))
    assert all(r[1] == n and r[2] == "hi" and r[3] == n * (n - 1) / 2 for r in res)
    assert all(r[4] == max(1, cores // n) for r in res)
    assert len({r[5] for r in res} | {os.getpid()}) == n + 1     # one process per rank
    assert not rank_processes()


def _fail_on_rank(bad, n_steps):
    t = torch.ones(1)
    for _ in range(n_steps):
        if dist.get_rank() == bad:
            raise ValueError(f"deliberate failure on rank {bad}")
        dist.all_reduce(t)          # the others block here
    return t.item()


def test_failing_rank_is_named_with_traceback_within_seconds():
    t0 = time.monotonic()
    with pytest.raises(zl.LaunchError) as info:
        zl.launch(_fail_on_rank, 4, args=(2, 3), timeout=60)
    elapsed = time.monotonic() - t0
    assert info.value.rank == 2
    assert "rank 2 of 4 failed" in str(info.value)
    assert "ValueError: deliberate failure on rank 2" in info.value.remote_traceback
    assert "_fail_on_rank" in info.value.remote_traceback      # the rank's own frames
    assert elapsed < 5, elapsed
    assert not rank_processes()


def _hang():
    if dist.get_rank() == 1:
        time.sleep(600)
    return "done"


def test_hanging_rank_times_out_and_is_killed():
    t0 = time.monotonic()
    with pytest.raises(zl.LaunchError, match=r"timed out after 1.5 s: rank\(s\) \[1\] of 2"):
        zl.launch(_hang, 2, timeout=1.5)
    assert time.monotonic() - t0 < 5
    assert not rank_processes()


def _exit_hard():
    if dist.get_rank() == 0:
        os._exit(3)
    time.sleep(600)


def test_rank_that_dies_without_a_result():
    with pytest.raises(zl.LaunchError, match="rank 0 of 2 exited with code 3"):
        zl.launch(_exit_hard, 2, timeout=30)
    assert not rank_processes()


def _chatty():
    print("this must not reach the parent's stdout")
    print("nor this", file=sys.stderr)
    for _ in range(3):                      # the same warning three times is one warning
        warnings.warn("shared warning")
    if dist.get_rank() == 1:
        warnings.warn("only rank one", RuntimeWarning)
    return dist.get_rank()


def test_children_do_not_print_and_warnings_come_back_once(capfd):
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert zl.launch(_chatty, 3) == [0, 1, 2]
    out, err = capfd.readouterr()
    assert "must not reach" not in out + err and "nor this" not in out + err
    msgs = [(w.category, str(w.message)) for w in caught if "warning" in str(w.message) or "rank one" in str(w.message)]
    assert msgs == [(UserWarning, "[ranks 0, 1, 2] shared warning"), (RuntimeWarning, "[rank 1] only rank one")]


def _unpicklable():
    return threading.Lock()


def test_unpicklable_result_is_a_clear_error():
    with pytest.raises(zl.LaunchError, match="could not be pickled"):
        zl.launch(_unpicklable, 2)


def test_bad_arguments():
    with pytest.raises(ValueError, match="world_size"):
        zl.launch(_rank_info, 0)
    with pytest.raises(ValueError, match="backend"):
        zl.launch(_rank_info, 2, backend="mpi")
    with pytest.raises(TypeError, match="callable"):
        zl.launch(42, 2)


def test_twenty_launches_in_a_row():
    for i in range(20):
        assert [r[2] for r in zl.launch(_rank_info, 2, args=(i,))] == [i, i]


def _omp_work():
    x = torch.randn(256, 256)
    return torch.get_num_threads(), float((x @ x).sum() * 0)


def test_multithreaded_ranks_do_not_hang_after_the_parent_used_openmp():
    """GNU OpenMP hangs a forked child that uses >1 thread once the parent has
    used its pool: such ranks must start from the forkserver instead."""
    a = torch.randn(512, 512)
    _ = a @ a                                        # the parent's OpenMP pool now exists
    assert zl.launch(_omp_work, 1, threads=2, timeout=60) == [(2, 0.0)]


def test_spawn_with_a_local_closure_serialised_by_value():
    offset = 41

    def local(x):                     # not importable: must travel by value
        return dist.get_rank() + x + offset

    assert zl.launch(local, 2, args=(1,), start_method="spawn", timeout=60) == [42, 43]


SCRIPT = textwrap.dedent("""
    import os, signal, sys, time, torch, torch.distributed as dist, zerolab as zl
    # a process started in the background by a non-interactive shell inherits SIGINT
    # ignored; a Jupyter kernel always handles it: do the same here
    signal.signal(signal.SIGINT, signal.default_int_handler)
    def work(tag, pidfile):
        with open(pidfile + str(dist.get_rank()), "w") as f:
            f.write(str(os.getpid()))
        if tag == "sleep":
            time.sleep(600)
        t = torch.ones(4) * dist.get_rank()
        for _ in range(50):
            dist.all_reduce(t)
        return tag
    if __name__ == "__main__":
        method = sys.argv[4] if len(sys.argv) > 4 else "auto"
        print(zl.launch(work, int(sys.argv[2]), args=(sys.argv[1], sys.argv[3]), start_method=method), flush=True)
""")


def _script(tmp_path):
    path = tmp_path / "job.py"
    path.write_text(SCRIPT)
    return path


def test_two_launches_at_once_do_not_collide(tmp_path):
    path = _script(tmp_path)
    procs = [subprocess.Popen([PY, str(path), f"job{i}", "2", str(tmp_path / f"p{i}_")],
                              stdout=subprocess.PIPE, text=True) for i in range(3)]
    outs = [p.communicate(timeout=120)[0].strip() for p in procs]
    assert outs == ["['job0', 'job0']", "['job1', 'job1']", "['job2', 'job2']"]


def _wait_for_pids(prefix, n, timeout=120):  # a fresh interpreter imports torch: slow under load
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        files = [f"{prefix}{r}" for r in range(n)]
        if all(os.path.exists(f) and open(f).read() for f in files):
            return [int(open(f).read()) for f in files]
        time.sleep(0.05)
    raise AssertionError("ranks never started")


def _gone(pids, timeout=5):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if not any(psutil.pid_exists(p) and psutil.Process(p).status() != psutil.STATUS_ZOMBIE for p in pids):
            return True
        time.sleep(0.05)
    return False


@pytest.mark.parametrize("sig,method", [(signal.SIGINT, "fork"), (signal.SIGKILL, "fork"),
                                        (signal.SIGKILL, "forkserver")])
def test_interrupt_or_killed_parent_leaves_no_orphans(tmp_path, sig, method):
    """SIGINT is what 'interrupt the kernel' sends; SIGKILL is a crashed kernel."""
    path = _script(tmp_path)
    parent = subprocess.Popen([PY, str(path), "sleep", "3", str(tmp_path / "p_"), method],
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    pids = _wait_for_pids(str(tmp_path / "p_"), 3)
    parent.send_signal(sig)
    try:
        out, err = parent.communicate(timeout=120)   # interpreter shutdown is slow on a loaded machine
    except subprocess.TimeoutExpired:
        parent.kill()
        out, err = parent.communicate()
        raise AssertionError(f"the parent did not exit after {sig!r}; its stderr:\n{err[-3000:]}")
    if sig == signal.SIGINT:
        assert "KeyboardInterrupt" in err
    assert _gone(pids), "rank processes survived their parent"


def test_backend_auto_is_gloo_without_enough_gpus():
    from zerolab.runtime.launch import choose_backend
    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    assert choose_backend(gpus + 1) == "gloo"


TORCHRUN_SCRIPT = textwrap.dedent("""
    import torch, torch.distributed as dist, zerolab as zl
    def work(x):
        t = torch.ones(1) * dist.get_rank()
        dist.all_reduce(t)
        return dist.get_rank(), x, t.item()
    if __name__ == "__main__":
        res = zl.launch(work, 2, args=("same-code",))
        if dist.is_available() and int(__import__("os").environ["RANK"]) == 0:
            print("RESULT", res, flush=True)
""")


def test_same_worker_runs_under_torchrun(tmp_path):
    path = tmp_path / "train.py"
    path.write_text(TORCHRUN_SCRIPT)
    out = subprocess.run([PY, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
                          str(path)], capture_output=True, text=True, timeout=180)
    assert out.returncode == 0, out.stderr[-2000:]
    assert "RESULT [(0, 'same-code', 1.0), (1, 'same-code', 1.0)]" in out.stdout
