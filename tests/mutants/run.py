"""Run the mutation suite (issue 25, item 8): each mutant of ``mutants.py`` on a copy of the package.

For each mutant: copy ``zerolab/`` into a fresh temporary directory, replace the mutant's
snippet (it must occur exactly once), and run the tests that should catch it with
``pytest -x -q`` from that directory, ``PYTHONPATH`` pointing at the copy, under a timeout.
The working tree is never modified. First every named test runs once on the unmutated
package (the baseline: a test failing there would "kill" every mutant naming it). A mutant is

    killed      the tests failed (or ran past the timeout: a hang is a failure too)
    survived    the tests passed: the bug they guard against goes unnoticed
    missing     the snippet is not in the source (exactly once): the table needs updating

Usage (from the repository root):

    python tests/mutants/run.py                  # every mutant
    python tests/mutants/run.py clip-above-one   # some of them, by id
    python tests/mutants/run.py --list           # the table

Exit status 0 only if every mutant run was killed.
"""
from __future__ import annotations

import argparse
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent.parent
sys.path.insert(0, str(HERE))
from mutants import MUTANTS, Mutant  # noqa: E402


def apply(m: Mutant, package_root: Path) -> bool:
    """Replace the mutant's snippet in the package under ``package_root``; False if it is not there once."""
    path = package_root / m.file
    text = path.read_text()
    if text.count(m.old) != 1:
        return False
    path.write_text(text.replace(m.old, m.new))
    return True


def run_one(m: Mutant, timeout: float, python: str, mutate: bool = True) -> tuple[str, float, str]:
    """(verdict, seconds, last lines of pytest's output) for one mutant (``mutate=False``: its tests
    on the package as it is, the baseline)."""
    t0 = time.monotonic()
    with tempfile.TemporaryDirectory(prefix=f"zl-mutant-{m.id}-") as tmp:
        tmp = Path(tmp)
        shutil.copytree(ROOT / "zerolab", tmp / "zerolab", ignore=shutil.ignore_patterns("__pycache__"))
        # the tests run from the copy too: pytest puts the rootdir's conftest.py directory first on sys.path,
        # which must be the copy's, or the working tree's zerolab is what the tests import
        shutil.copytree(ROOT / "tests", tmp / "tests", ignore=shutil.ignore_patterns("__pycache__"))
        for name in ("conftest.py", "pyproject.toml"):
            if (ROOT / name).exists():
                shutil.copy(ROOT / name, tmp / name)
        if mutate and not apply(m, tmp):
            return "missing", time.monotonic() - t0, f"snippet not found exactly once in {m.file}"
        env = dict(os.environ, PYTHONPATH=str(tmp), PYTHONDONTWRITEBYTECODE="1")
        # the tests must import the mutated copy, not the working tree (or an installed zerolab)
        probe = subprocess.run([python, "-c", "import zerolab; print(zerolab.__file__)"], cwd=tmp, env=env,
                               capture_output=True, text=True)
        if not probe.stdout.strip().startswith(str(tmp)):
            raise RuntimeError(f"the mutated copy is not what gets imported: {probe.stdout}{probe.stderr}")
        cmd = [python, "-m", "pytest", *[str(tmp / t) for t in m.tests], "-x", "-q", "-p", "no:cacheprovider",
               f"--rootdir={tmp}", "-c", str(tmp / "pyproject.toml"), f"--timeout={int(timeout)}"]
        proc = subprocess.Popen(cmd, cwd=tmp, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                text=True, start_new_session=True)
        try:
            out, _ = proc.communicate(timeout=timeout + 30)
            verdict = "survived" if proc.returncode == 0 else "killed"
            if proc.returncode in (2, 3, 4):   # interrupted, internal error, usage error: not a test failure
                verdict = "error"
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)   # pytest and the ranks it launched
            out, _ = proc.communicate()
            verdict = "killed"
            out += "\n(timed out: counted as killed)"
    lines = out.strip().splitlines()
    failed = [ln.replace(f"{tmp}/", "") for ln in lines
              if ln.startswith(("FAILED", "ERROR"))]   # what caught it
    tail = "\n".join((failed or lines[-3:])[:2])
    return verdict, time.monotonic() - t0, tail


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("ids", nargs="*", help="mutant ids to run (default: all)")
    ap.add_argument("--timeout", type=float, default=600, help="seconds per mutant (default 600)")
    ap.add_argument("--list", action="store_true", help="print the table and exit")
    ap.add_argument("--python", default=sys.executable, help="the interpreter that runs pytest")
    ap.add_argument("--no-baseline", action="store_true",
                    help="skip the first run of every named test on the unmutated package")
    args = ap.parse_args(argv)
    known = {m.id for m in MUTANTS}
    unknown = [i for i in args.ids if i not in known]
    if unknown:
        ap.error(f"unknown mutant id(s) {unknown}; --list shows them")
    chosen = [m for m in MUTANTS if not args.ids or m.id in args.ids]
    if args.list:
        for m in chosen:
            print(f"{m.id:28} {m.file:40} {m.why}\n{'':28} tests: {' '.join(m.tests)}")
        return 0
    t_all = time.monotonic()
    if not args.no_baseline:   # a test that fails without any mutant would "kill" every mutant naming it
        tests = tuple(dict.fromkeys(t for m in chosen for t in m.tests))
        base = Mutant("baseline", chosen[0].file, "", "", tests, "no mutant")
        # every mutant's tests at once: its time grows with the table (1300 s for 89 selections, busy machine)
        verdict, secs, tail = run_one(base, args.timeout * max(2, -(-len(tests) // 20)), args.python, mutate=False)
        print(f"[baseline] {'passed' if verdict == 'survived' else 'FAILED'} {secs:7.1f} s  "
              f"{len(tests)} test selections on the unmutated package", flush=True)
        if verdict != "survived":
            print("    " + tail.replace("\n", "\n    ")[-1500:])
            print("the tests fail without any mutant: fix them first (or --no-baseline)")
            return 1
    results = []
    for k, m in enumerate(chosen, 1):
        verdict, secs, tail = run_one(m, args.timeout, args.python)
        results.append((m, verdict, secs))
        print(f"[{k}/{len(chosen)}] {verdict:8} {secs:7.1f} s  {m.id}: {m.why}", flush=True)
        print("    " + tail.replace("\n", "\n    ")[:400], flush=True)
    total = time.monotonic() - t_all
    counts = {v: sum(r[1] == v for r in results) for v in ("killed", "survived", "missing", "error")}
    print(f"\n{counts['killed']}/{len(results)} killed, {counts['survived']} survived, "
          f"{counts['missing']} snippet missing, {counts['error']} errors; {total:.0f} s in all")
    return 0 if counts["killed"] == len(results) else 1


if __name__ == "__main__":
    sys.exit(main())
