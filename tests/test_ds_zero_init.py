"""``deepspeed.zero.Init`` keeps the constructor's values and partitions as it builds; ``GatheredParameters``
before ``initialize`` gathers the pieces and writes back rank ``modifier_rank``'s edits.

The script is ``tests/ds_zero_init_run.py``'s ``run(deepspeed)`` (DeepSpeed's names only). On 2 gloo
ranks under ``zl.launch``, built with a *different* seed on each rank (rank 0's values are broadcast at
construction), it must

* leave every parameter a placeholder after the block, and inside a read-only ``GatheredParameters``
  (listing the parameters in a different order on each rank) show exactly the model built plainly;
* keep rank 1's edit under ``modifier_rank=1`` on every rank (rank 0 wrote something else) and drop the
  edit made under ``modifier_rank=None``;
* start ``initialize`` (ZeRO-3) from those values exactly and train like one process (1e-5).

Where DeepSpeed imports, the same script under DeepSpeed 0.19 (CPU, ``torchrun``, gloo) must give the
same values exactly before training and within 1e-5 after.
"""
from __future__ import annotations

import os
import socket
import sys
from pathlib import Path

import pytest
import torch
from torch import nn

import ds_zero_init_run as script
import script_util
import zerolab as zl
import zerolab.deepspeed as zds
from zerolab.bench.peers import deepspeed_available

TESTS = Path(__file__).resolve().parent
HAVE_DEEPSPEED = deepspeed_available()   # the real package, not a folder named deepspeed


def _rank(seed_by_rank):
    import zerolab.deepspeed as deepspeed   # the one line a DeepSpeed user changes
    return script.run(deepspeed, seed_by_rank)


def run_zerolab(seed_by_rank: bool) -> list[dict]:
    return zl.launch(_rank, world_size=2, args=(seed_by_rank,), timeout=180, threads=1)


def close(got: dict, want: dict, atol: float) -> float:
    assert got.keys() == want.keys()
    worst = max((got[k] - want[k]).abs().max().item() for k in want)
    assert worst <= atol, f"differ by up to {worst:.3g} (tolerance {atol:g})"
    return worst


def check_against_one_process(results):
    ref = script.reference()
    for res in results:
        assert all(res["placeholders"].values()), f"rank {res['rank']}: not partitioned {res['placeholders']}"
        close(res["built"], ref["built"], 0)      # the constructor's values, whole inside the block
        assert res["start"]["out.bias"].ne(script.DROPPED).all(), "a modifier_rank=None edit was kept"
        assert res["start"]["mid.weight"].eq(script.MID).all(), "rank 1's modifier_rank=1 edit did not arrive"
        close(res["start"], ref["start"], 0)
        close(res["final"], ref["final"], 1e-5)
        assert torch.equal(res["freq"], ref["freq"])
    close(results[1]["final"], results[0]["final"], 0)


@pytest.mark.slow
def test_zero_init_keeps_the_constructors_values_and_trains_like_one_process():
    check_against_one_process(run_zerolab(seed_by_rank=True))


def _pieces():
    import torch.distributed as dist
    torch.manual_seed(100 + dist.get_rank())
    with zds.zero.Init(config_dict_or_path=script.CONFIG):
        model = script.Custom()
    return {n: p._zl_piece.clone() for n, p in model.named_parameters()}


@pytest.mark.slow
def test_each_rank_keeps_only_its_piece_of_rank_0s_values():
    got = zl.launch(_pieces, world_size=2, timeout=120, threads=1)
    torch.manual_seed(100)
    for n, p in script.Custom().named_parameters():
        flat = p.detach().reshape(-1)
        half = -(-flat.numel() // 2)
        whole = torch.cat([got[0][n], got[1][n]])
        assert got[0][n].numel() == got[1][n].numel() == half, n
        assert torch.equal(whole[: flat.numel()], flat), n


# ---------------------------------------------------------------- the same script under DeepSpeed itself
@pytest.mark.slow
@pytest.mark.skipif(not HAVE_DEEPSPEED, reason="DeepSpeed is not installed")
def test_same_script_under_deepspeed_gives_the_same_values(tmp_path):
    out = tmp_path / "deepspeed"
    env = {**os.environ, "DS_ACCELERATOR": "cpu", "OMP_NUM_THREADS": "1"}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-port", str(_free_port()),
           str(TESTS / "ds_zero_init_run.py"), "--lib", "deepspeed", "--out", str(out)]
    r = script_util.run_script(cmd, env, timeout=400)
    assert r.returncode == 0, r.stderr[-4000:]
    theirs = [torch.load(f"{out}.rank{rank}", weights_only=False) for rank in range(2)]
    check_against_one_process(theirs)   # DeepSpeed itself passes the checks zerolab is held to
    ours = run_zerolab(seed_by_rank=False)
    for o, t in zip(ours, theirs):
        assert o["placeholders"] == t["placeholders"]
        close(o["built"], t["built"], 0)
        close(o["start"], t["start"], 0)
        close(o["final"], t["final"], 1e-5)
        assert max(abs(a - b) for a, b in zip(o["losses"], t["losses"])) < 1e-5


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# ---------------------------------------------------------------- one process, no process group
class Small(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = script.Fixed(4)
        self.scale = nn.Parameter(torch.full((4,), 0.5))


def test_without_a_process_group_the_pieces_are_whole_and_gathered_edits_follow_modifier_rank():
    with zds.zero.Init(config_dict_or_path=script.CONFIG):
        model = Small()
    assert all(p.is_meta for p in model.parameters())
    assert torch.equal(model.fc.weight._zl_piece, script.FIXED[:4, :4].reshape(-1))
    with zds.zero.GatheredParameters(model.parameters(), modifier_rank=0), torch.no_grad():
        assert not model.fc.weight.is_meta and torch.equal(model.fc.weight, script.FIXED[:4, :4])
        model.scale.fill_(2.0)
    with zds.zero.GatheredParameters(model.scale), torch.no_grad():
        model.scale.fill_(7.0)   # dropped
    assert model.scale.is_meta and torch.equal(model.scale._zl_piece, torch.full((4,), 2.0))
    with zds.zero.GatheredParameters(model.scale), pytest.raises(RuntimeError, match="nested"):
        with zds.zero.GatheredParameters([model.fc.weight, model.scale]):
            pass
    assert model.scale.is_meta and model.fc.weight.is_meta
    with pytest.raises(ValueError, match="modifier_rank=1"):
        with zds.zero.GatheredParameters(model.scale, modifier_rank=1):
            pass


@pytest.mark.parametrize("kwargs, want", [
    ({"dtype": torch.bfloat16}, torch.bfloat16),
    ({"config_dict_or_path": {**script.CONFIG, "bf16": {"enabled": True}}}, torch.bfloat16),
    ({"config_dict_or_path": {**script.CONFIG, "fp16": {"enabled": True}}}, torch.float16),
    ({"config_dict_or_path": {**script.CONFIG, "bf16": {"enabled": True}}, "dtype": torch.float32}, torch.float32),
    ({"config_dict_or_path": script.CONFIG}, torch.float32),
], ids=["dtype", "config-bf16", "config-fp16", "dtype-over-config", "config-fp32"])
def test_dtype_is_deepspeeds_choice(kwargs, want):
    with zds.zero.Init(**kwargs):
        model = Small()
    for p in model.parameters():
        assert p.dtype == p._zl_piece.dtype == want
    assert torch.equal(model.fc.weight._zl_piece, script.FIXED[:4, :4].reshape(-1).to(want))


# ---------------------------------------------------------------- a meta-device model (without zero.Init)
def _meta_rank():
    import zerolab.deepspeed as deepspeed
    deepspeed.init_distributed(dist_backend="gloo")
    rank = deepspeed.comm.get_rank()
    with torch.device("meta"):
        model = Small()
    with deepspeed.zero.GatheredParameters([model.scale], modifier_rank=1), torch.no_grad():
        model.scale.fill_(script.MID if rank == 1 else -5.0)
    with deepspeed.zero.GatheredParameters([model.fc.bias]), torch.no_grad():
        model.fc.bias.fill_(script.DROPPED)
    engine, _, _, _ = deepspeed.initialize(model=model, config=script.CONFIG, model_parameters=model.parameters())
    with deepspeed.zero.GatheredParameters(list(engine.module.parameters())):
        return {n: p.detach().clone() for n, p in engine.module.named_parameters()}


@pytest.mark.slow
def test_a_meta_device_models_edits_before_initialize_follow_modifier_rank():
    """Built on the meta device, not under zero.Init: rank 1's edit is kept aside and written into the
    shards by initialize; the read-only block's edit is dropped (the bias comes from reset_parameters)."""
    got = zl.launch(_meta_rank, world_size=2, timeout=120, threads=1)
    for sd in got:
        assert sd["scale"].eq(script.MID).all(), "rank 1's modifier_rank=1 edit did not arrive"
        assert sd["fc.bias"].ne(script.DROPPED).all(), "a modifier_rank=None edit was kept"
    close(got[1], got[0], 0)
