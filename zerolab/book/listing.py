"""Show the package's real source in the book: ``zl.show(obj)``.

The chapters never carry a private teaching copy of an algorithm; they call
``show(engine_method)`` next to the prose, so what the reader reads is the
code that ran (every chapter uses it; chapter 0 introduces it).
"""
from __future__ import annotations

import inspect
import os
import textwrap


def _line_of(text, src_lines, start, obj) -> int:
    """1-based number of the first line at or after ``start`` that contains ``text``."""
    for i in range(start, len(src_lines) + 1):
        if text in src_lines[i - 1]:
            return i
    raise ValueError(f"{text!r} does not occur in the source of {obj!r}"
                     + (f" at or after line {start}" if start > 1 else ""))


def source(obj, lines=None) -> str:
    """The source of a function, method, class or module, with a location header.

    ``lines``: None for all of it; ``(first, last)`` 1-based line numbers
    within the object's source; a string — the first line containing it
    plus the indented block under that line (e.g. ``lines="def step"`` or
    ``lines="for bucket in"``); or two strings ``("shard = ", "optim = ")`` — the
    region from the first line containing the first through the first line at or
    after it containing the second (the part of a long function the prose is about).
    """
    obj = inspect.unwrap(getattr(obj, "__func__", obj))
    src_lines, start = inspect.getsourcelines(obj)
    start = max(start, 1)                             # modules report 0
    first, last = 1, len(src_lines)
    if isinstance(lines, tuple) and len(lines) == 2 and all(isinstance(x, str) for x in lines):
        first = _line_of(lines[0], src_lines, 1, obj)
        last = _line_of(lines[1], src_lines, first, obj)
    elif isinstance(lines, tuple):
        first, last = lines
        if not 1 <= first <= last <= len(src_lines):
            raise ValueError(f"lines {lines} outside 1..{len(src_lines)}")
    elif isinstance(lines, str):
        hits = [i for i, line in enumerate(src_lines, 1) if lines in line]
        if not hits:
            raise ValueError(f"{lines!r} does not occur in the source of {obj!r}")
        first = last = hits[0]
        indent = len(src_lines[first - 1]) - len(src_lines[first - 1].lstrip())
        for i in range(first + 1, len(src_lines) + 1):
            text = src_lines[i - 1]
            if text.strip() and len(text) - len(text.lstrip()) <= indent:
                if text.strip()[0] not in ")]}":   # a closing bracket still belongs to the block
                    break
            last = i
        while last > first and not src_lines[last - 1].strip():
            last -= 1                                  # no trailing blank lines
    elif lines is not None:
        raise TypeError("lines must be None, a (first, last) tuple of line numbers or of strings, or a string")
    body = textwrap.dedent("".join(src_lines[first - 1:last])).rstrip("\n")
    path = inspect.getsourcefile(obj) or "?"
    package_root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    if path.startswith(package_root + os.sep):
        path = os.path.relpath(path, package_root)
    where = f"line {start + first - 1}" if first == last else f"lines {start + first - 1}-{start + last - 1}"
    return f"# {path}, {where}\n{body}\n"


def show(obj, lines=None) -> None:
    """Display ``obj``'s real source: highlighted in a notebook, plain text elsewhere."""
    text = source(obj, lines)
    try:
        from IPython import get_ipython
        from IPython.display import Code, display
        if get_ipython() is not None:
            display(Code(text, language="python"))
            return
    except ImportError:
        pass
    print(text, end="")
