"""Drills: numeric problems at cluster scale, checked against the package (chapters 1-13).

Each teaching chapter ends its text with a few "Drill k" problems — given a cluster and a model,
compute a number — whose answer the package computes. ``drill(k, expected, unit, working)`` shows a
field for the reader's number and a button; the check says "right" when the typed value is within
``TOLERANCE`` (10 %) of the package's, and otherwise shows the working. Outside a notebook kernel
(no ipywidgets) it prints the expected value and the working instead.
"""
from __future__ import annotations

TOLERANCE = 0.10


def check(typed, expected: float, tolerance: float = TOLERANCE) -> bool:
    """Is ``typed`` within ``tolerance`` (relative) of ``expected``? ``None`` or text is never right."""
    try:
        typed = float(typed)
    except (TypeError, ValueError):
        return False
    if expected == 0:
        return abs(typed) <= tolerance
    return abs(typed - expected) <= tolerance * abs(expected)


def verdict(typed, expected: float, unit: str, working: str) -> str:
    """The text the check shows for ``typed``."""
    if check(typed, expected):
        return f"right: {expected:,.4g} {unit} (yours is within {TOLERANCE:.0%})"
    return f"not yet: the package computes {expected:,.4g} {unit}. Working: {working}"


def drill(k: int, expected: float, unit: str, working: str):
    """The answer field of Drill ``k`` (a widget in a kernel; printed text elsewhere)."""
    try:
        import ipywidgets as w
        from IPython.display import display
    except ImportError:
        print(f"Drill {k}: {expected:,.4g} {unit}. Working: {working}")
        return None
    field = w.FloatText(description=f"Drill {k}:", layout=w.Layout(width="220px"))
    button = w.Button(description="check", layout=w.Layout(width="80px"))
    out = w.Output()

    def on_click(_):
        out.clear_output()
        with out:
            print(verdict(field.value, expected, unit, working))
    button.on_click(on_click)
    box = w.VBox([w.HBox([field, w.Label(unit), button]), out])
    display(box)
    return box
