"""What gets graded (exercises): the pristine solution notebook with the learner's answers in it.

A graded run is built, never taken from the learner's file:

    pristine = exercises/solutions/NN_slug.ipynb   (checks + their expected outputs)
    graded   = pristine with each answer cell's source replaced by the learner's
               cell of the same answer name (tag ``answer``; by order as a fallback)

Everything else in the learner's notebook (their outputs, check cells they
edited, extra cells) is ignored, so stored outputs cannot pass a check.
``zerolab.grading.grader`` runs what this builds.
"""
from __future__ import annotations

import copy

from zerolab.grading import exercises as ex


def answers_of(nb) -> tuple[dict, list]:
    """The learner's answer cells: ({answer name: source}, [sources in order])."""
    named, ordered = {}, []
    for cell in nb.cells:
        if cell.cell_type == "code" and ex.ANSWER in ex.tags(cell):
            ordered.append(cell.source)
            name = ex.meta(cell).get("answer")
            if name:
                named[name] = cell.source
    return named, ordered


def build_graded(exercise: str, answers: dict | None = None, ordered: list | None = None,
                 notes: list | None = None):
    """The pristine notebook with answer cells taken from ``answers`` (name -> source);
    a missing name falls back to ``ordered`` (same count of answer cells), else the stub."""
    nb = copy.deepcopy(ex.read(ex.solution_path(exercise)))
    slots = [c for c in nb.cells if c.cell_type == "code" and ex.ANSWER in ex.tags(c)]
    answers = answers or {}
    by_order = ordered if ordered is not None and len(ordered) == len(slots) else None
    for i, cell in enumerate(slots):
        z = cell.metadata["zerolab"]
        name = z["answer"]
        if name in answers:
            cell.source = answers[name]
        elif by_order is not None:
            cell.source = by_order[i]
        else:
            cell.source = z["stub"]
            if notes is not None:
                notes.append(f"answer cell {name!r} not found in your notebook; graded with the empty stub")
        z.pop("stub", None)
        cell.outputs, cell.execution_count = [], None
    return nb


def graded_from_learner(path) -> tuple[str, object, list]:
    learner = ex.read(path)
    exercise = ex.exercise_of(learner, path)
    named, ordered = answers_of(learner)
    notes = []
    if not ordered:
        notes.append("no answer cells (tag 'answer') found; keep your code in the cells tagged 'answer'")
    return exercise, build_graded(exercise, named, ordered, notes), notes
