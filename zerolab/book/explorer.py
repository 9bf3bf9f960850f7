"""Chapter 1's Memory Explorer: every axis of a training configuration, what one GPU holds, and
whether it fits.

The Hugging Face Ultra-Scale Playbook's memory widget has data, tensor and pipeline parallelism,
recomputation and the model's shape; this one adds context and expert parallelism (``cp``, ``ep``),
the ZeRO stage, offload tiers, ZeRO++'s hpZ, the logits, model presets with cited shapes, a
verdict against a GPU that names the binding term, and a "measure it" button that trains a
configuration small enough for this laptop and draws what it measured beside the prediction.

Controls are plain ipywidgets attributes (``explorer.tp``, ``.pp``, ``.cp``, ``.ep``, ``.stage``,
``.recompute``, ``.preset``, ``.fp8`` (FP8 weights: ``theory.fp8``), ...): setting ``widget.value`` redraws, so tests need no browser.
``.data`` holds the numbers the last figure drew, ``.verdict`` the sentence, ``.figure``/``.png``
the figure. The numbers are ``explorer_model``'s (``zerolab.theory``'s formulas).
"""
from __future__ import annotations

import ipywidgets as W
from IPython.display import display

from zerolab.book import plots
from zerolab.book.explorer_model import (BUTTONS, MODEL_PRESETS, NODE_CHOICES, STAGES, compute, measure,
                                         measure_refusal, node_of, verdict)
from zerolab.theory.hardware import GPUS

__all__ = ["MemoryExplorer", "PRESETS", "GPUS_GB", "N_CHOICES", "STAGES", "NODE_CHOICES", "format_params",
           "node_of"]

PRESETS = {k: MODEL_PRESETS[v].psi for k, v in BUTTONS.items()}   # the quick buttons' Ψ
GPUS_GB = (24, 40, 80, 141, 180)     # RTX 4090; A100 40GB; A100 80GB or H100; H200; B200
N_CHOICES = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384)
DEGREES = (1, 2, 4, 8, 16, 32, 64)
_WIDE = {"description_width": "initial"}


def format_params(psi: float) -> str:
    """7.5e9 -> '7.5B', 1e12 -> '1T': parameter counts as the book writes them."""
    for scale, unit in ((1e12, "T"), (1e9, "B"), (1e6, "M")):
        if psi >= scale:
            return f"{psi / scale:.3g}{unit}"
    return f"{psi:.0f}"


def _slider(value, lo, hi, name, step=1):
    return W.IntSlider(value=value, min=lo, max=hi, step=step, description=name, continuous_update=False)


class MemoryExplorer:
    """Bytes per GPU at each ZeRO stage for a model on a dp x tp x pp x cp (x ep) mesh, against a GPU.

    ``MemoryExplorer().widget`` is what the notebook displays. ``render()`` redraws; ``measure()``
    runs the laptop measurement or returns the named reason it cannot.
    """

    def __init__(self, psi=7.5e9, n_gpus=64, precision="mixed", optimizer="adam", gpu_gb=80, layers=32,
                 hidden=4096, heads=32, seq_len=2048, micro_batch=1, checkpointing=False, node="dgx-a100",
                 *, preset=None, stage=3, tp=1, pp=1, cp=1, ep=1, sp=False, recompute=None,
                 flash_attention=False, vocab=0, expert_params=0, hpz=1, gpu="A100", fp8=False):
        recompute = recompute or ("full" if checkpointing else "none")
        self.preset = W.Dropdown(options=["(custom)", *MODEL_PRESETS], value="(custom)", description="model",
                                 style=_WIDE)
        self.psi = W.FloatLogSlider(value=psi, base=10, min=6, max=12.5, step=0.01, description="Ψ (parameters)",
                                    readout_format=".3g", continuous_update=False, style=_WIDE,
                                    layout=W.Layout(width="420px"))
        self.psi.add_class("zl-psi")
        self.presets = [W.Button(description=k, layout=W.Layout(width="64px")) for k in BUTTONS]
        for b in self.presets:
            b.on_click(lambda btn: setattr(self.preset, "value", BUTTONS[btn.description]))
        self.n_gpus = W.SelectionSlider(options=N_CHOICES, value=n_gpus, description="N (GPUs)",
                                        continuous_update=False, style=_WIDE)
        self.n_gpus.add_class("zl-n")
        self.tp, self.pp, self.cp, self.ep = (W.Dropdown(options=DEGREES, value=v, description=k,
                                                         layout=W.Layout(width="130px"))
                                              for k, v in (("tp", tp), ("pp", pp), ("cp", cp), ("ep", ep)))
        self.stage = W.Dropdown(options=[(f"ZeRO-{s}" if s else "DDP (0)", s) for s in STAGES], value=stage,
                                description="stage (verdict)", style=_WIDE)
        self.precision = W.Dropdown(options=["fp32", "mixed", "mixed_fp32_grads"], value=precision,
                                    description="precision", style=_WIDE)
        self.fp8 = W.Checkbox(value=fp8, description="FP8 weights (1 byte)", style=_WIDE)
        from zerolab.theory import OPTIMIZERS
        self.optimizer = W.Dropdown(options=list(OPTIMIZERS), value=optimizer, description="optimizer", style=_WIDE)
        self.offload_optimizer = W.Dropdown(options=["none", "cpu", "nvme"], value="none",
                                            description="offload_optimizer", style=_WIDE)
        self.offload_param = W.Dropdown(options=["none", "cpu", "nvme"], value="none",
                                        description="offload_param (ZeRO-3)", style=_WIDE)
        self.hpz = W.Dropdown(options=(1, 2, 4, 8, 16), value=hpz, description="hpZ partition (ZeRO++)",
                              style=_WIDE)
        self.gpu = W.Dropdown(options=[(g.name, k) for k, g in GPUS.items()], value=gpu, description="GPU",
                              style=_WIDE)
        self.gpu_gb = W.Dropdown(options=[(f"{g} GB", g) for g in GPUS_GB], value=gpu_gb,
                                 description="GPU memory", style=_WIDE)
        self.gpu.observe(lambda c: setattr(self.gpu_gb, "value", int(GPUS[c["new"]].memory / 1e9)), "value")
        self.layers = _slider(layers, 1, 160, "layers")
        self.hidden = _slider(hidden, 64, 32768, "hidden", 64)
        self.heads = _slider(heads, 1, 256, "heads")
        self.seq_len = _slider(seq_len, 16, 131072, "seq len", 16)
        self.micro_batch = _slider(micro_batch, 1, 64, "micro-batch")
        self.recompute = W.Dropdown(options=["none", "selective", "full"], value=recompute,
                                    description="recompute", style=_WIDE)
        self.checkpointing = W.Checkbox(value=recompute == "full", description="activation checkpointing")
        self.checkpointing.observe(lambda c: setattr(self.recompute, "value", "full" if c["new"] else "none"),
                                   "value")   # the older control: an alias of recompute="full"
        self.sp = W.Checkbox(value=sp, description="sequence parallel (with tp)")
        self.flash_attention = W.Checkbox(value=flash_attention, description="FlashAttention")
        self.vocab = W.BoundedIntText(value=vocab, min=0, max=1_000_000, description="vocabulary (0: no logits)",
                                      style=_WIDE)
        self.expert_params = W.FloatText(value=expert_params, description="of Ψ, expert parameters", style=_WIDE)
        self.node = W.Dropdown(options=[(label, name) for name, (label, *_) in NODE_CHOICES.items()],
                               value=node, description="nodes (8 GPUs each)", style=_WIDE)
        self.grad_accum = _slider(1, 1, 16, "micro-batches per step (g)")
        self.grad_accum.style = _WIDE
        self.controls = dict(psi=self.psi, n_gpus=self.n_gpus, tp=self.tp, pp=self.pp, cp=self.cp, ep=self.ep,
                             stage=self.stage, precision=self.precision, optimizer=self.optimizer,
                             offload_optimizer=self.offload_optimizer, offload_param=self.offload_param,
                             hpz=self.hpz, gpu_gb=self.gpu_gb, layers=self.layers, hidden=self.hidden,
                             heads=self.heads, seq_len=self.seq_len, micro_batch=self.micro_batch,
                             recompute=self.recompute, sp=self.sp, flash_attention=self.flash_attention,
                             vocab=self.vocab, expert_params=self.expert_params, node=self.node,
                             grad_accum=self.grad_accum, fp8=self.fp8)
        self.data, self.figure, self.png, self.renders = None, None, None, 0
        self.verdict, self.binding, self.measured = "", None, None
        self._hold = False
        self.output, self.measure_output = W.Output(), W.Output()
        self.verdict_box, self.measure_status = W.HTML(), W.HTML()
        self.measure_button = W.Button(description="measure it", button_style="info")
        self.measure_button.on_click(lambda _b: self.measure())
        self.preset.observe(lambda c: self.load(c["new"]), "value")
        for w in self.controls.values():
            w.observe(lambda _c: None if self._hold else self.render(), "value")
        self.widget = self._layout()
        if preset:
            self.preset.value = preset
        else:
            self.render()

    @property
    def dp(self) -> int:
        """Data-parallel degree: N / (tp·pp·cp) (ep is carved out of it)."""
        return self.n_gpus.value // (self.tp.value * self.pp.value * self.cp.value)

    def _layout(self):
        acts = W.VBox([W.HBox([self.layers, self.hidden, self.heads]),
                       W.HBox([self.seq_len, self.micro_batch, self.recompute]),
                       W.HBox([self.sp, self.flash_attention, self.vocab, self.expert_params])])
        acc = W.Accordion(children=[acts, W.HBox([self.node, self.grad_accum])],
                          titles=("model shape and activations", "communication (chapter 2)"))
        return W.VBox([W.HBox([self.preset, W.Label("Ψ:"), *self.presets]), self.psi,
                       W.HBox([self.n_gpus, self.tp, self.pp, self.cp, self.ep]),
                       W.HBox([self.stage, self.precision, self.fp8, self.optimizer]),
                       W.HBox([self.offload_optimizer, self.offload_param, self.hpz]),
                       W.HBox([self.gpu, self.gpu_gb]), acc, self.verdict_box, self.output,
                       W.HBox([self.measure_button, self.measure_status]), self.measure_output])

    def _ipython_display_(self):
        display(self.widget)

    def load(self, name):
        """Set Ψ, the shape, the vocabulary and the expert parameters from ``MODEL_PRESETS[name]``."""
        if name not in MODEL_PRESETS:
            return
        p = MODEL_PRESETS[name]
        self._hold = True
        try:
            for key in ("psi", "layers", "hidden", "heads", "seq_len", "vocab", "expert_params"):
                getattr(self, key).value = getattr(p, key)
        finally:
            self._hold = False
        self.render()

    def settings(self) -> dict:
        return {k: w.value for k, w in self.controls.items()}

    def render(self):
        """Recompute and redraw with the current control values; returns the figure (None on a bad mesh)."""
        s = self.settings()
        with self.output:
            self.output.clear_output(wait=True)
            try:
                self.data = compute(**s)
            except ValueError as err:          # a mesh N does not divide, ep without experts ...
                self.data, self.binding = {"error": str(err)}, None
                self.verdict = f"cannot compute this configuration: {err}"
                self.verdict_box.value = f"<b>{self.verdict}</b>"
                print(self.verdict)
                return None
            self._draw(s)
        return self.figure

    def _gpu_name(self, gpu_gb):
        g = GPUS[self.gpu.value]
        return g.name if round(g.memory / 1e9) == gpu_gb else f"a {gpu_gb} GB GPU"

    def _draw(self, p):
        data, gpu_gb = self.data, p["gpu_gb"]
        self.binding, self.verdict = verdict(data, p["stage"], gpu_gb * 1e9, self._gpu_name(gpu_gb))
        self.verdict_box.value = f"<b>{self.verdict}</b>"
        fig, (ax_mem, ax_comm) = plots.new_axes(figsize=(10, 4.2), ncols=2)
        fig.get_layout_engine().set(w_pad=0.1)
        mesh = "".join(f", {k} = {p[k]}" for k in ("tp", "pp", "cp", "ep") if p[k] > 1)
        plots.stage_memory_bars(data, capacity_gb=gpu_gb, ax=ax_mem,
                                title=f"Ψ = {format_params(p['psi'])}, N = {p['n_gpus']}{mesh}, "
                                      f"{p['precision']}{' + fp8 weights' if p['fp8'] else ''}, {p['optimizer']}")
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
        ax_comm.set_title(f"Data-parallel traffic per step{f' (g = {g})' if g > 1 else ''}"
                          f"{', FP8 gathers' if p['fp8'] else ''} (algorithm bytes);\n"
                          f"time on {NODE_CHOICES[p['node']][0]}", fontsize=10)
        self.figure, self.png = fig, plots.figure_png(fig)
        self.renders += 1
        fits = ", ".join(f"{name} {'fits' if t <= gpu_gb * plots.GB else 'does not fit'}"
                         for name, t in zip(plots.STAGE_NAMES, data["total"]))
        display(plots.image_bundle(self.png, plots.figure_alt(fig)), raw=True)
        print(f"Ψ = {format_params(p['psi'])} parameters, N = {p['n_gpus']}. Mesh: dp = {data['dp']}{mesh}. "
              f"With {gpu_gb} GB per GPU: {fits}.\n{self.verdict}")

    def measure(self):
        """Run this configuration on the laptop and draw measured beside predicted; or say why it cannot.
        Returns the measurement dict, or the reason (a string)."""
        s = self.settings()
        reason = measure_refusal(**s)
        if reason:
            self.measured = None
            self.measure_status.value = f"cannot run on this laptop: {reason}"
            return reason
        self.measure_status.value = f"running on {s['n_gpus']} rank(s) ..."
        self.measured = measure(**s)
        self.measure_status.value = (f"measured: TinyGPT of this shape, Ψ = {self.measured['psi']:,}, "
                                     f"ZeRO-{s['stage']}, {s['n_gpus']} rank(s)")
        ax = plots.memory_bars(self.measured["predicted"], measured=self.measured["measured"],
                               categories=("params", "grads", "optimizer"),
                               title=f"Ψ = {self.measured['psi']:,}, stage {s['stage']}: predicted vs measured")
        with self.measure_output:
            self.measure_output.clear_output(wait=True)
            plots.show(ax.figure)
        return self.measured
