"""Mutants of the book's table helper (zerolab/book/tables.py): a chapter's table must keep its columns."""
from mutants import Mutant

TABLES = "tests/test_book_tables.py"

MUTANTS = [
    Mutant("table-bar-unescaped", "zerolab/book/tables.py",
           'return text.replace("|", "\\\\|").replace("\\n", " ")',
           'return text.replace("\\n", " ")',
           (TABLES,), "a '|' inside a value splits its cell: every later column shifts one to the right"),
    Mutant("table-short-row-kept", "zerolab/book/tables.py",
           "        if len(row) != len(header):\n",
           "        if len(row) > len(header):\n",
           (TABLES,), "a row with a value missing is drawn, its values under the wrong headers"),
]
