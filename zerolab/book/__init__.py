"""What the chapters call (chapters 0-14): ``show`` (the package's real source), widgets,
plots, the chapters' training runs, the book's models, the quantisation demo, timelines.

Files: ``listing`` (``show``, ``source``), ``widgets`` (ipywidgets + matplotlib), ``plots``, ``ring`` (the
ring all-reduce: simulation, grid, stepper widget), ``runs`` (the
runs chapters launch), ``models`` (TinyGPT, MLP), ``quant``. The book
layer may import everything below it (theory, config, runtime, engine).
"""
from zerolab.book.listing import show, source

__all__ = ["show", "source"]
