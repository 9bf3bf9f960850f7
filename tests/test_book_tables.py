"""The chapters' tables render as Markdown tables (zerolab.book.tables): one row per line, every row as
many cells as the header, a '|' inside a value escaped, a wrong row refused by number."""
import pytest

from zerolab.book.tables import markdown_table, show_table


def test_a_table_has_a_header_a_rule_and_one_line_per_row():
    text = markdown_table(["stage", "GB"], [("ZeRO-1", "1.5"), ("ZeRO-2", "0.75")])
    lines = text.splitlines()
    assert lines == ["| stage | GB |", "|:---|---:|", "| ZeRO-1 | 1.5 |", "| ZeRO-2 | 0.75 |"]


def test_values_with_a_bar_or_a_newline_stay_in_their_cell():
    text = markdown_table(["a", "b"], [("x|y", "1\n2")])
    assert text.splitlines()[2] == "| x\\|y | 1 2 |"
    assert all(line.count("|") - line.count("\\|") == 3 for line in text.splitlines())


def test_a_short_row_or_a_bad_alignment_is_refused_by_name():
    with pytest.raises(ValueError, match="row 1 has 1 values for 2 columns"):
        markdown_table(["a", "b"], [(1, 2), (3,)])
    with pytest.raises(ValueError, match="align"):
        markdown_table(["a", "b"], [(1, 2)], align="lx")


def test_show_table_prints_outside_a_notebook(capsys):
    text = show_table(["a"], [(1,)], caption="one")
    assert text.startswith("**one**") and "| 1 |" in capsys.readouterr().out
