"""The set-up files agree with each other: environment.yml, pyproject.toml, Makefile, .ci/run."""
import os
import re
import tomllib
from pathlib import Path

from packaging.requirements import Requirement

ROOT = Path(__file__).resolve().parents[1]


def _pyproject_requirements():
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    reqs = list(project["dependencies"])
    for extra in ("notebook", "test"):
        reqs += project["optional-dependencies"][extra]
    return {Requirement(r).name: Requirement(r) for r in reqs}


def _environment_requirements():
    text = (ROOT / "environment.yml").read_text()
    pip_section = text.split("- pip:", 1)[1]
    pip = [m.group(1) for line in pip_section.splitlines()
           if (m := re.match(r"\s+- ([A-Za-z].*)$", line))]
    return {Requirement(r).name: Requirement(r) for r in pip}


def test_environment_yml_names_the_same_dependencies_as_pyproject():
    py, env = _pyproject_requirements(), _environment_requirements()
    assert set(py) == set(env), f"only in pyproject: {set(py) - set(env)}; only in environment.yml: {set(env) - set(py)}"
    for name, req in py.items():
        if name == "torch":
            # environment.yml pins the on-disk CPU build; it must satisfy pyproject's range
            pinned = next(iter(env[name].specifier)).version
            assert env[name].specifier == Requirement("torch==2.13.0").specifier
            assert req.specifier.contains(pinned), f"torch {pinned} outside pyproject's {req.specifier}"
        else:
            assert req.specifier == env[name].specifier, f"{name}: {req.specifier} vs {env[name].specifier}"


def test_makefile_pins_torch_and_has_the_two_commands():
    mk = (ROOT / "Makefile").read_text()
    assert re.search(r"^TORCH\s*\?=\s*torch==2\.13\.0$", mk, re.M)
    assert re.search(r"^lab:", mk, re.M) and re.search(r"^test:", mk, re.M)
    assert "make test" in (ROOT / ".ci" / "run").read_text()
    readme = (ROOT / "README.md").read_text()
    assert "make lab" in readme and "make test" in readme


def test_every_chapter_in_the_readme_exists():
    readme = (ROOT / "README.md").read_text()
    listed = re.findall(r"chapters/(\d\d_\w+\.ipynb)", readme)
    assert listed, "README lists no chapters"
    missing = [c for c in listed if not (ROOT / "chapters" / c).exists()]
    assert not missing, f"README lists chapters that do not exist yet: {missing}"


def test_make_lab_serves_the_book():
    """`make lab` (the README's first command) really starts JupyterLab on the book."""
    import signal
    import socket
    import subprocess
    import time
    import urllib.request

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    proc = subprocess.Popen(["make", "-s", "lab", f"PORT={port}",
                             "LAB_ARGS=--no-browser --ip=127.0.0.1 --IdentityProvider.token="],
                            cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True)
    try:
        deadline, body = time.monotonic() + 120, None
        while time.monotonic() < deadline and proc.poll() is None:
            try:
                url = f"http://127.0.0.1:{port}/api/contents/chapters/00_welcome.ipynb?content=0"
                body = urllib.request.urlopen(url, timeout=2).read().decode()
                break
            except OSError:
                time.sleep(0.5)
        assert body is not None, f"JupyterLab did not come up:\n{proc.stdout.read() if proc.poll() is not None else ''}"
        assert '"path": "chapters/00_welcome.ipynb"' in body or '"path":"chapters/00_welcome.ipynb"' in body
        home = urllib.request.urlopen(f"http://127.0.0.1:{port}/", timeout=10)
        assert home.geturl().endswith("/lab/tree/chapters/00_welcome.ipynb")   # opens on chapter 0
    finally:
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(60)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(10)


def test_every_public_name_resolves():
    """zerolab's lazy export table names a module for each public name: each must exist there."""
    import zerolab as zl
    missing = [n for n in zl.__all__ if not hasattr(zl, n)]
    assert not missing, f"zerolab.__all__ names that do not resolve: {missing}"
