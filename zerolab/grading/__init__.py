"""Exercise grading (``python -m zerolab grade``; the exercises follow chapters 1-7).

Files: ``answers`` (the learner's answers into the pristine notebook), ``grader`` (nbval, the report),
``nbval_report`` (the pytest plugin behind it), ``exercises`` (reading,
copying and resetting exercise notebooks), ``harness`` and ``harness_engine``
(what the check cells call: the learner's function plugged into the real package).
"""
from zerolab.grading.answers import answers_of, build_graded, graded_from_learner
from zerolab.grading.grader import CellResult, Report, grade, grade_variants

__all__ = ["CellResult", "Report", "answers_of", "build_graded", "grade", "grade_variants", "graded_from_learner"]
