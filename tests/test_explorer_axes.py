"""The Memory Explorer's axes (chapter 1), headless as tests/test_widgets.py: dp/tp/pp/cp/ep and the
stage, recomputation, the logits, the presets, the verdict naming the binding term, the "measure it"
button's named refusals, and one measured run (2 ranks, a tiny TinyGPT)."""
import pytest

import zerolab as zl
from zerolab.book.explorer import MemoryExplorer
from zerolab.book.explorer_model import MODEL_PRESETS
from zerolab.theory import SHAPES

GB = 1e9
GPT = dict(layers=36, hidden=4096, heads=32, seq_len=2048)      # chapter 1's 7.5B GPT


@pytest.fixture(scope="module")
def ex():
    return MemoryExplorer(psi=7.5e9, n_gpus=64, **GPT, micro_batch=1)


def reset(ex, **values):
    ex._hold = True
    defaults = dict(psi=7.5e9, n_gpus=64, tp=1, pp=1, cp=1, ep=1, stage=3, precision="mixed", optimizer="adam",
                    offload_optimizer="none", offload_param="none", hpz=1, gpu_gb=80, **GPT, micro_batch=1,
                    recompute="none", sp=False, flash_attention=False, vocab=0, expert_params=0)
    for k, v in {**defaults, **values}.items():
        getattr(ex, k).value = v
    ex._hold = False
    ex.render()
    return ex.data


def acts(**kw):
    return zl.activation_memory(**{**GPT, "micro_batch": 1, **kw})


def test_mesh_axes_change_states_and_activations(ex):
    d = reset(ex)
    assert ex.dp == 64 and d["dp"] == 64 and d["activations"][3] == acts()
    d = reset(ex, tp=4, sp=True)
    assert ex.dp == 16 and d["params"][0] == 2 * 7.5e9 / 4                    # DDP: the TP slice whole
    assert d["activations"][3] == acts(tp=4, sp=True)                          # Korthikanti: sbh(34/t + 5as/ht)
    d = reset(ex, pp=4)
    assert d["params"][0] == 2 * 7.5e9 / 4 and d["activations"][3] == acts()  # 1F1B: 4 micro-batches in flight
    assert d["in_flight"] == 4 and d["pipeline_stage"] == "first"
    d = reset(ex, cp=2)
    assert d["params"][3] == zl.estimate(7.5e9, 64, 3).params and d["activations"][3] == acts(cp=2)
    d = reset(ex, n_gpus=64, tp=8, pp=8, cp=2)
    assert "error" in d and "n_gpus=64 is not a multiple of tp*pp*cp = 128" in ex.verdict


def test_expert_parallel_with_a_moe_preset(ex):
    reset(ex)
    ex.preset.value = "Mixtral 8x7B"
    shape = SHAPES["mixtral-8x7b"]
    assert ex.psi.value == pytest.approx(shape.params) and ex.expert_params.value == shape.expert_params
    assert (ex.layers.value, ex.hidden.value, ex.vocab.value) == (32, 4096, 32000)
    dense = ex.data["params"][0]
    ex.ep.value = 8
    assert ex.data["params"][0] == 2 * (shape.params - shape.expert_params) + 2 * shape.expert_params // 8 < dense
    ex.expert_params.value = 0
    assert "ep=8 needs expert_params > 0" in ex.verdict
    ex.preset.value = "DeepSeek-V3"
    assert ex.psi.value == pytest.approx(671e9) and ex.expert_params.value == 58 * 256 * 3 * 7168 * 2048
    ex.preset.value = "(custom)"


def test_presets_cover_the_articles_and_configs(ex):
    assert {"7.5B GPT", "13B GPT-3", "175B GPT-3", "Llama-3 8B", "Llama-3 70B", "Llama-3.1 405B", "Mixtral 8x7B",
            "DeepSeek-V3"} <= set(MODEL_PRESETS)
    reset(ex)
    before = ex.renders
    ex.preset.value = "Llama-3 8B"
    assert ex.renders == before + 1                                            # one redraw for seven controls
    assert ex.psi.value == pytest.approx(SHAPES["llama-3-8b"].params) and ex.vocab.value == 128256
    ex.presets[3].click()                                                      # the 175B button: GPT-3's shape
    assert (ex.psi.value, ex.layers.value, ex.hidden.value, ex.heads.value) == (pytest.approx(175e9), 96, 12288, 96)
    ex.preset.value = "(custom)"


def test_recompute_and_logits(ex):
    d = reset(ex, recompute="selective")
    assert d["activations"][0] == acts(recompute="selective") == 36 * 34 * 2048 * 4096
    ex.checkpointing.value = True                                              # the older control: an alias
    assert ex.recompute.value == "full" and ex.data["activations"][0] == acts(recompute="full")
    assert set(ex.data["terms"]) == {"checkpoints", "working", "logits"}
    d = reset(ex, vocab=50257)
    assert d["terms"]["logits"] == 2 * 4 * 2048 * 50257 and d["activations"][0] == acts(vocab=50257)
    assert d["total"][3] == zl.estimate(7.5e9, 64, 3).total + acts(vocab=50257)


def test_verdict_names_the_binding_term(ex):
    reset(ex)
    a = acts() / GB
    assert ex.binding == "activations" and ex.verdict.endswith(f"largest term activations {a:.1f} GB of 80 GB")
    assert "fits" in ex.verdict and "H100" not in ex.verdict and "A100" in ex.verdict
    reset(ex, micro_batch=4)
    a4 = acts(micro_batch=4) / GB
    assert ex.verdict.endswith(f"activations {a4:.1f} GB of 80 GB: reduce micro-batch or recompute='selective'")
    assert "does not fit" in ex.verdict
    reset(ex, stage=0, recompute="full")                                        # DDP: 12Ψ of optimizer state
    assert ex.binding == "optimizer" and "optimizer 90.0 GB of 80 GB: a higher ZeRO stage" in ex.verdict
    reset(ex, psi=1e9, layers=2, hidden=1024, heads=8, seq_len=8192, micro_batch=8, vocab=256000, recompute="full")
    assert ex.binding == "logits" and "tp (vocabulary-parallel logits)" in ex.verdict
    reset(ex, psi=1e9, layers=4, hidden=1024, heads=16, seq_len=32768, recompute="full")
    assert ex.binding == "working" and "flash_attention" in ex.verdict
    ex.gpu.value = "H200"                                                       # the GPU sets the capacity
    assert ex.gpu_gb.value == 141 and "of 141 GB (H200 SXM)" in ex.verdict
    ex.gpu.value = "A100"


def test_measure_refuses_by_name(ex):
    reset(ex)
    assert ex.measure() == "N = 64: the laptop runs at most 2 ranks" and ex.measured is None
    reset(ex, n_gpus=2)
    assert ex.measure().startswith("Ψ: a TinyGPT of 36 layers x hidden 4096")
    reset(ex, n_gpus=2, tp=2, layers=2, hidden=64, heads=2, seq_len=32)
    assert ex.measure().startswith("tp=2: the measure run is data-parallel only")
    reset(ex, n_gpus=2, layers=2, hidden=64, heads=2, seq_len=32, offload_optimizer="cpu")
    assert "offload and hpZ are not measured here" in ex.measure()
    assert "cannot run on this laptop" in ex.measure_status.value


def test_measure_runs_two_ranks_and_matches_the_prediction():
    ex = MemoryExplorer(psi=1e6, n_gpus=2, layers=2, hidden=64, heads=2, seq_len=32, micro_batch=2, vocab=128,
                        precision="fp32", stage=2)
    got = ex.measure()
    assert isinstance(got, dict) and len(got["measured"]) == 2
    psi = got["psi"]
    assert psi == 2 * (12 * 64 * 64 + 12 * 64) + 128 * 64 + 32 * 64 + 2 * 64   # TinyGPT without the key bias
    for pred, meas in zip(got["predicted"], got["measured"]):
        assert meas["params"] == pred["params"] == 4 * psi                      # fp32, whole at stage 2
        assert meas["optimizer"] == pred["optimizer"] and meas["grads"] == pred["grads"]
    assert ex.measure_status.value.startswith("measured:") and ex.measure_output.outputs is not None
