"""Tables a chapter shows as tables (chapters 12-14): rows of numbers rendered as a Markdown table,
so JupyterLab draws a grid with aligned columns instead of a wide block of printed text that
wraps (a "flattened" table) in a narrow window.

``markdown_table(header, rows)`` is the text; ``show_table(header, rows)`` displays it in a
notebook (``IPython.display.Markdown``) and prints it where no notebook front end is there to
render it, so a script or a test still reads every number.
"""
from __future__ import annotations


def _cell(value) -> str:
    text = str(value)
    return text.replace("|", "\\|").replace("\n", " ")


def markdown_table(header, rows, align=None) -> str:
    """``header``: the column names; ``rows``: sequences of the same length (values already formatted
    as the reader should see them, or anything ``str`` makes readable). ``align``: one of "l", "r"
    per column (default: the first column left, the others right). A row of the wrong length is an
    error naming the row, never a shifted table."""
    header = [_cell(h) for h in header]
    if not header:
        raise ValueError("markdown_table: the header names no column")
    align = align or ("l" + "r" * (len(header) - 1))
    if len(align) != len(header) or set(align) - {"l", "r", "c"}:
        raise ValueError(f"markdown_table: align must give 'l', 'r' or 'c' for each of the {len(header)} "
                         f"columns, got {align!r}")
    marks = {"l": ":---", "r": "---:", "c": ":---:"}
    lines = ["| " + " | ".join(header) + " |", "|" + "|".join(marks[a] for a in align) + "|"]
    for i, row in enumerate(rows):
        row = list(row)
        if len(row) != len(header):
            raise ValueError(f"markdown_table: row {i} has {len(row)} values for {len(header)} columns: {row!r}")
        lines.append("| " + " | ".join(_cell(v) for v in row) + " |")
    return "\n".join(lines)


def show_table(header, rows, align=None, caption: str | None = None) -> str:
    """Display the table (with an optional bold caption above it) in a notebook; print it otherwise.
    Returns the Markdown text."""
    text = markdown_table(header, rows, align)
    if caption:
        text = f"**{_cell(caption)}**\n\n" + text
    try:
        from IPython import get_ipython
        from IPython.display import Markdown, display
        if get_ipython() is not None:
            display(Markdown(text))
            return text
    except ImportError:
        pass
    print(text)
    return text
