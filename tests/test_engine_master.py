"""The fp32 master of a bf16 engine starts from the values the model was built with (bigmodel/materialize.py).

A model built in fp32 and given a bf16 config: after ``zl.initialize`` the master equals the model's
fp32 values bit for bit (stages 0-3, and the host master of ZeRO-3 with the optimizer offloaded; 2 ranks; rank 1 built from another seed, so rank 0's values are
what every rank starts from), and the 16-bit parameters are those values rounded. Mamba is the case
where it shows: its ``A_log`` and ``dt_proj.bias`` lose up to 1.6e-2 to bf16 rounding, many learning
rate steps. A model the user cast to bf16 before ``initialize`` has no fp32 values: a warning says so.
"""
from __future__ import annotations

import warnings

import pytest
import torch
import torch.distributed as dist

import zerolab as zl

STAGES = (0, 1, 2, 3)


def mamba(seed):
    from transformers import MambaConfig, MambaForCausalLM
    torch.manual_seed(seed)
    return MambaForCausalLM(MambaConfig(vocab_size=96, hidden_size=32, state_size=16, num_hidden_layers=2,
                                        expand=2, conv_kernel=4, time_step_rank=8))


def config(stage):
    return {"train_micro_batch_size_per_gpu": 1, "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
            "bf16": {"enabled": True}, "zero_optimization": {"stage": stage}}


def _master_worker():
    rank = dist.get_rank()
    want = {n: p.detach().clone() for n, p in mamba(0).named_parameters()}   # rank 0's values
    out = {}
    for stage in STAGES:
        engine = zl.initialize(mamba(rank), config(stage))   # rank 1's own values differ: rank 0's win
        worst, rounded = 0.0, True
        for u, master in zip(engine.flat.units, engine.targets):
            full = torch.cat([want[n].reshape(-1) for n, _ in u.params] + [torch.zeros(u.padded - u.numel)])
            lo, hi = engine.flat.own_range(u, engine.shards_optimizer)
            assert master.dtype == torch.float32
            worst = max(worst, (master - full[lo:hi]).abs().max().item())
            own = engine.own(engine.flat.flat, u)
            rounded &= torch.equal(own, full[lo:hi].to(torch.bfloat16))
        out[stage] = (worst, rounded)
        engine.close()
    cfg = config(3)
    cfg["zero_optimization"]["offload_optimizer"] = {"device": "cpu"}   # the master on the host
    engine = zl.initialize(mamba(rank), cfg)
    worst = 0.0
    for k, (i, a, b) in enumerate(engine.optimizer.pieces):
        u = engine.flat.units[i]
        full = torch.cat([want[n].reshape(-1) for n, _ in u.params] + [torch.zeros(u.padded - u.numel)])
        lo, _ = engine.flat.own_range(u, True)
        worst = max(worst, (engine.optimizer.chunks[k][: b - a] - full[lo + a: lo + b]).abs().max().item())
    out["offload"] = worst
    engine.close()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        zl.initialize(mamba(0).to(torch.bfloat16), config(1)).close()
    out["warned"] = [str(w.message) for w in caught if "fp32 master" in str(w.message)]
    return out


def test_the_fp32_master_is_the_fp32_model_bit_for_bit():
    r0, r1 = zl.launch(_master_worker, world_size=2, timeout=300, threads=1)
    for r in (r0, r1):
        assert {s: r[s] for s in STAGES} == {s: (0.0, True) for s in STAGES}, r
        assert r["offload"] == 0.0
        assert len(r["warned"]) == 1 and "bfloat16" in r["warned"][0], r["warned"]


def test_bf16_rounding_is_what_the_master_would_lose():
    """The size of what is at stake: Mamba's A_log and dt_proj.bias rounded to bf16."""
    model = mamba(0)
    lost = {n: (p - p.to(torch.bfloat16).float()).abs().max().item() for n, p in model.named_parameters()
            if n.endswith(("A_log", "dt_proj.bias"))}
    assert max(lost.values()) > 5e-3, lost   # AdamW at lr 1e-3 moves an element about 1e-3 per step
