"""While nbval executes a chapter (``pytest chapters --nbval-lax``), each cell's printed output is
checked as well as its prose: no ``False`` on a line that claims an equality, match or agreement,
no negative duration outside a difference (``tests/test_prose_numbers.py``, ``output_problems``)."""
from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent / "tests"))
from test_prose_numbers import output_problems, output_text  # noqa: E402


@pytest.hookimpl(wrapper=True)
def pytest_runtest_call(item):
    result = yield
    outputs = getattr(item, "test_outputs", None)      # nbval's cell items keep what the cell printed
    if outputs:
        problems = output_problems(output_text(outputs))
        if problems:
            raise AssertionError(f"{item.name}: the cell prints what contradicts its own claim:\n  "
                                 + "\n  ".join(problems))
    return result
