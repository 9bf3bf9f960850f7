"""The grader: graded runs come from the pristine notebook plus the learner's answer cells only.

``python -m zerolab grade`` runs under nbval in a subprocess; these tests call it
twice (all solutions; all tampered stubs) so the suite stays fast on 2 cores.
"""
from __future__ import annotations

import copy
import subprocess
import sys
from pathlib import Path

import nbformat
import pytest

from zerolab.grading import exercises as ex
from zerolab.grading.answers import graded_from_learner
from zerolab.cli import main

REPO = Path(__file__).resolve().parent.parent
NAMES = ex.names()


def run_cli(*args, cwd=REPO):
    """``python -m zerolab ARGS`` in a subprocess (the real entry point; each pays torch's import)."""
    return subprocess.run([sys.executable, "-m", "zerolab", *args], cwd=cwd, capture_output=True, text=True,
                          timeout=1200)


def cli(capsys, *args):
    """The same command line in this process: (exit code, stdout, stderr)."""
    code = main(list(args))
    out = capsys.readouterr()
    return code, out.out, out.err


def code_cells(nb):
    return [c for c in nb.cells if c.cell_type == "code"]


# ---------------------------------------------------------------- the notebooks themselves
def test_seven_exercises_in_book_order():
    assert len(NAMES) >= 7
    assert [n[:2] for n in NAMES] == [f"{i:02d}" for i in range(1, len(NAMES) + 1)]
    for name in NAMES:
        assert (REPO / "exercises" / f"{name}.ipynb").is_file(), name


@pytest.mark.parametrize("name", NAMES)
def test_stub_is_derived_from_solution(name):
    """exercises/NN.ipynb == stub_notebook(solutions/NN.ipynb): sources, tags, no outputs."""
    sol = ex.read(ex.solution_path(name))
    stub = ex.read(REPO / "exercises" / f"{name}.ipynb")
    want = ex.stub_notebook(sol)
    assert [c.source for c in stub.cells] == [c.source for c in want.cells]
    assert [ex.tags(c) for c in stub.cells] == [ex.tags(c) for c in want.cells]
    assert all(not c.outputs and c.execution_count is None for c in code_cells(stub))
    assert stub.metadata["zerolab"]["exercise"] == name
    answers = [c for c in code_cells(sol) if ex.ANSWER in ex.tags(c)]
    checks = [c for c in code_cells(sol) if ex.CHECK in ex.tags(c)]
    assert answers and len(checks) >= 3
    for c in answers:
        assert ex.meta(c)["stub"] != c.source and "NotImplementedError" in ex.meta(c)["stub"]
    for c in checks:
        # a check asserts, then prints a stable line that nbval compares
        assert c.source.startswith("# NBVAL_CHECK_OUTPUT\n") and ("assert" in c.source or "AssertionError" in c.source)
        assert c.execution_count is not None
        assert c.outputs and all(o.output_type == "stream" and o.name == "stdout" for o in c.outputs)


# ---------------------------------------------------------------- building the graded notebook
def test_graded_notebook_takes_only_the_answer_cells(tmp_path):
    name = NAMES[0]
    sol = ex.read(ex.solution_path(name))
    learner = copy.deepcopy(ex.stub_notebook(sol))
    for c in code_cells(learner):
        if ex.CHECK in ex.tags(c):
            c.source = "# NBVAL_CHECK_OUTPUT\nprint('all good')"      # tampered check
            c.outputs = [nbformat.v4.new_output("stream", name="stdout", text="all good\n")]
    learner.cells.append(nbformat.v4.new_code_cell("helper = 1  # an extra cell of the learner's"))
    first = next(c for c in code_cells(learner) if ex.ANSWER in ex.tags(c))
    first.source = "# mine\n" + first.source
    path = tmp_path / "whatever_name.ipynb"
    ex.write(learner, path)

    exercise, graded, notes = graded_from_learner(path)
    assert exercise == name and not notes           # found by metadata, whatever the file name
    for g, s in zip(graded.cells, sol.cells):
        if ex.ANSWER in ex.tags(s):
            assert not g.outputs and g.execution_count is None
        else:
            assert g.source == s.source and g.get("outputs") == s.get("outputs")
    assert next(c for c in code_cells(graded) if ex.ANSWER in ex.tags(c)).source.startswith("# mine\n")


def test_answers_matched_by_order_when_metadata_is_lost(tmp_path):
    name = NAMES[0]
    learner = ex.stub_notebook(ex.read(ex.solution_path(name)))
    for c in code_cells(learner):
        c.metadata.get("zerolab", {}).pop("answer", None)
        if ex.ANSWER in ex.tags(c):
            c.source += "\n# edited"
    path = tmp_path / f"{name}.ipynb"
    ex.write(learner, path)
    _, graded, notes = graded_from_learner(path)
    got = [c.source for c in code_cells(graded) if ex.ANSWER in ex.tags(c)]
    assert got and all(s.endswith("# edited") for s in got) and not notes


def test_missing_answer_cells_fall_back_to_the_stub(tmp_path):
    name = NAMES[0]
    learner = ex.stub_notebook(ex.read(ex.solution_path(name)))
    learner.cells = [c for c in learner.cells if ex.ANSWER not in ex.tags(c)]
    path = tmp_path / f"{name}.ipynb"
    ex.write(learner, path)
    _, graded, notes = graded_from_learner(path)
    assert any("no answer cells" in n for n in notes)


# ---------------------------------------------------------------- the command line, under nbval
@pytest.mark.slow
def test_grade_passes_every_solution():
    paths = [str(ex.solution_path(n)) for n in NAMES]
    res = run_cli("grade", *paths)
    assert res.returncode == 0, res.stdout + res.stderr
    for n in NAMES:
        assert f"(exercise {n})" in res.stdout
    assert "FAIL" not in res.stdout and "ERROR" not in res.stdout
    assert f"{len(NAMES)}/{len(NAMES)} exercises complete" in res.stdout


@pytest.mark.slow
def test_grade_fails_stubs_even_with_the_solutions_outputs(tmp_path):
    """Pasting the solution's outputs into a stub passes nothing: outputs never reach the graded run.
    (Every untouched stub, and every stub in this test, also fails in test_exercises' one-kernel runs.)"""
    paths = []
    for n in (NAMES[0], NAMES[3], NAMES[-1]):   # one kernel each under nbval: three keep the suite fast
        sol = ex.read(ex.solution_path(n))
        stub = ex.stub_notebook(sol)
        dressed = copy.deepcopy(stub)           # the solution's outputs pasted into every cell
        for d, s in zip(code_cells(dressed), code_cells(sol)):
            d.outputs, d.execution_count = copy.deepcopy(s.outputs), s.execution_count
        out = tmp_path / "dressed" / f"{n}.ipynb"
        out.parent.mkdir(exist_ok=True)
        ex.write(dressed, out)
        paths.append(out)
    res = run_cli("grade", *map(str, paths))
    assert res.returncode == 1, res.stdout + res.stderr
    blocks = res.stdout.split("\n\n")
    for p in paths:
        block = next(b for b in blocks if b.startswith(str(p)))
        assert "FAIL  check 1:" in block and "NotImplementedError" in block, block
        assert "PASS" not in block, block
    assert f"0/{len(paths)} exercises complete" in res.stdout


def test_grade_rejects_missing_files_and_unknown_exercises(tmp_path, capsys):
    code, _, err = cli(capsys, "grade", str(tmp_path / "nope.ipynb"))
    assert code == 2 and "no such notebook" in err
    nb = ex.stub_notebook(ex.read(ex.solution_path(NAMES[0])))
    del nb.metadata["zerolab"]
    ex.write(nb, tmp_path / "mystery.ipynb")
    code, _, err = cli(capsys, "grade", str(tmp_path / "mystery.ipynb"))
    assert code == 2 and "unknown exercise 'mystery.ipynb'" in err


# ---------------------------------------------------------------- copy and reset
def test_copy_then_reset_keeps_a_backup(tmp_path, capsys):
    work = tmp_path / "my exercises"
    res = run_cli("exercises", "--copy", str(work))
    assert res.returncode == 0, res.stderr
    assert sorted(p.stem for p in work.glob("*.ipynb")) == NAMES
    mine = work / f"{NAMES[1]}.ipynb"
    nb = ex.read(mine)
    next(c for c in nb.cells if ex.ANSWER in ex.tags(c)).source = "# my work in progress"
    ex.write(nb, mine)

    code, out, _ = cli(capsys, "exercises", "--copy", str(work))     # copying again never overwrites
    assert code == 0 and "copied 0" in out
    assert "# my work in progress" in mine.read_text()

    short = NAMES[1].split("_", 1)[0]                                # "02" names the exercise too
    code, out, err = cli(capsys, "exercises", "--reset", short, "--dir", str(work))
    assert code == 0, err
    backup = work / f"{NAMES[1]}.ipynb.bak"
    assert str(backup) in out
    assert "# my work in progress" in backup.read_text()
    assert "# my work in progress" not in mine.read_text()
    assert [c.source for c in ex.read(mine).cells] == \
        [c.source for c in ex.read(REPO / "exercises" / f"{NAMES[1]}.ipynb").cells]
    ex.reset(NAMES[1], work)                                         # a second reset keeps both backups
    assert backup.exists() and (work / f"{NAMES[1]}.ipynb.bak1").exists()


def test_exercises_lists_them_and_rejects_unknown_names(capsys):
    code, out, _ = cli(capsys, "exercises")
    assert code == 0 and all(n in out for n in NAMES)
    code, _, err = cli(capsys, "exercises", "--reset", "99_nothing", "--dir", "/tmp")
    assert code == 2 and "unknown exercise" in err


def test_missing_exercise_folder_is_a_clear_error(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("ZEROLAB_EXERCISES_DIR", str(tmp_path))
    code, _, err = cli(capsys, "grade", str(REPO / "exercises" / f"{NAMES[0]}.ipynb"))
    assert code == 2 and "exercise notebooks not found" in err and "ZEROLAB_EXERCISES_DIR" in err
