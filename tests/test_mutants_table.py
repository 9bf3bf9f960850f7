"""The mutation suite's table stays valid (issue 25, item 8); the mutants themselves run with `make mutants`.

Every mutant's snippet must occur exactly once in the current source and its replacement
must still compile (a mutant killed by a syntax error proves nothing); every test it names
must exist. A refactor that moves a snippet fails here, so the table is updated with it.
"""
from __future__ import annotations

import ast
import importlib.util
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests" / "mutants"))
from mutants import MUTANTS, Mutant  # noqa: E402

_spec = importlib.util.spec_from_file_location("zerolab_mutants_run", ROOT / "tests" / "mutants" / "run.py")
run = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(run)


def test_enough_distinct_mutants_over_every_area():
    assert len(MUTANTS) >= 20
    assert len({m.id for m in MUTANTS}) == len(MUTANTS), "mutant ids must be unique"
    files = {m.file for m in MUTANTS}
    for area in ("zerolab/engine/stage", "zerolab/engine/bigmodel/", "zerolab/engine/checkpoint/",
                 "zerolab/engine/zeropp/"):
        assert any(f.startswith(area) for f in files), f"no mutant in {area}"


@pytest.mark.parametrize("m", MUTANTS, ids=[m.id for m in MUTANTS])
def test_snippet_occurs_once_and_the_mutant_compiles(m):
    path = ROOT / m.file
    assert m.file.startswith("zerolab/") and path.is_file(), m.file
    text = path.read_text()
    assert text.count(m.old) == 1, (f"{m.id}: the snippet occurs {text.count(m.old)} times in {m.file} "
                                    f"(expected once); update tests/mutants/mutants.py:\n{m.old}")
    assert m.new != m.old and m.why and m.tests
    compile(text.replace(m.old, m.new), m.file, "exec")


@pytest.mark.parametrize("m", MUTANTS, ids=[m.id for m in MUTANTS])
def test_named_tests_exist(m):
    for node in m.tests:
        file, _, rest = node.partition("::")
        path = ROOT / file
        assert path.is_file(), f"{m.id}: no test file {file}"
        if rest:
            name = rest.split("[")[0]
            defined = {n.name for n in ast.walk(ast.parse(path.read_text())) if isinstance(n, ast.FunctionDef)}
            assert name in defined, f"{m.id}: no test {name} in {file}"


def test_runner_applies_to_a_copy_and_reports_a_missing_snippet(tmp_path):
    m = MUTANTS[0]
    (tmp_path / m.file).parent.mkdir(parents=True)
    (tmp_path / m.file).write_text((ROOT / m.file).read_text())
    assert run.apply(m, tmp_path)
    assert m.new in (tmp_path / m.file).read_text() and m.old not in (tmp_path / m.file).read_text()
    assert (ROOT / m.file).read_text().count(m.old) == 1   # the working tree is untouched
    gone = Mutant("gone", m.file, "no such snippet", "x", m.tests, "test")
    assert not run.apply(gone, tmp_path)
    verdict, _, tail = run.run_one(gone, timeout=10, python=sys.executable)
    assert verdict == "missing" and "not found" in tail
