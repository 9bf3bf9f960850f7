"""Numbers in the chapters' prose come from cells (issue 15, point 1).

Chapters are committed without outputs, so a number a cell only *prints* is checked by
nothing: the next edit of the code can change it while the text keeps the old value.
This test reads every chapter statically and demands that each number in a markdown
cell is *written in a neighbouring code cell* — as an input the cell computes from
(``psi, n = 7.5e9, 64``) or as a value it asserts (``assert round(x, 2) == 2.91``) —
within ``WINDOW`` cells either side (the title cell, which previews the chapter, may
lean on any cell of the chapter). Rounding is respected: "2.9×" is covered by a
literal 2.91, "3.2×" is not.

What is *not* a number to check is listed below in ``SKIP`` and ``small_integer``,
each with the reason: notation (16Ψ, ZeRO-2, fp16, A100), references (chapter 3,
Table 1, Q4), citations by year, unit definitions (10⁹), list markers, and small
integers used as counts and byte widths. Code (fenced or inline) is not prose.

Chapters other helpers were editing when this test was written are marked
``xfail(strict=False)`` (``PENDING``): the lead switches them on after merging.
"""
from __future__ import annotations

import ast
import json
import math
import re
from pathlib import Path

import pytest

CHAPTERS = Path(__file__).resolve().parent.parent / "chapters"
WINDOW = 3               # code cells within this many cells of the markdown cell count as neighbours
PENDING = {               # chapter stem -> why it is not enforced yet (issue 15, point 1); empty: all enforced
}

NUMBER = re.compile(r"(?<![\w.,])(\d{1,3}(?:,\d{3})+|\d+)(\.\d+)?(e[-+]?\d+)?"
                    r"(?:\s?([kMBT])\b|(?=[^\w.]|\.(?!\d)|$)|(?=[×x%]))")
SCALE = {"k": 1e3, "M": 1e6, "B": 1e9, "T": 1e12}
UNIT = r"\s?(GB|MB|kB|TB|PB|GiB|MiB|ms|µs|s)\b"
REFERENCE = (r"(?i)\b(chapters?|ch\.|table|figure|section|seed|step|stage|exercise|issue|rank|unit|block|"
             r"bucket|layer|row|column|cell|part|point|Q|P)\s*(\d+\s*(,|–|-|and|or)\s*)*$")

YEAR_BEFORE = r"(\(|\bin |\bsince |\bof |, |al\. )$"     # a year only where a date is expected
# Text around a number that makes it notation or a reference, not a quantity:
# (regex the text before must end with, regex the text after must start with, why).
SKIP = [
    ("", r"\s*[Ψψ·]", "a coefficient in a formula (16Ψ, 2Ψ/N, 2·M): notation, derived in the text"),
    (r"[Ψψ·/]\s*$", "", "inside a formula (Ψ/N, 12Ψ/8): notation"),
    (REFERENCE, "", "a reference: chapter 3, chapters 4–6, Table 1, Q4, stage 2, seed 001"),
    (r"[A-Za-z_][-/]?$", "", "part of a name: ZeRO-1, fp16, bf16, A100, GPT-3, P_os, H800"),
    ("", r"-?(?!x\b)[A-Za-z_]", "glued to letters: 3D, 2nd, 16-bit, 4-byte (a ratio 3x is checked)"),
    ("", r"[⁰¹²³⁴⁵⁶⁷⁸⁹⁻]", "a power of ten written 10⁹, 10⁻³: a unit definition or an order of magnitude"),
    (r"^\s*$", r"\.\s", "an ordered-list marker (1. 2. 3.)"),
    (r"\w#$", "", "an issue or pull request cited as a source: NVIDIA/nccl#1031"),
    (r"(?i)\b(deepspeed|torch|pytorch|python|version|v)\s*$", "", "a software version: DeepSpeed 0.19"),
]


SOURCE_CLAIM = "a source article's claim quoted in order to check it against the arithmetic, not the book's number"

# Single numbers allowed where they stand: (chapter stem, the number as written, text on its line, why).
ALLOWED = [
    ("00_welcome", "7.5B", "7.5B means Ψ = 7.5 × 10⁹", "a definition: the example that explains the notation"),
    ("00_welcome", "7.5", "7.5B means Ψ = 7.5 × 10⁹", "a definition: the example that explains the notation"),
    ("02_collectives", "15", 'loses "about 15%" of', "a source's claim quoted in order to correct it, not the book's number"),
    ("02_collectives", "35", '"35%" over 200 Gb/s', "a source's claim quoted in order to correct it, not the book's number"),
    ("07_offload", "70", '"20% / 50% / 30–70% slower"', SOURCE_CLAIM),
    ("07_offload", "30", "mixed tiered offload **30–70%↓**", SOURCE_CLAIM),
    ("07_offload", "70", "mixed tiered offload **30–70%↓**", SOURCE_CLAIM),
    ("07_offload", "40", "about **40% slower**", SOURCE_CLAIM),
    ("07_offload", "40", '"48 GB → 12 GB, 40% slower" anecdote', SOURCE_CLAIM),
    ("07_offload", "4.0", "PCIe 4.0 x16", "a standard's version (PCIe 4.0), not a quantity"),
    ("11_context_experts", "2412.19437", "arXiv:2412.19437", "an arXiv identifier cited as a source"),
    ("11_context_experts", "2024", "(DeepSeek-AI 2024, sections", "a citation's year"),
    ("11_context_experts", "3.3", "sections 2.1.2 and 3.3", "section numbers of a cited report"),
    ("11_context_experts", "7B", "Mixtral 8×7B is", "a model's name (Mixtral 8×7B)"),
    ("11_context_experts", "47B", "47B parameters", "the figure the model is known by, quoted; the cell under the answer computes 46.7B total, 12.9B active"),
    ("11_context_experts", "47B", "the memory of a 47B one", "the figure the model is known by, quoted; the cell under the answer computes 46.7B total, 12.9B active"),
    ("11_context_experts", "13B", "as fast as a 13B dens", "the figure the model is known by, quoted; the cell under the answer computes 12.9B active"),
]


def allowed(stem: str, written: str, line: str) -> bool:
    return any(stem == c and written == w and text in line for c, w, text, _ in ALLOWED)


def small_integer(text: str) -> bool:
    """Integers 0-16 without ×/%/unit: counts and byte widths the text defines ('2 ranks', '4 bytes', K = 12)."""
    return bool(re.fullmatch(r"\d+", text)) and int(text) <= 16


def prose(markdown: str) -> str:
    """The markdown without code (fenced or inline), HTML tags and link targets."""
    text = re.sub(r"```.*?```", " ", markdown, flags=re.S)
    text = re.sub(r"`[^`]*`", " ", text)
    text = re.sub(r"<[^>]+>", " ", text)
    return re.sub(r"\]\([^)]*\)", "]", text)


def skipped(before: str, written: str, after: str) -> bool:
    """Whether the number is notation or a reference (``SKIP``), not a quantity to check."""
    if written.endswith("M") and re.match(r"\(", after):
        return True                                     # M as a variable in a formula: 36 M(N−1)/N
    if re.match(UNIT, after) or (written[-1] in SCALE and not re.match(r"\s*[Ψψ·]", after)):
        return False                                    # a size (120 GB, 7.5B): always a quantity
    if re.fullmatch(r"(19|20)\d\d", written) and re.search(YEAR_BEFORE, before):
        return True                                     # a citation's year: "et al. (2020)", "in 2024"
    return any(re.search(before_re, before) and re.match(after_re, after) for before_re, after_re, _ in SKIP)


def numbers_in(markdown: str):
    """``(as written, [(value, tolerance)...], line)`` for each number in the prose to check."""
    for line in prose(markdown).splitlines():
        for m in NUMBER.finditer(line):
            whole, frac, exp, suffix = m.group(1), m.group(2) or "", m.group(3) or "", m.group(4)
            written = m.group(0).strip()
            before, after = line[:m.start()], line[m.end():]
            if skipped(before, written, after):
                continue
            mantissa = whole.replace(",", "") + frac + exp
            if small_integer(mantissa) and not suffix and not re.match(r"\s?[×x%]|" + UNIT, after):
                continue
            value = float(mantissa)
            tol = 0.5 * 10 ** -(len(frac) - 1 if frac else 0) * (10 ** int(exp[1:]) if exp else 1)
            cands = [(value, tol)]
            if suffix:
                cands.append((value * SCALE[suffix], tol * SCALE[suffix]))
            if after.lstrip().startswith("%"):
                cands.append((value / 100, tol / 100))
            yield written, cands, line.strip()


def code_values(source: str) -> list[float]:
    """Every number a code cell writes: numeric literals, and numbers inside string literals."""
    try:
        tree = ast.parse(source)
    except SyntaxError:
        tree = None
    vals = []
    if tree is not None:
        for node in ast.walk(tree):
            if isinstance(node, ast.Constant) and isinstance(node.value, (int, float)) \
                    and not isinstance(node.value, bool):
                vals.append(float(node.value))
            elif isinstance(node, ast.Constant) and isinstance(node.value, str):
                vals += [float(x.replace(",", "")) for x in re.findall(r"\d[\d,]*\.?\d*(?:e[-+]?\d+)?", node.value)
                         if _is_float(x.replace(",", ""))]
    out = []
    for v in vals:
        out += [v, v / 1e3, v / 1e6, v / 1e9, v / 1e12, v * 100]
    return out


def _is_float(s):
    try:
        float(s)
        return True
    except ValueError:
        return False


def covered(cands, values) -> bool:
    return any(abs(c - v) <= tol + 1e-9 * abs(c) for c, tol in cands for v in values if math.isfinite(v))


def unchecked_numbers(path: Path) -> list[str]:
    """'cell i: <number> in "<line>"' for each prose number no neighbouring code cell writes."""
    cells = json.loads(path.read_text(encoding="utf-8"))["cells"]
    src = ["".join(c["source"]) if isinstance(c["source"], list) else c["source"] for c in cells]
    code = [i for i, c in enumerate(cells) if c["cell_type"] == "code"]
    problems = []
    for i, c in enumerate(cells):
        if c["cell_type"] != "markdown":
            continue
        near = code if i == 0 else [j for j in code if abs(j - i) <= WINDOW]
        values = [v for j in near for v in code_values(src[j])]
        for written, cands, line in numbers_in(src[i]):
            if not covered(cands, values) and not allowed(path.stem, written, line):
                problems.append(f"cell {i}: {written!r} in {line[:90]!r}")
    return problems


def chapter_params():
    out = []
    for p in sorted(CHAPTERS.glob("[0-9][0-9]_*.ipynb")):
        marks = [pytest.mark.xfail(strict=False, reason=PENDING[p.stem])] if p.stem in PENDING else []
        out.append(pytest.param(p, marks=marks, id=p.stem))
    return out


@pytest.mark.parametrize("path", chapter_params())
def test_prose_numbers_come_from_cells(path):
    problems = unchecked_numbers(path)
    assert not problems, (f"{path.name}: numbers in the text that no neighbouring code cell computes from or "
                          f"asserts (compute them in a cell, assert them next to the text, or allow-list them "
                          f"in tests/test_prose_numbers.py with a reason):\n  " + "\n  ".join(problems))


# ---- the scanner must catch what it claims to (a planted typed number fails) ----

def _nb(tmp_path, md, code, name="04_x.ipynb"):
    cells = [{"cell_type": "markdown", "metadata": {}, "source": "# Chapter 4 — T"},
             {"cell_type": "markdown", "metadata": {}, "source": md},
             {"cell_type": "code", "metadata": {}, "source": code, "outputs": [], "execution_count": None}]
    p = tmp_path / name
    p.write_text(json.dumps({"cells": cells}))
    return unchecked_numbers(p)


def test_a_typed_ratio_the_cell_does_not_assert_is_caught(tmp_path):
    code = "r = 16 / (4 + 12 / 8)\nprint(f'{r:.2f}x')"
    assert _nb(tmp_path, "ZeRO-1 saves 3.2× at N = 8.", code)                       # the ch4 Q6 bug
    assert not _nb(tmp_path, "ZeRO-1 saves 2.91× at N = 8.", code + "\nassert round(r, 2) == 2.91")


def test_rounding_and_scales(tmp_path):
    assert not _nb(tmp_path, "7.5B parameters on 64 GPUs need 120 GB.", "psi, n = 7.5e9, 64\nassert x == 120.0")
    assert not _nb(tmp_path, "about 2.9×", "assert round(r, 2) == 2.91")
    assert _nb(tmp_path, "about 3.0×", "assert round(r, 2) == 2.91")
    assert not _nb(tmp_path, "grows by 6%", "assert round(100 * g) == 6")
    assert _nb(tmp_path, "3,000 steps", "steps = 300")
    assert not _nb(tmp_path, "3,000 steps", "steps = 3_000")


def test_notation_and_references_are_not_numbers(tmp_path):
    md = ("16Ψ and 2Ψ + 14Ψ/N; chapter 3, Table 1 of Rajbhandari et al. (2020), chapters 4–6; ZeRO-2 in fp16 "
          "on A100s; GB means 10⁹ bytes; 2 ranks of 4 bytes; 16-bit; (Patarasuk & Yuan, 2009); Korthikanti "
          "et al. 2022; DeepSpeed 0.19; sends 36 M(N−1)/N\n1. first step")
    assert _nb(tmp_path, md, "pass") == []


def test_code_in_prose_is_not_prose(tmp_path):
    assert _nb(tmp_path, "set `reduce_bucket_size: 123456` and\n```\nx = 98765\n```", "pass") == []


def test_the_title_cell_may_use_any_cell(tmp_path):
    cells = [{"cell_type": "markdown", "metadata": {}, "source": "# Chapter 4 — T\n\n120 GB → 1.9 GB"}]
    cells += [{"cell_type": "markdown", "metadata": {}, "source": "text"}] * 6
    cells += [{"cell_type": "code", "metadata": {}, "source": "assert t == [120.0, 1.9]", "outputs": [],
               "execution_count": None}]
    p = tmp_path / "04_y.ipynb"
    p.write_text(json.dumps({"cells": cells}))
    assert unchecked_numbers(p) == []


# ---- what the executed cells print (checked while nbval runs the chapters: conftest.py) ----
# A claim a cell prints is the book's too: "equals its prediction: False" under prose that says it
# holds, or a negative duration in a time model, contradicts the text next to it.
CLAIM = re.compile(r"(?i)\b(equal|match|agree)\w*")
FALSE = re.compile(r"\bFalse\b")
NEGATIVE_TIME = re.compile(r"(?<![\w.])[-−]\s?\d+(?:[.,]\d+)*\s?(?:ms|µs|us|s)\b")
DIFFERENCE = re.compile(r"(?i)(Δ|delta|change|saved|diff)")


def output_problems(text: str) -> list[str]:
    """The lines of a cell's printed output that contradict themselves: ``False`` on a line that
    claims an equality / match / agreement, or a negative duration on a line that is not a difference."""
    problems = []
    for line in text.splitlines():
        if FALSE.search(line) and CLAIM.search(line):
            problems.append(f"a claim printed False: {line.strip()[:100]!r}")
        if NEGATIVE_TIME.search(line) and not DIFFERENCE.search(line):
            problems.append(f"a negative duration: {line.strip()[:100]!r}")
    return problems


def output_text(outputs) -> str:
    """The text a list of nbformat outputs shows: streams and text/plain results (errors aside)."""
    parts = []
    for o in outputs:
        if "text" in o:
            parts.append("".join(o["text"]) if isinstance(o["text"], list) else o["text"])
        elif "text/plain" in o.get("data", {}):
            t = o["data"]["text/plain"]
            parts.append("".join(t) if isinstance(t, list) else t)
    return "\n".join(parts)


def test_printed_false_claims_and_negative_times_are_caught():
    # the lines chapter 9 printed when its qgZ prediction and its time model were wrong
    assert output_problems("every measurement equals its prediction: False")
    assert output_problems("ZeRO-3     0.155s    0.129s      1.00x  -0.155s           -0.83")
    assert output_problems("compute −12.0 ms")
    assert output_problems("the curves agree: False") and output_problems("matches the formula: False")
    assert not output_problems("every measurement equals its prediction: True")
    assert not output_problems("link  overlap_comm  step\nraw loopback   False  68.9 ms   30.4 ms")
    assert not output_problems("Δ step -3.2 ms") and not output_problems("saved -0.5 s")
    assert not output_problems("gap -3.36%  update error 1.19e-01  loss -0.5")
    assert output_text([{"output_type": "stream", "text": ["a\n", "b"]},
                        {"output_type": "execute_result", "data": {"text/plain": "c"}}]) == "a\nb\nc"


# ---- words a reader cannot place: the articles are "the source articles", and no development history ----
ROOT = CHAPTERS.parent
SEED_WORD = re.compile(r"(?i)(?<!random )\bseeds?\b")            # "seed" is for random seeds only
HISTORY = re.compile(r"(?i)\b(before|since|after|until|in|see|per)\s+issue\s+#?\d+|\bissue\s+\d+\b"
                     r"|\b(this|the)\s+(chapter's|book's|engine's)\s+old\b|\bold\s+([\w-]+\s+)?model\b")


def reader_texts():
    """(where, text) for every piece of prose a reader meets: markdown cells (code removed), the docs
    and README, and the package's docstrings and comments (history only)."""
    for path in sorted([*CHAPTERS.glob("*.ipynb"), *(ROOT / "exercises").rglob("*.ipynb")]):
        for i, c in enumerate(json.loads(path.read_text(encoding="utf-8"))["cells"]):
            if c["cell_type"] == "markdown":
                yield f"{path.relative_to(ROOT)} cell {i}", prose("".join(c["source"])), True
    for path in sorted([*(ROOT / "docs").glob("*.md"), ROOT / "README.md"]):
        yield str(path.relative_to(ROOT)), prose(path.read_text(encoding="utf-8")), True
    for path in sorted((ROOT / "zerolab").rglob("*.py")):
        yield str(path.relative_to(ROOT)), path.read_text(encoding="utf-8"), False


def unplaceable_words(texts) -> list[str]:
    problems = []
    for where, text, is_prose in texts:
        for line in text.splitlines():
            if is_prose and SEED_WORD.search(line):
                problems.append(f"{where}: 'seed' for a source article: {line.strip()[:90]!r}")
            if HISTORY.search(line):
                problems.append(f"{where}: development history: {line.strip()[:90]!r}")
    return problems


def test_no_seed_articles_and_no_development_history():
    problems = unplaceable_words(reader_texts())
    assert not problems, ("say 'the source articles' (chapter 0 introduces them) and state what holds now, "
                          "citing upstream bugs by URL:\n  " + "\n  ".join(problems))


def test_the_word_scan_catches_what_it_claims():
    planted = [("x", "One seed says ZeRO-1 saves 4x. (Before issue 12, this engine built it whole.)", True),
               ("y", "One NIC per node was this chapter's old model.", True),
               ("z", "# the old single-link model charged the ring to one NIC", False)]
    assert len(unplaceable_words(planted)) == 4
    assert not unplaceable_words([("x", "Fix the random seed; the source articles say so.", True),
                                  ("y", "torch.manual_seed(seed)  # a seed per rank", False)])
