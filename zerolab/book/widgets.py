"""Interactive widgets of the book: the Memory Explorer (chapter 1), and ``folded``, which
every chapter's interview answers print through.

The explorer is built with ``ipywidgets.interactive_output``: the controls are plain
widgets (``explorer.psi``, ``explorer.n_gpus`` ...), and every change redraws a
matplotlib figure that is shown as a PNG image. The state is also kept as data
(``explorer.data``) and the last figure as ``.figure`` / ``.png``, so tests can set
``widget.value`` and check what changed without a browser. Pyplot is never used, so
nothing leaks out of the output area. Chapter 2's ring all-reduce stepper is built the
same way, beside the ring's simulation, in ``zerolab.book.ring``.
"""
from __future__ import annotations

import contextlib
import html
import io

import ipywidgets as W
from IPython.display import display

from zerolab.book import plots

PRESETS = {"7.5B": 7.5e9, "13B": 13e9, "70B": 70e9, "175B": 175e9}
GPUS_GB = (24, 40, 80, 141)      # RTX 4090; A100 40GB; A100 80GB or H100; H200
N_CHOICES = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024)
STAGES = (0, 1, 2, 3)
# node kind -> (label, zerolab.theory.nodes preset, NICs per node or None for the preset's); chapter 2
NODE_CHOICES = {"dgx-a100": ("DGX A100, 8 x 200 Gb/s NICs", "dgx-a100", None),
                "dgx-a100-1nic": ("DGX A100 with 1 x 200 Gb/s NIC", "dgx-a100", 1),
                "dgx-h100": ("DGX H100, 8 x 400 Gb/s NICs", "dgx-h100", None),
                "cloud-100gbe": ("8 x A100, 1 x 100 GbE NIC", "cloud-100gbe", None)}
_WIDE = {"description_width": "initial"}


def format_params(psi: float) -> str:
    """7.5e9 -> '7.5B', 1e12 -> '1T': parameter counts as the book writes them."""
    for scale, unit in ((1e12, "T"), (1e9, "B"), (1e6, "M")):
        if psi >= scale:
            return f"{psi / scale:.3g}{unit}"
    return f"{psi:.0f}"


# -- chapter 1: the Memory Explorer ------------------------------------------

class MemoryExplorer:
    """Sliders over Ψ, N, precision, optimizer, offload and activations; one
    stacked bar per stage (bytes per GPU) and the bytes each GPU sends per step.

    ``MemoryExplorer().widget`` is what the notebook displays; ``.data`` holds the
    numbers the last figure drew, ``.figure`` the figure, ``.png`` its image.
    """

    def __init__(self, psi=7.5e9, n_gpus=64, precision="mixed", optimizer="adam",
                 gpu_gb=80, layers=32, hidden=4096, heads=32, seq_len=2048, micro_batch=1,
                 checkpointing=False, node="dgx-a100"):
        from zerolab import theory
        self._theory = theory
        self.psi = W.FloatLogSlider(value=psi, base=10, min=8, max=12, step=0.01,
                                    description="Ψ (parameters)", readout_format=".3g",
                                    continuous_update=False, style=_WIDE,
                                    layout=W.Layout(width="420px"))
        self.psi.add_class("zl-psi")
        self.presets = [W.Button(description=k, layout=W.Layout(width="64px")) for k in PRESETS]
        for b in self.presets:
            b.on_click(lambda btn: setattr(self.psi, "value", PRESETS[btn.description]))
        self.n_gpus = W.SelectionSlider(options=N_CHOICES, value=n_gpus, description="N (GPUs)",
                                        continuous_update=False, style=_WIDE)
        self.n_gpus.add_class("zl-n")
        self.precision = W.Dropdown(options=["fp32", "mixed", "mixed_fp32_grads"], value=precision,
                                    description="precision", style=_WIDE)
        self.optimizer = W.Dropdown(options=_optimizer_options(theory), value=optimizer,
                                    description="optimizer", style=_WIDE)
        self.offload_optimizer = W.Dropdown(options=["none", "cpu", "nvme"], value="none",
                                            description="offload_optimizer", style=_WIDE)
        self.offload_param = W.Dropdown(options=["none", "cpu", "nvme"], value="none",
                                        description="offload_param (ZeRO-3)", style=_WIDE)
        self.gpu_gb = W.Dropdown(options=[(f"{g} GB", g) for g in GPUS_GB], value=gpu_gb,
                                 description="GPU memory", style=_WIDE)
        self.layers = W.IntSlider(value=layers, min=1, max=128, description="layers",
                                  continuous_update=False)
        self.hidden = W.IntSlider(value=hidden, min=256, max=16384, step=256, description="hidden",
                                  continuous_update=False)
        self.heads = W.IntSlider(value=heads, min=1, max=128, description="heads",
                                 continuous_update=False)
        self.seq_len = W.IntSlider(value=seq_len, min=128, max=32768, step=128, description="seq len",
                                   continuous_update=False)
        self.micro_batch = W.IntSlider(value=micro_batch, min=1, max=64, description="micro-batch",
                                       continuous_update=False)
        self.checkpointing = W.Checkbox(value=checkpointing, description="activation checkpointing")
        self.node = W.Dropdown(options=[(label, name) for name, (label, *_) in NODE_CHOICES.items()],
                               value=node, description="nodes (8 GPUs each)", style=_WIDE)
        self.grad_accum = W.IntSlider(value=1, min=1, max=16, description="micro-batches per step (g)",
                                      continuous_update=False, style=_WIDE)
        self.controls = dict(psi=self.psi, n_gpus=self.n_gpus, precision=self.precision,
                             optimizer=self.optimizer, offload_optimizer=self.offload_optimizer,
                             offload_param=self.offload_param, gpu_gb=self.gpu_gb,
                             layers=self.layers, hidden=self.hidden, heads=self.heads,
                             seq_len=self.seq_len, micro_batch=self.micro_batch,
                             checkpointing=self.checkpointing, node=self.node,
                             grad_accum=self.grad_accum)
        self.data, self.figure, self.png, self.renders = None, None, None, 0
        self.output = W.interactive_output(self._draw, self.controls)
        acts = W.VBox([W.HBox([self.layers, self.hidden, self.heads]),
                       W.HBox([self.seq_len, self.micro_batch, self.checkpointing])])
        comm = W.HBox([self.node, self.grad_accum])
        acc = W.Accordion(children=[acts, comm],
                          titles=("activations (GPT-like model)", "communication (chapter 2)"))
        self.widget = W.VBox([
            W.HBox([self.psi, W.Label("presets:"), *self.presets]),
            W.HBox([self.n_gpus, self.precision, self.optimizer]),
            W.HBox([self.offload_optimizer, self.offload_param, self.gpu_gb]),
            acc, self.output])

    def _ipython_display_(self):
        display(self.widget)

    def compute(self, psi, n_gpus, precision, optimizer, offload_optimizer, offload_param,
                layers, hidden, heads, seq_len, micro_batch, checkpointing,
                node="dgx-a100", grad_accum=1, **_):
        """Bytes per GPU for every stage, from ``zl.estimate`` / ``zl.activation_memory``."""
        th = self._theory
        psi = int(round(psi))
        act = th.activation_memory(layers, hidden, heads, seq_len, micro_batch,
                                   checkpointing=checkpointing,
                                   dtype_bytes=4 if precision == "fp32" else 2)
        data = {k: [] for k in ("params", "grads", "optimizer", "activations", "total",
                                "host", "nvme", "comm", "comm_seconds")}
        for stage in STAGES:
            est = th.estimate(psi, n_gpus, stage, precision=precision, optimizer=optimizer,
                              offload_optimizer=offload_optimizer if stage >= 1 else "none",
                              offload_param=offload_param if stage == 3 else "none")
            for k in ("params", "grads", "optimizer", "host", "nvme"):
                data[k].append(getattr(est, k))
            data["activations"].append(act)
            data["total"].append(est.total + act)
            comm = dict(dtype_bytes=4 if precision == "fp32" else 2, grad_accum=grad_accum)
            data["comm"].append(th.comm_volume(psi, n_gpus, stage, **comm))
            data["comm_seconds"].append(th.step_comm_time(psi, n_gpus, stage, node=node_of(node), **comm))
        return data

    def _draw(self, gpu_gb, **settings):
        self.data = data = self.compute(**settings)
        fig, (ax_mem, ax_comm) = plots.new_axes(figsize=(10, 4.2), ncols=2)
        fig.get_layout_engine().set(w_pad=0.1)
        p = settings
        plots.stage_memory_bars(data, capacity_gb=gpu_gb, ax=ax_mem,
                                title=f"Ψ = {format_params(p['psi'])}, N = {p['n_gpus']}, "
                                      f"{p['precision']}, {p['optimizer']}")
        xs = range(len(STAGES))
        comm_gb = [c / plots.GB for c in data["comm"]]
        ax_comm.bar(xs, comm_gb, color="#8172B3", width=0.6)
        for x, gb, sec in zip(xs, comm_gb, data["comm_seconds"]):
            ax_comm.text(x, gb, f"{plots.gb_label(gb)}\n{sec:.3g} s", ha="center", va="bottom", fontsize=8)
        ax_comm.set_ylim(0, 1.2 * max(comm_gb) if max(comm_gb) > 0 else 1)
        ax_comm.set_xticks(list(xs), list(plots.STAGE_NAMES))
        ax_comm.set_xlabel("data-parallel strategy")
        ax_comm.set_ylabel("bytes sent per GPU per step (GB = 1e9 bytes)")
        g = p["grad_accum"]
        ax_comm.set_title(f"Sent per step{f' (g = {g})' if g > 1 else ''} (algorithm bytes);\n"
                          f"time on {NODE_CHOICES[p['node']][0]}", fontsize=10)
        self.figure, self.png = fig, plots.figure_png(fig)
        self.renders += 1
        fits = ", ".join(f"{name} {'fits' if t <= gpu_gb * plots.GB else 'does not fit'}"
                         for name, t in zip(plots.STAGE_NAMES, data["total"]))
        display(plots.image_bundle(self.png, plots.figure_alt(fig)), raw=True)
        print(f"Ψ = {format_params(p['psi'])} parameters, N = {p['n_gpus']}. "
              f"With {gpu_gb} GB per GPU: {fits}.")

    def render(self):
        """Redraw with the current control values; returns the figure."""
        self._draw(**{k: w.value for k, w in self.controls.items()})
        return self.figure


def node_of(choice: str):
    """The ``zerolab.theory.Node`` a ``NODE_CHOICES`` key stands for."""
    from zerolab.theory.nodes import NODES
    _, preset, nics = NODE_CHOICES[choice]
    return NODES[preset] if nics is None else NODES[preset].with_nics(nics)


def _optimizer_options(theory):
    names = getattr(theory, "OPTIMIZERS", None)
    return list(names) if names else ["adam", "adamw", "sgd"]


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
