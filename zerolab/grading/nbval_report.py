"""pytest plugin used by ``zerolab.grading.grader``: one JSON line per notebook cell nbval ran.

Loaded with ``-p zerolab.grading.nbval_report`` in the grading subprocess; writes to the
file named by ``$ZEROLAB_GRADE_JSON``. Each line: the notebook, the code-cell
number, the cell's zerolab metadata and tags, passed or not, and a one-line
reason (the exception the cell raised, or how its output differed).
"""
from __future__ import annotations

import json
import os

import pytest


def _reason(item, excinfo) -> str:
    for out in reversed(getattr(item, "test_outputs", None) or []):
        if out.get("output_type") == "error":
            return f"{out.get('ename')}: {out.get('evalue')}"
    exc = excinfo.value if excinfo is not None else None
    text = str(exc) if exc is not None else "failed"
    if "outputs differ" in text:
        got = "".join(o.get("text", "") for o in (item.test_outputs or []) if o.get("output_type") == "stream")
        want = "".join(o.get("text", "") for o in item.cell.get("outputs", []) if o.get("output_type") == "stream")
        return f"printed {got.strip()!r}, expected {want.strip()!r}"
    return text


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    outcome = yield
    report = outcome.get_result()
    path = os.environ.get("ZEROLAB_GRADE_JSON")
    cell = getattr(item, "cell", None)
    if not path or cell is None or (call.when != "call" and not report.failed):
        return
    md = cell.get("metadata", {})
    line = dict(notebook=os.path.basename(str(item.fspath)), cell=item.cell_num, when=call.when,
                tags=list(md.get("tags", [])), zerolab=dict(md.get("zerolab", {})),
                passed=report.passed, skipped=report.skipped,
                reason="" if report.passed else _reason(item, call.excinfo))
    line["zerolab"].pop("stub", None)
    with open(path, "a") as f:
        f.write(json.dumps(line) + "\n")
