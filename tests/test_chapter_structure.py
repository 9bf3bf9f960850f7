"""Every chapter has the same shape (chapters 0-14; the book's conventions, issue 7).

Checked statically on the committed .ipynb files, without running them:

* nbformat 4.5 or later, a kernelspec (name, display_name, language "python"),
  a unique ``id`` on every cell (nbformat 4.5 requires them; a cell pasted in
  without one makes nbformat warn and will become an error), no stored
  outputs, execution counts or widget state;
* the first cell is the title ``# Chapter N — ...`` with N the file's number,
  and there are ``##`` section headings;
* the last ``##`` section is ``## Interview questions``; it holds at least
  three questions written ``**Q1.** ...`` (or ``**Q1. ...**``), numbered in order, and each
  question's answer is a ``<details><summary>...</summary>`` block (blank line
  after the summary line, so JupyterLab renders the markdown inside), closed
  before the next question, with nothing but headings after it;
* a code cell that computes an interview answer — any code cell inside the
  interview section, and any cell anywhere carrying the marker below — is
  collapsed (``metadata.jupyter.source_hidden`` and ``outputs_hidden`` true),
  starts with the marker line and prints through ``widgets.folded(...)``, so
  neither its code nor its output gives the answer away.

* every teaching chapter (1-10) has a ``## Drills`` section before the interview: numeric
  problems ``**Drill 1.**``, ``**Drill 2.**``, ... (at least three), each followed by a code cell
  with hidden source that checks a typed answer with ``zerolab.book.drills.drill(k, ...)``.

The marker convention (chapters 1-6): the first line of such a cell is
``# numbers for the answer above (hidden)`` and the printing happens inside
``with folded("numbers for the answer"):``.
"""
from __future__ import annotations

import itertools
import json
import re
from pathlib import Path

import pytest

CHAPTERS = Path(__file__).resolve().parent.parent / "chapters"
MARKER = "# numbers for the answer above (hidden)"
INTERVIEW = "## Interview questions"
QUESTION = re.compile(r"\*\*Q(\d+)\.")           # **Q1.** text, or **Q1. text**
MIN_QUESTIONS = 3


def chapter_files() -> list[Path]:
    return sorted(CHAPTERS.glob("[0-9][0-9]_*.ipynb"))


def load(path: Path) -> dict:
    return json.loads(path.read_text(encoding="utf-8"))


def source(cell) -> str:
    s = cell.get("source", "")
    return "".join(s) if isinstance(s, list) else s


def headings(cell) -> list[str]:
    """Markdown ATX headings of a cell (lines inside ``` fences skipped)."""
    out, fenced = [], False
    for line in source(cell).splitlines():
        if line.lstrip().startswith("```"):
            fenced = not fenced
        elif not fenced and re.match(r"#{1,6} ", line):
            out.append(line.rstrip())
    return out


def interview_start(cells) -> int | None:
    """Index of the cell holding the last level-2 heading, if it is ``## Interview questions``."""
    last = None
    for i, c in enumerate(cells):
        if c["cell_type"] == "markdown":
            for h in headings(c):
                if h.startswith("## ") or h.startswith("# "):
                    last = (i, h)
    if last is None or last[1] != INTERVIEW:
        return None
    return last[0]


def is_collapsed(cell) -> bool:
    j = cell.get("metadata", {}).get("jupyter", {})
    return j.get("source_hidden") is True and j.get("outputs_hidden") is True


def answer_problems(text: str) -> list[str]:
    """Problems with the questions and answers of an interview section's markdown."""
    problems = []
    marks = list(QUESTION.finditer(text))
    numbers = [int(m.group(1)) for m in marks]
    if len(marks) < MIN_QUESTIONS:
        problems.append(f"only {len(marks)} questions (**Q1.** ...), at least {MIN_QUESTIONS} expected")
    if numbers != list(range(1, len(numbers) + 1)):
        problems.append(f"questions numbered {numbers}, expected 1..{len(numbers)} in order")
    ends = [m.start() for m in marks[1:]] + [len(text)]
    for m, end in zip(marks, ends):
        chunk = text[m.start():end]
        q = f"Q{m.group(1)}"
        opens = [x.start() for x in re.finditer(r"<details>", chunk)]
        closes = [x.start() for x in re.finditer(r"</details>", chunk)]
        if len(opens) != 1 or len(closes) != 1 or closes[0] < opens[0]:
            problems.append(f"{q}: its answer must be exactly one <details> ... </details> block "
                            f"(found {len(opens)} open, {len(closes)} close)")
            continue
        block = chunk[opens[0]:closes[0]]
        first, _, rest = block.partition("\n")
        if not re.fullmatch(r"<details>\s*<summary>.+</summary>\s*", first):
            problems.append(f"{q}: the <details> line must be '<details><summary>...</summary>'")
        if not rest.startswith("\n") or not rest.strip():
            problems.append(f"{q}: a blank line must follow the summary, then the answer (markdown in HTML "
                            f"renders only after a blank line)")
        before = chunk[:opens[0]]
        if len(QUESTION.sub("", before).strip()) < 10:
            problems.append(f"{q}: the question text is missing")
        after = chunk[closes[0] + len("</details>"):]
        stray = [ln for ln in after.splitlines() if ln.strip() and not re.match(r"#{3,6} ", ln)]
        if stray:
            problems.append(f"{q}: text after its </details> is outside the answer: {stray[0][:60]!r}")
    return problems


def structure_problems(path: Path) -> list[str]:
    """Everything wrong with one chapter's structure (empty list: fine)."""
    nb = load(path)
    problems = []
    if nb.get("nbformat") != 4:
        problems.append(f"nbformat {nb.get('nbformat')}, expected 4")
    ks = nb.get("metadata", {}).get("kernelspec") or {}
    if not (ks.get("name") and ks.get("display_name") and ks.get("language") == "python"):
        problems.append(f"kernelspec missing or incomplete: {ks!r}")
    if "widgets" in nb.get("metadata", {}):
        problems.append("stored widget state in the notebook metadata")
    cells = nb.get("cells", [])
    if not cells:
        return problems + ["no cells"]
    if nb.get("nbformat") == 4 and nb.get("nbformat_minor", 0) < 5:
        problems.append(f"nbformat 4.{nb.get('nbformat_minor')}: 4.5 or later (cell ids) expected")
    ids = [c.get("id") for c in cells]
    for i, cell_id in enumerate(ids):
        if not isinstance(cell_id, str) or not re.fullmatch(r"[a-zA-Z0-9_-]{1,64}", cell_id):
            problems.append(f"cell {i}: missing or malformed cell id {cell_id!r}")
        elif ids.index(cell_id) != i:
            problems.append(f"cell {i}: id {cell_id!r} repeats cell {ids.index(cell_id)}'s")
    for i, c in enumerate(cells):
        if c["cell_type"] == "code" and (c.get("outputs") or c.get("execution_count") is not None):
            problems.append(f"cell {i}: stored outputs or execution count (commit notebooks without outputs)")
    number = int(path.name[:2])
    title = headings(cells[0])[:1] if cells[0]["cell_type"] == "markdown" else []
    if not title or not re.fullmatch(rf"# Chapter {number} — \S.*", title[0]):
        problems.append(f"first cell must start with the title '# Chapter {number} — ...', got {title[:1]}")
    sections = [h for c in cells if c["cell_type"] == "markdown" for h in headings(c) if h.startswith("## ")]
    if len(sections) < 1:
        problems.append("no '## ' section headings")
    start = interview_start(cells)
    if start is None:
        problems.append(f"the last '## ' section must be '{INTERVIEW}' (last is {sections[-1:] or None})")
    else:
        section = cells[start:]
        text = source(section[0]).split(INTERVIEW, 1)[1]
        text += "\n" + "\n".join(source(c) for c in section[1:] if c["cell_type"] == "markdown")
        problems += answer_problems(text)
    for i, c in enumerate(cells):
        if c["cell_type"] != "code":
            continue
        src = source(c)
        in_section = start is not None and i > start
        if not in_section and MARKER not in src:
            continue
        if in_section and MARKER not in src:
            problems.append(f"cell {i}: a code cell in '{INTERVIEW}' without the marker {MARKER!r}: the section "
                            f"holds only questions and their collapsed answer cells (move set-up or clean-up "
                            f"code above the section, or into an answer cell): {src.strip()[:50]!r}")
            continue
        if not is_collapsed(c):
            problems.append(f"cell {i}: computes an interview answer but is not collapsed "
                            f"(metadata jupyter.source_hidden and outputs_hidden)")
        if src.splitlines()[:1] != [MARKER]:
            problems.append(f"cell {i}: an interview cell must start with {MARKER!r}")
        if "folded(" not in src:
            problems.append(f"cell {i}: an interview cell must print inside 'with folded(...)'")
    return problems


def test_there_are_chapters():
    names = [p.name for p in chapter_files()]
    assert names and names[0].startswith("00_"), names
    assert len({n[:2] for n in names}) == len(names), f"two chapters share a number: {names}"


@pytest.mark.parametrize("path", chapter_files(), ids=lambda p: p.stem)
def test_chapter_structure(path):
    problems = structure_problems(path)
    assert not problems, f"{path.name}:\n  " + "\n  ".join(problems)


# ---- the checker itself must catch what it claims to (a broken chapter fails) ----

_ids = itertools.count()


def _cell(kind, text, **meta):
    c = {"cell_type": kind, "id": f"c{next(_ids)}", "metadata": meta, "source": text}
    if kind == "code":
        c.update(outputs=[], execution_count=None)
    return c


GOOD_QA = ("**Q{n}.** What is question {n} about here?\n\n<details><summary>Answer</summary>\n\n"
           "The answer {n}.\n</details>\n")
HIDDEN = {"jupyter": {"source_hidden": True, "outputs_hidden": True}}


def _nb(cells, kernelspec=True):
    meta = {"kernelspec": {"name": "python3", "display_name": "Python 3", "language": "python"}} if kernelspec else {}
    return {"nbformat": 4, "nbformat_minor": 5, "metadata": meta, "cells": cells}


def _good_cells():
    return [_cell("markdown", "# Chapter 7 — A title\n\nIntro."),
            _cell("markdown", "## A section\n\nText."),
            _cell("code", "x = 1"),
            _cell("markdown", "## Interview questions\n\n" + GOOD_QA.format(n=1)),
            _cell("code", MARKER + "\nwith folded('numbers for the answer'):\n    print(x)", **HIDDEN),
            _cell("markdown", GOOD_QA.format(n=2) + "\n" + GOOD_QA.format(n=3))]


def _problems(tmp_path, nb, name="07_x.ipynb"):
    p = tmp_path / name
    p.write_text(json.dumps(nb))
    return structure_problems(p)


def test_checker_accepts_a_good_chapter(tmp_path):
    assert _problems(tmp_path, _nb(_good_cells())) == []


@pytest.mark.parametrize("breakage, expected", [
    ("no_kernelspec", "kernelspec"),
    ("outputs", "stored outputs"),
    ("no_id", "missing or malformed cell id"),
    ("same_id", "repeats cell"),
    ("title_number", "title"),
    ("section_after", "last '## ' section"),
    ("answer_outside", "exactly one <details>"),
    ("text_after_answer", "outside the answer"),
    ("no_blank_line", "blank line"),
    ("not_collapsed", "not collapsed"),
    ("no_marker", "without the marker"),
    ("marker_not_first", "must start with"),
    ("no_folded", "folded"),
    ("numbering", "numbered"),
    ("too_few", "at least 3"),
])
def test_checker_catches(tmp_path, breakage, expected):
    cells = _good_cells()
    ks = True
    if breakage == "no_kernelspec":
        ks = False
    elif breakage == "outputs":
        cells[2].update(outputs=[{"output_type": "stream", "name": "stdout", "text": "1\n"}], execution_count=1)
    elif breakage == "no_id":
        del cells[3]["id"]
    elif breakage == "same_id":
        cells[4]["id"] = cells[1]["id"]
    elif breakage == "title_number":
        cells[0]["source"] = "# Chapter 9 — A title"
    elif breakage == "section_after":
        cells.append(_cell("markdown", "## Further reading\n\nBooks."))
    elif breakage == "answer_outside":
        cells[5]["source"] = "**Q2.** What is question 2 about here?\n\nThe answer, in plain sight.\n\n" + GOOD_QA.format(n=3)
    elif breakage == "text_after_answer":
        cells[5]["source"] += "\nAnd the answer again, unfolded.\n"
    elif breakage == "no_blank_line":
        cells[5]["source"] = GOOD_QA.format(n=2).replace("</summary>\n\n", "</summary>\n") + GOOD_QA.format(n=3)
    elif breakage == "not_collapsed":
        cells[4]["metadata"] = {"jupyter": {"source_hidden": True}}
    elif breakage == "no_marker":
        cells[4]["source"] = "with folded('numbers'):\n    print(x)"
    elif breakage == "marker_not_first":
        cells[4]["source"] = "x = 2\n" + MARKER + "\nwith folded('numbers'):\n    print(x)"
    elif breakage == "no_folded":
        cells[4]["source"] = MARKER + "\nprint(x)"
    elif breakage == "numbering":
        cells[5]["source"] = GOOD_QA.format(n=3) + GOOD_QA.format(n=2)
    elif breakage == "too_few":
        cells[5]["source"] = GOOD_QA.format(n=2)
    problems = _problems(tmp_path, _nb(cells, kernelspec=ks))
    assert any(expected in p for p in problems), problems


def test_marker_outside_the_interview_section_must_be_collapsed(tmp_path):
    cells = _good_cells()
    cells.insert(2, _cell("code", MARKER + "\nwith folded('n'):\n    print(2)"))
    assert any("not collapsed" in p for p in _problems(tmp_path, _nb(cells)))


def test_stored_widget_state_and_execution_counts_fail(tmp_path):
    nb = _nb(_good_cells())
    nb["metadata"]["widgets"] = {"application/vnd.jupyter.widget-state+json": {"state": {}}}
    nb["cells"][2]["execution_count"] = 3
    problems = _problems(tmp_path, nb)
    assert any("widget state" in p for p in problems) and any("execution count" in p for p in problems), problems


# ---- drills: every teaching chapter (not the welcome, not the interview chapter) ----
DRILL = re.compile(r"\*\*Drill (\d+)\.\*\*")
TEACHING = [p for p in sorted(CHAPTERS.glob("[0-9][0-9]_*.ipynb")) if p.stem not in ("00_welcome", "14_interview")]


def drill_problems(cells) -> list[str]:
    """A '## Drills' section with Drill 1, 2, 3... in order, each followed by a code cell that checks the
    answer with ``drill(k, ...)`` and hides its source (the expected value is the answer)."""
    text = ["".join(c["source"]) if isinstance(c["source"], list) else c["source"] for c in cells]
    if not any(t.startswith("## Drills") for t in text):
        return ["no '## Drills' section"]
    problems, seen = [], []
    for i, (c, t) in enumerate(zip(cells, text)):
        for m in DRILL.finditer(t if c["cell_type"] == "markdown" else ""):
            k = int(m.group(1))
            seen.append(k)
            nxt = cells[i + 1] if i + 1 < len(cells) else None
            src = text[i + 1] if nxt else ""
            if nxt is None or nxt["cell_type"] != "code" or f"drill({k}," not in src:
                problems.append(f"Drill {k}: the next cell must check it with drill({k}, ...)")
            elif not nxt.get("metadata", {}).get("jupyter", {}).get("source_hidden"):
                problems.append(f"Drill {k}: its check cell must hide its source")
    if seen != list(range(1, len(seen) + 1)) or len(seen) < 3:
        problems.append(f"drills numbered {seen}: want 1, 2, 3, ... (at least three)")
    return problems


@pytest.mark.parametrize("path", TEACHING, ids=lambda p: p.stem)
def test_teaching_chapters_end_with_drills(path):
    problems = drill_problems(json.loads(path.read_text(encoding="utf-8"))["cells"])
    assert not problems, f"{path.name}: " + "; ".join(problems)


def test_drill_checker_catches_a_missing_check():
    md = lambda s: {"cell_type": "markdown", "source": s}                          # noqa: E731
    code = lambda s: {"cell_type": "code", "source": s, "metadata": {"jupyter": {"source_hidden": True}}}  # noqa: E731
    good = [md("## Drills"), md("**Drill 1.** a"), code("drill(1, 2, 'GB', 'w')"), md("**Drill 2.** b"),
            code("drill(2, 2, 'GB', 'w')"), md("**Drill 3.** c"), code("drill(3, 2, 'GB', 'w')")]
    assert drill_problems(good) == []
    assert drill_problems(good[:6]) and drill_problems(good[:5])                       # Drill 3 unchecked; two drills
    shown = good[:-1] + [{"cell_type": "code", "source": "drill(3, 2, 'GB', 'w')", "metadata": {}}]
    assert drill_problems(shown) and drill_problems([md("## Other")])
