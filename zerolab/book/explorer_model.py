"""The Memory Explorer's numbers, without the widgets (chapter 1): model presets, the bytes per GPU
on every axis, the verdict against a GPU, and the laptop run behind the "measure it" button.

Every number comes from ``zerolab.theory``: model states from ``estimate`` (stage, precision,
FP8 weights, offload, ZeRO++'s hpZ, tp/pp/cp/ep), activations from ``activation_terms`` (recompute, tp/sp, cp,
pp, the logits). The activation count is Korthikanti's GPT layer (multi-head attention, a 4h GeLU
MLP); for the Llama, Mixtral and DeepSeek presets it is the same count at their h, a, L — an
approximation (grouped-query attention keeps less K/V, a SwiGLU or MoE MLP a different width).
"""
from __future__ import annotations

from dataclasses import dataclass

from zerolab import theory
from zerolab.theory.activations import activation_terms
from zerolab.theory.checks import mesh_share
from zerolab.theory.fp8 import fp8_comm_volume, fp8_step_comm_time
from zerolab.theory.shapes import SHAPES

GB = 1e9
STAGES = (0, 1, 2, 3)
MEASURE_MAX_PARAMS = 30_000_000     # TinyGPT sizes a laptop trains for one step in seconds
MEASURE_MAX_TOKENS = 8192           # seq_len x micro-batch per rank


@dataclass(frozen=True)
class Preset:
    """A model for the explorer: Ψ, the experts' share of it, and the shape activations need."""
    psi: float
    layers: int
    hidden: int
    heads: int
    seq_len: int
    vocab: int
    expert_params: int = 0
    source: str = ""


def _from_shape(key, psi=None) -> Preset:
    s = SHAPES[key]
    return Preset(psi or s.params, s.layers, s.hidden, s.heads, s.seq, s.vocab, s.expert_params,
                  f"theory.SHAPES[{key!r}]")


MODEL_PRESETS = {
    # the source articles' GPT sizes: Ψ as they state it, the shape from theory.SHAPES (cited there)
    "7.5B GPT": _from_shape("gpt-7.5b", 7.5e9),
    "13B GPT-3": _from_shape("gpt-3-13b", 13e9),
    "175B GPT-3": _from_shape("gpt-3-175b", 175e9),
    # Ψ counted from each config.json's shape (theory.SHAPES): 8.03B, 70.6B, 405.9B, 46.7B
    "Llama-3 8B": _from_shape("llama-3-8b"),
    "Llama-3 70B": _from_shape("llama-3-70b"),
    "Llama-3.1 405B": _from_shape("llama-3.1-405b"),
    "Mixtral 8x7B": _from_shape("mixtral-8x7b"),
    # DeepSeek-V3 technical report (arXiv 2412.19437): 671B parameters, 37B active, 61 layers, h 7168,
    # 128 heads, 4K-token pre-training sequences; config.json: vocabulary 129280, layers 4-61 are MoE
    # with 256 routed experts of moe_intermediate_size 2048 (3 matrices each): 58 x 256 x 3 x 7168 x 2048
    # = 653.9B expert parameters. Its attention (MLA) is not Korthikanti's: activations are approximate.
    "DeepSeek-V3": Preset(671e9, 61, 7168, 128, 4096, 129280, 58 * 256 * 3 * 7168 * 2048,
                          "DeepSeek-V3 technical report; config.json"),
}
# the explorer's four quick buttons (the ZeRO paper's and the source articles' sizes)
BUTTONS = {"7.5B": "7.5B GPT", "13B": "13B GPT-3", "70B": "Llama-3 70B", "175B": "175B GPT-3"}

# node kind -> (label, zerolab.theory.nodes preset, NICs per node or None for the preset's); chapter 2
NODE_CHOICES = {"dgx-a100": ("DGX A100, 8 x 200 Gb/s NICs", "dgx-a100", None),
                "dgx-a100-1nic": ("DGX A100 with 1 x 200 Gb/s NIC", "dgx-a100", 1),
                "dgx-h100": ("DGX H100, 8 x 400 Gb/s NICs", "dgx-h100", None),
                "cloud-100gbe": ("8 x A100, 1 x 100 GbE NIC", "cloud-100gbe", None)}


def node_of(choice: str):
    """The ``zerolab.theory.Node`` a ``NODE_CHOICES`` key stands for."""
    from zerolab.theory.nodes import NODES
    _, preset, nics = NODE_CHOICES[choice]
    return NODES[preset] if nics is None else NODES[preset].with_nics(nics)


# the term that binds -> what to do about it
ADVICE = {
    "params": "ZeRO-3 (stage 3), tp or pp",
    "grads": "ZeRO-2 or 3",
    "optimizer": "a higher ZeRO stage or offload_optimizer='cpu'",
    "hpz": "a larger hpZ partition (fewer copies) or none",
    "checkpoints": "reduce micro-batch, pp, or sp",
    "working": "recompute working set: flash_attention, tp with sp, or a smaller micro-batch",
    "logits": "tp (vocabulary-parallel logits), cp, or a smaller micro-batch",
}


def _activation_advice(recompute) -> str:
    nxt = {"none": "recompute='selective'", "selective": "recompute='full'", "full": "tp with sp or cp"}[recompute]
    return f"reduce micro-batch or {nxt}"


def compute(psi, n_gpus, precision, optimizer, offload_optimizer, offload_param, layers, hidden, heads,
            seq_len, micro_batch, recompute="none", tp=1, pp=1, cp=1, ep=1, sp=False, flash_attention=False,
            vocab=0, hpz=1, expert_params=0, node="dgx-a100", grad_accum=1, fp8=False, **_) -> dict:
    """Bytes per GPU at every stage (lists, one entry per stage 0-3) and the activation terms. ``fp8``: the
    weights in FP8 and their all-gathers at one byte (``theory.fp8``); activations stay 16-bit."""
    psi = int(round(psi))
    d = 4 if precision == "fp32" else 2
    acts = activation_terms(layers, hidden, heads, seq_len, micro_batch, dtype_bytes=d,
                            flash_attention=flash_attention, recompute=recompute, tp=tp, sp=sp, cp=cp,
                            pp=pp, vocab=vocab or None)
    data = {k: [] for k in ("params", "grads", "optimizer", "hpz", "activations", "total", "host", "nvme",
                            "comm", "comm_seconds")}
    mesh = dict(tp=tp, pp=pp, cp=cp, ep=ep, expert_params=expert_params if ep > 1 else 0)
    psi_dp, n_dp = mesh_share(psi, n_gpus, tp, pp)
    for stage in STAGES:
        est = theory.estimate(psi, n_gpus, stage, precision=precision, optimizer=optimizer,
                              offload_optimizer=offload_optimizer if stage >= 1 else "none",
                              offload_param=offload_param if stage == 3 else "none",
                              hpz_partition_size=hpz if stage == 3 and offload_param == "none" else 1, fp8=fp8,
                              **mesh)
        for k in ("params", "grads", "optimizer", "host", "nvme", "hpz"):
            data[k].append(getattr(est, k))
        data["activations"].append(acts["total"])
        data["total"].append(est.total + acts["total"])
        comm = dict(dtype_bytes=d, grad_accum=grad_accum)
        if fp8:
            data["comm"].append(fp8_comm_volume(psi_dp, n_dp, stage, grad_accum))
            data["comm_seconds"].append(fp8_step_comm_time(psi_dp, n_dp, stage, node_of(node), grad_accum))
        else:
            data["comm"].append(theory.comm_volume(psi_dp, n_dp, stage, **comm))
            data["comm_seconds"].append(theory.step_comm_time(psi_dp, n_dp, stage, node=node_of(node), **comm))
    data["terms"] = {"checkpoints" if acts["recompute"] == "full" else "activations": acts["layers"],
                     "working": acts["working"], "logits": acts["logits"]}
    data["pipeline_stage"], data["in_flight"], data["recompute"] = acts["stage"], acts["in_flight"], acts["recompute"]
    data["dp"] = n_gpus // (tp * pp * cp)
    data["fp8"] = fp8
    return data


def verdict(data, stage, capacity, gpu_name) -> tuple[str, str]:
    """(the binding term, a sentence): the largest term of ``stage``'s bytes against ``capacity``."""
    terms = {"params": data["params"][stage] - data["hpz"][stage], "grads": data["grads"][stage],
             "optimizer": data["optimizer"][stage], "hpz": data["hpz"][stage], **data["terms"]}
    binding = max(terms, key=terms.get)
    total = data["total"][stage]
    advice = _activation_advice(data["recompute"]) if binding == "activations" else ADVICE[binding]
    where = f" on the {data['pipeline_stage']} pipeline stage" if data["in_flight"] > 1 or \
        data["pipeline_stage"] == "last" and data["terms"]["logits"] else ""
    fp8 = " with FP8 weights (1 byte each)" if data.get("fp8") else ""
    head = (f"ZeRO-{stage}{fp8}: {total / GB:.1f} GB of {capacity / GB:.0f} GB ({gpu_name}){where}: "
            + ("fits" if total <= capacity else "does not fit"))
    line = f"{binding} {terms[binding] / GB:.1f} GB of {capacity / GB:.0f} GB"
    return binding, f"{head}; largest term {line}" + ("" if total <= capacity else f": {advice}")


def tinygpt_shape(layers, hidden, heads, seq_len, vocab) -> dict:
    """TinyGPT keyword arguments for the explorer's shape (vocabulary 2048 when logits are not counted)."""
    return dict(vocab=vocab or 2048, n_layer=layers, n_head=heads, d_model=hidden, seq_len=seq_len)


def tinygpt_params(vocab, n_layer, n_head, d_model, seq_len) -> int:
    """TinyGPT's parameter count as the chapters build it (``runs.make_model``: no key bias): tied embedding,
    learned positions, GPT-2 layers, final LayerNorm."""
    h = d_model
    return vocab * h + seq_len * h + n_layer * (12 * h * h + 12 * h) + 2 * h


def measure_refusal(n_gpus, tp=1, pp=1, cp=1, ep=1, sp=False, offload_optimizer="none", offload_param="none",
                    hpz=1, stage=0, layers=1, hidden=64, heads=1, seq_len=32, micro_batch=1, vocab=0, fp8=False,
                    **_) -> str | None:
    """Why the laptop cannot run this configuration (a named reason), or None when it can."""
    if fp8:
        return ("fp8=True: the CPU engine has no FP8 (no FP8 weights or matmuls), so a run would measure bf16, "
                "not this configuration; untick FP8 to measure the bf16 one")
    mesh = {"tp": tp, "pp": pp, "cp": cp, "ep": ep}
    if any(v > 1 for v in mesh.values()) or sp:
        bad = ", ".join(f"{k}={v}" for k, v in mesh.items() if v > 1) or "sp=True"
        return f"{bad}: the measure run is data-parallel only (tp = pp = cp = ep = 1; chapter 10 runs the 3D mesh)"
    if n_gpus > 2:
        return f"N = {n_gpus}: the laptop runs at most 2 ranks"
    if offload_optimizer != "none" or offload_param != "none" or (hpz > 1 and stage == 3):
        return ("offload and hpZ are not measured here (offload: chapter 7, hpZ: chapter 9); "
                "set offload_optimizer, offload_param to 'none' and hpZ to 1")
    if hidden % heads:
        return f"hidden ({hidden}) is not a multiple of heads ({heads})"
    kw = tinygpt_shape(layers, hidden, heads, seq_len, vocab)
    n = tinygpt_params(**kw)
    if n > MEASURE_MAX_PARAMS:
        return (f"Ψ: a TinyGPT of {layers} layers x hidden {hidden} (vocabulary {kw['vocab']}) has "
                f"{n / 1e6:,.1f}M parameters; the laptop run takes up to {MEASURE_MAX_PARAMS / 1e6:g}M")
    if seq_len * micro_batch > MEASURE_MAX_TOKENS:
        return f"seq_len x micro-batch = {seq_len * micro_batch} tokens; the laptop run takes up to {MEASURE_MAX_TOKENS}"
    return None


def measure(n_gpus, stage, precision, optimizer, layers, hidden, heads, seq_len, micro_batch, vocab=0,
            **settings) -> dict:
    """Train the explorer's shape as a TinyGPT on ``n_gpus`` ranks for one step (``zl.launch``, the
    chapters' ``runs.train``); return ``{"psi", "predicted", "measured"}``: ``estimate`` beside each rank's
    ``engine.memory()`` between its backward and step."""
    reason = measure_refusal(n_gpus, stage=stage, layers=layers, hidden=hidden, heads=heads, seq_len=seq_len,
                             micro_batch=micro_batch, vocab=vocab, **settings)
    if reason:
        raise ValueError(f"cannot measure this configuration: {reason}")
    from zerolab.book import runs
    from zerolab.runtime.launch import launch
    kind = {"adam": "Adam", "adamw": "AdamW", "sgd_momentum": "SGD", "sgd": "SGD"}[optimizer]
    config = runs.ds_config(stage, precision=precision, optimizer=kind)
    if optimizer == "sgd":
        config["optimizer"]["params"]["momentum"] = 0.0
    shape = tinygpt_shape(layers, hidden, heads, seq_len, vocab)
    out = launch(runs.train, world_size=n_gpus, args=(config,),
                 kwargs=dict(preset=shape, steps=1, batch_per_rank=micro_batch, state=False), timeout=300)
    psi = out[0]["psi"]
    predicted = theory.estimate(psi, n_gpus, stage, precision=precision, optimizer=optimizer)
    return {"psi": psi, "predicted": [predicted.as_dict()] * n_gpus, "measured": [r["memory"] for r in out]}
