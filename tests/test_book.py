"""zerolab.book.listing: show() displays the package's real source."""
import inspect
import textwrap

import pytest

import zerolab
from zerolab.book import listing as book
from zerolab.runtime import measure
from zerolab.book import show, source


def test_source_is_the_real_source_with_its_location():
    text = source(measure.census)
    lines, start = inspect.getsourcelines(measure.census)
    header, body = text.split("\n", 1)
    assert header == f"# zerolab/runtime/measure.py, lines {start}-{start + len(lines) - 1}"
    assert body == "".join(lines)
    assert body.startswith("def census(")


def test_methods_are_dedented_and_located():
    text = source(measure.PeakMeter.__exit__)
    assert text.split("\n")[1].startswith("def __exit__(self")
    _, start = inspect.getsourcelines(measure.PeakMeter.__exit__)
    assert f"lines {start}-" in text and "zerolab/runtime/peak.py" in text
    bound = source(measure.Timer().__enter__)           # bound methods work too
    assert "def __enter__" in bound


def test_lines_by_range_and_by_block():
    lines, start = inspect.getsourcelines(measure.PeakMeter)
    part = source(measure.PeakMeter, lines=(2, 4))
    assert part.split("\n", 1)[1] == textwrap.dedent("".join(lines[1:4]))
    assert part.startswith(f"# zerolab/runtime/peak.py, lines {start + 1}-{start + 3}")
    block = source(measure.PeakMeter, lines="def __exit__")
    assert block.split("\n")[1] == "def __exit__(self, *exc) -> None:"
    assert "del self._prof" in block and "def __enter__" not in block and "def peak_memory" not in block
    sig = source(book, lines="def source(")          # a module, a multi-line block
    assert "def show" not in sig and "return f\"# {path}" in sig


def test_lines_by_a_region_between_two_texts():
    lines, start = inspect.getsourcelines(measure.PeakMeter)
    region = source(measure.PeakMeter, lines=("def __enter__", "def __exit__"))
    body = region.split("\n", 1)[1]
    first = next(i for i, line in enumerate(lines, 1) if "def __enter__" in line)
    last = next(i for i, line in enumerate(lines, 1) if "def __exit__" in line)
    assert first < last
    assert body == textwrap.dedent("".join(lines[first - 1:last]))
    assert region.startswith(f"# zerolab/runtime/peak.py, lines {start + first - 1}-{start + last - 1}")
    # the end is searched from the start on ("self" occurs above __exit__ too): one line
    one = source(measure.PeakMeter, lines=("def __exit__", "self"))
    assert one.split("\n")[1].startswith("def __exit__(self") and one.count("\n") == 2
    assert one.startswith(f"# zerolab/runtime/peak.py, line {start + last - 1}\n")   # one line: "line N"
    with pytest.raises(ValueError, match="'no such end' does not occur .* at or after line"):
        source(measure.PeakMeter, lines=("def __exit__", "no such end"))
    with pytest.raises(ValueError, match="does not occur"):
        source(measure.PeakMeter, lines=("no such start", "def __exit__"))


def test_bad_lines_are_rejected():
    with pytest.raises(ValueError, match="does not occur"):
        source(measure.census, lines="no such text")
    with pytest.raises(ValueError, match="outside"):
        source(measure.census, lines=(3, 10_000))
    with pytest.raises(TypeError):
        source(measure.census, lines=3)


def test_show_prints_outside_a_notebook(capsys):
    show(measure.rss)
    out = capsys.readouterr().out
    assert out == source(measure.rss) and "def rss()" in out


def test_show_displays_highlighted_code_in_a_kernel(monkeypatch):
    IPython = pytest.importorskip("IPython")
    import IPython.display
    shown = []
    monkeypatch.setattr(IPython, "get_ipython", lambda: object())
    monkeypatch.setattr(IPython.display, "display", shown.append)
    show(measure.rss)
    (code,) = shown
    assert isinstance(code, IPython.display.Code)
    html = code._repr_html_()
    assert "rss" in html and "<span" in html          # pygments markup


def test_public_name():
    assert zerolab.show is show
