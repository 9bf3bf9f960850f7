"""bench.peers.fsdp_beside_ours (chapter 12): our ZeRO-3 and FSDP2 fully_shard on 2 real ranks agree
(fp32, 1e-5) after real updates, and keep the same bytes per rank (4Ψ/N parameters, 8Ψ/N Adam state)."""
import pytest

import zerolab as zl
from zerolab.bench import peers


@pytest.mark.parametrize("world_size", [2, 3])
def test_fsdp2_and_ours_agree(world_size):
    out = zl.launch(peers.fsdp_beside_ours, world_size=world_size, kwargs=dict(preset="micro", steps=2))
    for r in out:
        assert r["moved"] > 1e-4                      # a step that never updates would pass the diff alone
        assert r["max_abs_diff"] <= 1e-5
        assert r["fsdp_param_type"] == "DTensor"
    if world_size == 2:                               # 30,016 divides by 2: no padding on either side
        assert all(r["bytes"]["ours"] == r["bytes"]["fsdp2"] for r in out)
