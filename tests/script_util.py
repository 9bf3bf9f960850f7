"""Run a script (python or torchrun) as a test's subprocess, leaving no process behind on a timeout."""
from __future__ import annotations

import os
import signal
import subprocess
from types import SimpleNamespace


def run_script(cmd: list, env: dict, timeout: float, cwd=None) -> SimpleNamespace:
    """``subprocess.run(cmd, capture_output=True, text=True)`` in a session of its own: on a timeout the whole
    process group (torchrun, its ranks and their loader workers) is killed, then ``TimeoutError`` is raised
    with the output so far. Returns (returncode, stdout, stderr)."""
    p = subprocess.Popen(cmd, env=env, cwd=cwd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                         start_new_session=True)
    try:
        out, err = p.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(p.pid, signal.SIGKILL)
        out, err = p.communicate()
        raise TimeoutError(f"{' '.join(map(str, cmd[:4]))} ... ran past {timeout} s; its process group was killed. "
                           f"stderr (last lines):\n{(err or '')[-3000:]}") from None
    return SimpleNamespace(returncode=p.returncode, stdout=out, stderr=err)
