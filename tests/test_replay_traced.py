"""Traces recorded by real runs (2 gloo ranks) and replayed: what the engine records, and at a target's size.

The validation against published GPU figures is at the end: each cited, with the tolerance stated.
"""
from __future__ import annotations

import time

import pytest

import zerolab as zl
from zerolab.theory.replay import replay
from zerolab.theory.replay_scale import count_passes, unit_kinds
from zerolab.theory.shapes import ModelShape

pytestmark = pytest.mark.slow
V, D, H, S, B = 96, 32, 2, 16, 2


def traced_step(stage, layers=3, overlap=True, extra=None):
    """One traced optimizer step of a TinyGPT on this rank: ``engine.events`` after a warm-up step."""
    import torch
    import zerolab as zl
    from zerolab.book.models import TinyGPT
    model = TinyGPT(vocab=V, n_layer=layers, n_head=H, d_model=D, seq_len=S)
    cfg = {"train_micro_batch_size_per_gpu": B, "optimizer": {"type": "Adam", "params": {"lr": 1e-3}},
           # ZeRO-3's element thresholds are the target's, not the toy's: a unit is released after use and
           # re-gathered for backward (as FSDP's reshard_after_forward), one unit is prefetched ahead
           "zero_optimization": {"stage": stage, "overlap_comm": overlap, "stage3_param_persistence_threshold": 0,
                                 "stage3_max_reuse_distance": 0, "stage3_prefetch_bucket_size": 16 * D * D},
           "zerolab": {"trace": True, "collectives": "reduce_scatter"}}
    for k, v in (extra or {}).items():
        cfg.setdefault(k, {}).update(v) if isinstance(v, dict) else cfg.__setitem__(k, v)
    engine = zl.initialize(model, cfg)
    torch.manual_seed(engine.rank)
    x = torch.randint(0, V, (B, S))
    for _ in range(2):
        engine.events.clear()
        loss = torch.nn.functional.cross_entropy(engine(x).flatten(0, 1).float(), x.flatten())
        engine.backward(loss)
        engine.step()
    return list(engine.events)


def tiny_shape(layers=3):
    """The recorded TinyGPT as a ModelShape (GPT-2's layer, tied head)."""
    return ModelShape("TinyGPT", D, layers, H, H, 4 * D, V, seq=S, micro_batch=B, tied=True, gpt=True)


@pytest.fixture(scope="module")
def traces():
    return {stage: zl.launch(traced_step, world_size=2, args=(stage,)) for stage in (0, 1, 2, 3)}


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_a_traced_step_records_flops_per_unit_forward_and_backward_apart(traces, stage):
    shape = tiny_shape()
    for events in traces[stage]:
        assert all(len(e) == 3 for e in events)             # every event unpacks as (name, index, seconds)
        meta = next(e.info for e in events if e[0] == "trace-meta")
        prog = [("compute", e[1], e.info["phase"], e.info["flops"]) for e in events if e[0] == "compute"]
        passes, by_kind = count_passes(prog, meta)
        assert passes == 1 and unit_kinds(meta).count("layer") == 3
        assert by_kind["layer", "forward"] == 3 * shape.layer_flops("forward")
        assert by_kind["layer", "backward"] == 3 * shape.layer_flops("backward")   # not the forward's
        assert by_kind["rest", "forward"] == shape.rest_flops("forward")
        assert by_kind["rest", "backward"] == shape.rest_flops("backward")
        issued = {e[1] for e in events if e[0] == "coll-issued"}
        waited = {e[1] for e in events if e[0] == "coll-waited"}
        assert issued and issued == waited, "every collective issued is waited for"
        updated = sum(e.info["numel"] for e in events if e[0] == "optimizer")
        total = sum(numel for _, numel, _ in meta["units"])
        assert updated == (total if stage == 0 else sum(p for _, _, p in meta["units"]) // 2)


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_replaying_at_the_recorded_models_own_size_changes_nothing(traces, stage):
    for cluster in ("dgx-h100", "cloud-100gbe:2"):
        plain, same = replay(traces[stage], cluster), replay(traces[stage], cluster, model=tiny_shape())
        assert same.step_seconds == pytest.approx(plain.step_seconds, rel=1e-12)
        assert same.exposed_comm == pytest.approx(plain.exposed_comm, rel=1e-12, abs=1e-15)
        assert same.flops == plain.flops


@pytest.fixture(scope="module")
def deep3():
    """A stage-3 step of a TinyGPT with 32 layers at toy width: Llama-2-7B's and Llama-3-8B's order."""
    return zl.launch(traced_step, world_size=2, args=(3, 32))


def test_a_32_layer_trace_replays_as_llama_7b_unit_by_unit(deep3):
    t0 = time.perf_counter()
    rep = replay(deep3, "dgx-h100", model="llama-2-7b")
    seconds = time.perf_counter() - t0
    shape = zl.theory.get_shape("llama-2-7b")
    assert rep.flops == pytest.approx(shape.step_flops(), rel=1e-9)        # every unit became the target's
    gathers = [s for s in rep.spans[0] if s[0] == "all-gather"]
    assert len(gathers) >= 2 * 32                                           # forward and backward, each layer
    compute = rep.compute_seconds[0]
    assert compute >= shape.step_flops() / zl.HARDWARE["dgx-h100"].flops    # plus the optimizer's update
    assert rep.step_seconds >= compute and rep.exposed_comm[0] < 0.05 * rep.step_seconds   # NVLink hides it
    print(f"replay of a 32-layer trace: {seconds:.2f} s")


def test_a_different_layer_count_is_refused_by_name(traces):
    with pytest.raises(zl.theory.ReplayError, match="3 layers.*Llama-2-7B has 32.*layer count"):
        replay(traces[3], "dgx-h100", model="llama-2-7b")


# torchtitan, docs/performance.md ("Llama 3 performance numbers"): Llama 3 8B, FSDP2 (1D), 64 A100 80GB,
# local batch 1, sequence 8192, selective op activation checkpointing: 2,973 tokens/s per GPU, MFU 58.2 %.
TORCHTITAN_8B = {"wps": 2973, "mfu": 0.582, "source": "pytorch/torchtitan docs/performance.md, Llama 3 8B, 64 A100"}


def test_replay_of_fsdp_llama3_8b_on_64_a100_is_within_25_percent_of_torchtitans_measurement(deep3):
    """ZeRO-3 = FSDP's full sharding. The replay's compute runs at the preset's *assumed* 150 TFLOP/s (48 % of
    the A100's peak; torchtitan reached 58 %), so it is below the published figure by about that ratio: the
    communication is hidden (exposed < 3 %), what remains is the compute-rate assumption. (Their selective
    recomputation costs FLOPs their MFU does not count, and the replay does not charge: both leave it out.)"""
    rep = replay(deep3, "dgx-a100:8", model="llama-3-8b")
    wps = 8192 / rep.step_seconds
    assert 0.75 < wps / TORCHTITAN_8B["wps"] < 1.25 and 0.75 < rep.mfu / TORCHTITAN_8B["mfu"] < 1.25
    assert rep.exposed_comm[0] < 0.03 * rep.step_seconds
    assumed = zl.HARDWARE["dgx-a100"].flops / zl.theory.GPUS["A100"].bf16
    assert rep.mfu == pytest.approx(assumed, rel=0.05)                  # the gap is the assumed compute rate
