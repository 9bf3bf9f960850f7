"""Grading the exercises: ``python -m zerolab grade PATH...`` (every chapter's exercises).

What runs is built by ``zerolab.grading.answers``: the pristine solution notebook
with the learner's answer cells in it, nothing else of their file (so stored outputs
cannot pass a check). The graded notebooks run under ``pytest --nbval-lax`` in one
subprocess (one kernel per notebook): a check cell passes when it raises nothing and
prints exactly its expected line (it is marked ``# NBVAL_CHECK_OUTPUT``).
``zerolab.grading.nbval_report`` turns nbval's per-cell results into a ``Report``.

``grade_variants`` is the fast path the tests use: many answer variants of
one exercise, each run through every cell, all in a single kernel.
"""
from __future__ import annotations

import copy
import json
import os
import subprocess
import sys
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

from zerolab.grading import exercises as ex
from zerolab.grading.answers import build_graded, graded_from_learner

CELL_TIMEOUT = 300   # seconds per cell


@dataclass
class CellResult:
    cell: int          # code-cell number (nbval's "Cell N")
    kind: str          # "check" | "answer" | "other"
    name: str
    passed: bool
    reason: str = ""


@dataclass
class Report:
    path: str
    exercise: str
    cells: list = field(default_factory=list)
    notes: list = field(default_factory=list)

    @property
    def checks(self) -> list:
        return [c for c in self.cells if c.kind == "check"]

    @property
    def errors(self) -> list:
        return [c for c in self.cells if c.kind != "check" and not c.passed]

    @property
    def passed(self) -> bool:
        return bool(self.checks) and all(c.passed for c in self.checks) and not self.errors

    def failed_checks(self) -> set:
        return {c.name for c in self.checks if not c.passed}

    def text(self) -> str:
        lines = [f"{self.path}  (exercise {self.exercise})"]
        lines += [f"  note: {n}" for n in self.notes]
        k = 0
        for c in self.cells:
            if c.kind == "check":
                k += 1
                lines.append(f"  {'PASS' if c.passed else 'FAIL'}  check {k}: {c.name}")
            elif not c.passed and c.kind == "answer":
                lines.append(f"  ERROR in your answer cell {c.name!r}")
            elif not c.passed:
                lines.append(f"  ERROR in code cell {c.cell} of the exercise (set-up)")
            if not c.passed:
                lines += [f"        {r}" for r in _short(c.reason).splitlines()]
        n_ok = sum(c.passed for c in self.checks)
        lines.append(f"  {n_ok}/{len(self.checks)} checks passed" + ("" if self.passed else "  -- not yet"))
        return "\n".join(lines)


def _short(reason: str, limit: int = 12) -> str:
    lines = [ln for ln in reason.strip().splitlines() if ln.strip()]
    return "\n".join(lines[:limit] + (["..."] if len(lines) > limit else []))


def _kind(cell) -> tuple[str, str]:
    z, t = ex.meta(cell), ex.tags(cell)
    if ex.CHECK in t:
        return "check", z.get("check", "check")
    if ex.ANSWER in t:
        return "answer", z.get("answer", "answer")
    return "other", ""


# ---------------------------------------------------------------- grading under nbval
def _nbval(files: list[Path], workdir: Path, timeout: int) -> list[dict]:
    out = workdir / "results.jsonl"
    (workdir / "pytest.ini").write_text("[pytest]\n")
    env = dict(os.environ, ZEROLAB_GRADE_JSON=str(out), PYTHONWARNINGS="ignore::DeprecationWarning")
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p", "zerolab.grading.nbval_report",
           "-c", str(workdir / "pytest.ini"), "--rootdir", str(workdir), "--nbval-lax", "--nbval-current-env",
           f"--nbval-cell-timeout={timeout}", *map(str, files)]
    proc = subprocess.run(cmd, cwd=workdir, env=env, capture_output=True, text=True)
    if not out.exists():
        raise RuntimeError(f"grading run produced no results (exit {proc.returncode}):\n"
                           f"{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}")
    return [json.loads(line) for line in out.read_text().splitlines() if line.strip()]


def grade(paths, timeout: int = CELL_TIMEOUT) -> list[Report]:
    """Grade learner notebooks (one nbval run for all of them); a Report each."""
    reports, files = [], []
    with tempfile.TemporaryDirectory(prefix="zerolab-grade-") as tmp:
        tmp = Path(tmp)
        for i, path in enumerate(paths):
            exercise, nb, notes = graded_from_learner(path)
            f = tmp / f"g{i:03d}_{exercise}.ipynb"
            ex.write(nb, f)
            files.append(f)
            reports.append(Report(str(path), exercise, notes=notes))
        rows = _nbval(files, tmp, timeout)
    for f, rep in zip(files, reports):
        seen = {}
        for row in rows:
            if row["notebook"] != f.name:
                continue
            kind = "check" if ex.CHECK in row["tags"] else "answer" if ex.ANSWER in row["tags"] else "other"
            name = row["zerolab"].get(kind, f"(code cell {row['cell']})")
            prev = seen.get(row["cell"])
            if prev is not None:          # a teardown/setup line for a cell already seen
                prev.passed = prev.passed and row["passed"]
                prev.reason = prev.reason or row["reason"]
                continue
            seen[row["cell"]] = CellResult(row["cell"], kind, name, row["passed"] or row["skipped"], row["reason"])
        rep.cells = [seen[k] for k in sorted(seen)]
        if not rep.cells:
            rep.notes.append("nbval ran no cells (is the kernel installed?)")
    return reports


# ---------------------------------------------------------------- many variants, one kernel
def _stream_text(outputs) -> list:
    keep = []
    for o in outputs:
        if o.get("output_type") == "stream":
            keep.append((o.get("name"), o.get("text", "")))
        elif o.get("output_type") in ("execute_result", "display_data"):
            keep.append(("data", o.get("data", {}).get("text/plain", "")))
    merged = []   # coalesce consecutive chunks of the same stream, as nbval does
    for name, text in keep:
        if merged and merged[-1][0] == name:
            merged[-1] = (name, merged[-1][1] + text)
        else:
            merged.append((name, text))
    return merged


def grade_variants(exercise: str, variants: dict, timeout: int = CELL_TIMEOUT) -> dict:
    """{label: {answer name: source}} -> {label: Report}, all in ONE kernel.

    Each variant runs every code cell of the pristine notebook in order, with
    its answers (unnamed answers keep the solution's code). A check passes when
    it raises nothing and prints what the pristine notebook stored, as under nbval.
    """
    from nbclient import NotebookClient
    exercise = ex.resolve_name(exercise)
    pristine = ex.read(ex.solution_path(exercise))
    solution = {ex.meta(c)["answer"]: c.source for c in pristine.cells
                if c.cell_type == "code" and ex.ANSWER in ex.tags(c)}
    reports = {}
    with tempfile.TemporaryDirectory(prefix="zerolab-variants-") as tmp:
        client = NotebookClient(copy.deepcopy(pristine), timeout=timeout, kernel_name="python3", allow_errors=True,
                                resources={"metadata": {"path": tmp}})
        with client.setup_kernel():
            for label, answers in variants.items():
                nb = build_graded(exercise, {**solution, **answers})
                client.nb = nb
                rep = Report(f"<variant {label}>", exercise)
                code = [c for c in nb.cells if c.cell_type == "code"]
                want = [c for c in pristine.cells if c.cell_type == "code"]
                for i, (cell, ref) in enumerate(zip(code, want)):
                    client.execute_cell(cell, nb.cells.index(cell))
                    kind, name = _kind(cell)
                    err = [o for o in cell.outputs if o.get("output_type") == "error"]
                    reason = f"{err[-1]['ename']}: {err[-1]['evalue']}" if err else ""
                    if not err and kind == "check" and "NBVAL_CHECK_OUTPUT" in cell.source:
                        got, exp = _stream_text(cell.outputs), _stream_text(ref.outputs)
                        if got != exp:
                            reason = f"printed {got!r}, expected {exp!r}"
                    rep.cells.append(CellResult(i, kind, name or f"(code cell {i})", not reason, reason))
                reports[label] = rep
    return reports


# ---------------------------------------------------------------- command line
def add_grade_args(p):
    p.add_argument("paths", nargs="+", help="exercise notebooks (yours), e.g. exercises/01_memory.ipynb")
    p.add_argument("--timeout", type=int, default=CELL_TIMEOUT, help="seconds per cell")


def cmd_grade(args) -> int:
    try:
        ex.exercises_dir()
    except FileNotFoundError as e:
        raise ValueError(str(e)) from None
    paths = [p for p in args.paths if not p.endswith(".bak")]
    for p in paths:
        if not Path(p).is_file():
            raise ValueError(f"no such notebook: {p}")
    reports = grade(paths, timeout=args.timeout)
    for r in reports:
        print(r.text() + "\n")
    ok = sum(r.passed for r in reports)
    if len(reports) > 1:
        print(f"{ok}/{len(reports)} exercises complete")
    return 0 if ok == len(reports) else 1


def add_exercises_args(p):
    g = p.add_mutually_exclusive_group()
    g.add_argument("--copy", metavar="DIR", help="copy every exercise stub to DIR (existing files are kept)")
    g.add_argument("--reset", metavar="NAME", help="restore exercise NAME; your file is kept as NAME.ipynb.bak")
    g.add_argument("--sync", metavar="NAME", nargs="?", const="all",
                   help="(maintainers) re-run solutions/NAME (or all) and rewrite the stub from it")
    p.add_argument("--dir", default=None, help="with --reset: the folder holding your copy (default: exercises/)")


def cmd_exercises(args) -> int:
    try:
        ex.exercises_dir()
    except FileNotFoundError as e:
        raise ValueError(str(e)) from None
    if args.copy:
        written = ex.copy_to(args.copy)
        print(f"copied {len(written)} exercise(s) to {Path(args.copy).expanduser().resolve()}"
              + ("" if len(written) == len(ex.names()) else " (files already there were kept)"))
        print(f"grade one with: python -m zerolab grade {Path(args.copy) / (ex.names()[0] + '.ipynb')}")
        return 0
    if args.reset:
        target, backup = ex.reset(args.reset, args.dir)
        print(f"restored {target}" + (f"; your previous file is {backup}" if backup else ""))
        return 0
    if args.sync:
        for name in ex.names() if args.sync == "all" else [args.sync]:
            ex.sync(name)
            print(f"synced {ex.resolve_name(name)}: solution re-run, stub rewritten")
        return 0
    for name in ex.names():
        print(f"{name:<24} exercises/{name}.ipynb")
    return 0
