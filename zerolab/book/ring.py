"""The ring all-reduce, step by step (chapter 2): the algorithm's state, its picture, its widget.

``ring_sends(n, step)`` is one step of the ring: every rank sends one chunk (1/N of the
tensor) to its right neighbour, N−1 reduce-scatter steps then N−1 all-gather steps.
``ring_allreduce_states(n)`` replays the sends and records which ranks' contributions
each rank holds in each chunk after every step; ``ring_grid`` draws one such state as a
rank × chunk grid, and ``RingAllReduceStepper`` is the widget chapter 2 displays to walk
through them (built like ``widgets.MemoryExplorer``: ipywidgets controls, a matplotlib
figure shown as a PNG, the state kept as data so tests need no browser).
``figures_comm.ring_figure`` draws every state at once from the same simulation.
"""
from __future__ import annotations

import ipywidgets as W
from IPython.display import display

from zerolab.book import plots


def ring_sends(n: int, step: int) -> list[tuple[int, int, int]]:
    """``(src, dst, chunk)`` transfers of ring all-reduce step ``step`` (0-based).

    Steps 0..n-2 are the reduce-scatter (the receiver adds the chunk to its own),
    steps n-1..2n-3 the all-gather (the receiver stores the finished chunk).
    Every rank sends one chunk (1/n of the tensor) per step, to its right neighbour.
    """
    if not 0 <= step < 2 * (n - 1):
        raise ValueError(f"step must be in [0, {2 * (n - 1)}) for n = {n}, got {step}")
    if step < n - 1:
        return [(r, (r + 1) % n, (r - step) % n) for r in range(n)]
    s = step - (n - 1)
    return [(r, (r + 1) % n, (r + 1 - s) % n) for r in range(n)]


def ring_allreduce_states(n: int) -> list[list[list[frozenset]]]:
    """``states[k][r][c]``: ranks whose data rank ``r`` holds in chunk ``c`` after ``k`` steps.

    ``states[0]``: each rank holds only its own contribution; ``states[n-1]``: rank
    ``r`` holds the full sum of chunk ``(r+1) % n`` (reduce-scatter done);
    ``states[2n-2]``: every rank holds every summed chunk (all-reduce done).
    """
    if n < 1:
        raise ValueError(f"n must be >= 1, got {n}")
    state = [[frozenset([r]) for _ in range(n)] for r in range(n)]
    states = [state]
    for step in range(2 * (n - 1)):
        new = [row[:] for row in state]
        for src, dst, c in ring_sends(n, step):
            new[dst][c] = state[dst][c] | state[src][c] if step < n - 1 else state[src][c]
        state = new
        states.append(state)
    return states


def ring_grid(state, sends=(), ax=None, title=None):
    """Chunk-by-rank grid of a ring all-reduce (``ring_allreduce_states``).

    ``state[r][c]`` is the set of ranks whose contribution rank ``r`` holds in
    chunk ``c``; a cell is shaded by how complete it is. ``sends``: the
    ``(src, dst, chunk)`` transfers of the next step, drawn as arrows.
    """
    fig, ax = plots.new_axes(ax)
    n = len(state)
    for r in range(n):
        for c in range(n):
            k = len(state[r][c])
            ax.add_patch(_rect(c, r, k / n))
            text = "Σ" if k == n else "+".join(str(x) for x in sorted(state[r][c]))
            ax.text(c + 0.5, r + 0.5, text, ha="center", va="center",
                    fontsize=11 if k == n else 8, color="white" if k > n / 2 else "black")
    from matplotlib.patches import Rectangle
    for src, dst, chunk in sends:
        ax.add_patch(Rectangle((chunk + 0.06, src + 0.06), 0.88, 0.88, fill=False,
                               edgecolor="#C44E52", linewidth=2.5))      # the chunk being sent
        down = dst > src
        ax.annotate("", xy=(chunk + 0.5, dst + (0.2 if down else 0.8)),
                    xytext=(chunk + 0.5, src + (0.8 if down else 0.2)),
                    arrowprops=dict(arrowstyle="-|>", color="#C44E52", lw=2, mutation_scale=18,
                                    connectionstyle="arc3,rad=0.0" if down else "arc3,rad=0.45"))
    ax.set_xlim(0, n)
    ax.set_ylim(n, 0)
    ax.set_xticks([c + 0.5 for c in range(n)], [str(c) for c in range(n)])
    ax.set_yticks([r + 0.5 for r in range(n)], [f"rank {r}" for r in range(n)])
    ax.set_xlabel("chunk (each is 1/N of the tensor's bytes)")
    ax.set_ylabel("rank")
    ax.set_title(title or "Ring all-reduce")
    ax.set_aspect("equal")
    return ax


def _rect(x, y, frac):
    from matplotlib.patches import Rectangle
    from matplotlib import colormaps
    return Rectangle((x + 0.03, y + 0.03), 0.94, 0.94, color=colormaps["Blues"](0.15 + 0.8 * frac))


class RingAllReduceStepper:
    """Step through a ring all-reduce on N ranks: which chunk each rank holds and sends.

    Controls: ``.n`` (ranks), ``.step`` (steps done), and Next / Back buttons.
    ``.state`` is ``ring_allreduce_states(n)[step]``; ``.sends`` the next step's transfers.
    """

    def __init__(self, n=4, nbytes=1_000_000):
        self.nbytes = nbytes
        self.n = W.IntSlider(value=n, min=2, max=8, description="N (ranks)", continuous_update=False)
        self.step = W.IntSlider(value=0, min=0, max=2 * (n - 1), description="steps done",
                                continuous_update=False)
        self.step.add_class("zl-step")
        self.back = W.Button(description="◀ Back", layout=W.Layout(width="80px"))
        self.next = W.Button(description="Next ▶", layout=W.Layout(width="80px"))
        self.back.on_click(lambda _: setattr(self.step, "value", max(0, self.step.value - 1)))
        self.next.on_click(lambda _: setattr(self.step, "value",
                                              min(self.step.max, self.step.value + 1)))
        self.n.observe(self._on_n, "value")
        self.state, self.sends, self.figure, self.png, self.renders = None, [], None, None, 0
        self.output = W.interactive_output(self._draw, {"n": self.n, "step": self.step})
        self.widget = W.VBox([W.HBox([self.n, self.step, self.back, self.next]), self.output])

    def _ipython_display_(self):
        display(self.widget)

    def _on_n(self, change):
        # keep the step inside the new range before the redraw reads it
        self.step.value = min(self.step.value, 2 * (change["new"] - 1))
        self.step.max = 2 * (change["new"] - 1)

    def bytes_sent(self, n=None, step=None) -> int:
        """Bytes each rank has sent after ``step`` steps: one chunk (nbytes/n) per step."""
        n = self.n.value if n is None else n
        step = self.step.value if step is None else step
        return step * self.nbytes // n

    def _draw(self, n, step):
        step = min(step, 2 * (n - 1))
        self.state = ring_allreduce_states(n)[step]
        self.sends = ring_sends(n, step) if step < 2 * (n - 1) else []
        phase = ("reduce-scatter" if step < n - 1 else "all-gather" if step < 2 * (n - 1)
                 else "done")
        fig, ax = plots.new_axes(figsize=(6.5, 1.5 + 0.9 * n))
        title = (f"Ring all-reduce, N = {n}: {step} of {2 * (n - 1)} steps done"
                 f"\nnext: {phase}" if phase != "done" else
                 f"Ring all-reduce, N = {n}: all {2 * (n - 1)} steps done")
        ring_grid(self.state, self.sends, ax=ax, title=title)
        self.figure, self.png = fig, plots.figure_png(fig)
        self.renders += 1
        display(plots.image_bundle(self.png, plots.figure_alt(fig)), raw=True)
        sent = self.bytes_sent(n, step)
        print(f"Each rank has sent {step} chunk(s) = {sent:,} bytes; the whole all-reduce sends "
              f"2(N-1)/N x {self.nbytes:,} = {2 * (n - 1) * self.nbytes // n:,} bytes per rank.")
        if self.sends:
            print("Next step (red): " + ", ".join(f"rank {s}->{d} chunk {c}" for s, d, c in self.sends))

    def render(self):
        self._draw(self.n.value, self.step.value)
        return self.figure
