"""Interactive widgets of the book: the Memory Explorer (chapter 1, in ``explorer.py``, its numbers
in ``explorer_model.py``; exported here), and ``folded``, which every chapter's interview answers
print through.

The widgets are plain ipywidgets controls (``explorer.psi``, ``explorer.tp`` ...); every change
redraws a matplotlib figure that is shown as a PNG image. The state is also kept as data
(``explorer.data``) and the last figure as ``.figure`` / ``.png``, so tests can set
``widget.value`` and check what changed without a browser. Pyplot is never used, so
nothing leaks out of the output area. Chapter 2's ring all-reduce stepper is built the
same way, beside the ring's simulation, in ``zerolab.book.ring``.
"""
from __future__ import annotations

import contextlib
import html
import io

from IPython.display import display

from zerolab.book.explorer import (GPUS_GB, N_CHOICES, NODE_CHOICES, PRESETS, STAGES, MemoryExplorer,  # noqa: F401
                                   format_params, node_of)

# -- interview answers ---------------------------------------------------------

@contextlib.contextmanager
def folded(summary="numbers"):
    """Show what the block prints folded under ``summary`` (a ``<details>`` element).

    Chapters compute the numbers of interview answers with it, so running the
    notebook does not print the answer under the question:
    ``with folded("numbers for Q2"): print(...)``.
    """
    buf = io.StringIO()
    with contextlib.redirect_stdout(buf):
        yield
    text = buf.getvalue()
    display({"text/plain": f"{summary}:\n{text}",
             "text/html": f"<details><summary>{html.escape(summary)}</summary>"
                          f"<pre>{html.escape(text)}</pre></details>"}, raw=True)
