"""Mutants of the lead's own fixes this round."""
from mutants import Mutant

MUTANTS = [
    Mutant("load-keeps-file-pages", "zerolab/engine/bigmodel/load.py",
           "        release_pages(opened)   # this unit's file pages leave the rank's resident set",
           "        pass",
           ("tests/test_load_mapped_pages.py::test_load_resident_peak_is_a_unit_or_two_of_file_pages",),
           "loading keeps every mapped page resident: a rank reading half of each tensor holds the whole file"),
]
