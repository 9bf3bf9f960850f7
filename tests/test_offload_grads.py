"""Offload's gradient path (engine/offload/optimizer_mixin.py): the reduced gradient shard leaves the
device during backward for an fp32 host shard, with and without DeepSpeed's "reduce_scatter",
accumulated over micro-batches exactly like the on-device engines; planted faults are caught."""
from __future__ import annotations

import pytest
import torch.distributed as dist

import zerolab as zl
from zerolab.book.models import TinyGPT, loss_fn, synthetic_batch
from zerolab.engine.offload.optimizer_mixin import OffloadMixin

GAS = 2


def _config(stage, offload, reduce_scatter=True, prec="bf16"):
    z = {"stage": stage, "reduce_bucket_size": 4000, "reduce_scatter": reduce_scatter,
         "stage3_param_persistence_threshold": 0}
    if offload:
        z["offload_optimizer"] = {"device": "cpu"}
    return {"optimizer": {"type": "Adam", "params": {"lr": 3e-3}}, "gradient_accumulation_steps": GAS,
            "gradient_clipping": 0.5, prec: {"enabled": True}, "zero_optimization": z}


def _worker(cases):
    rank, n = dist.get_rank(), dist.get_world_size()
    out = []
    for stage, rs in cases:
        finals, mem = [], None
        for offload in (False, True):
            model = TinyGPT.preset("micro", key_bias=False, seed=1)
            engine = zl.initialize(model, _config(stage, offload, rs))
            for step in range(2):
                for k in range(GAS):
                    x, y = synthetic_batch(model, 2 * n, seed=5, step=step * GAS + k, rank=rank, world_size=n)
                    engine.backward(loss_fn(engine(x), y))
                    if offload and step == 0 and k == 0:    # mid-accumulation: already on the host
                        mem = engine.memory().as_dict()
                    engine.step()
            finals.append(engine.full_state_dict())
            padded = engine.flat.padded
            engine.close()
        ref, got = finals
        out.append((max((got[k] - ref[k]).abs().max().item() for k in ref), mem, padded))
    return out


@pytest.mark.parametrize("n", [2, 3])
def test_offloaded_gradients_match_and_leave_the_device(n):
    cases = [(1, True), (1, False), (2, True), (2, False), (3, True)]
    results = zl.launch(_worker, world_size=n, args=(cases,), timeout=300, threads=1)
    for (stage, rs), (diff, mem, padded) in zip(cases, results[0]):
        assert diff <= 1e-5, (stage, rs, diff)
        est = zl.estimate(padded, n, stage, offload_optimizer="cpu")
        assert mem["grads"] == est.grads and mem["host"] == est.host, (stage, rs, mem, est)
        if stage >= 2:
            assert mem["grads"] == 0


def test_planted_device_gradient_shard_is_caught(monkeypatch):
    """Plant the old behaviour (the gradient shard stays on the device): memory() no longer
    equals zl.estimate — the check the test above and test_engine_offload's tiers test make."""
    real = OffloadMixin.build_grads

    def keeps_shard(self):
        real(self)
        self.grad_shard = self.host_grads.new_zeros(self.flat.shard_numel).to(self.precision.grad_dtype)
    monkeypatch.setattr(OffloadMixin, "build_grads", keeps_shard)
    model = TinyGPT.preset("micro", seed=1)
    engine = zl.initialize(model, _config(2, True))
    x, y = synthetic_batch(model, 2, seed=3)
    engine.backward(loss_fn(engine(x), y))
    assert engine.memory().grads != zl.estimate(engine.flat.padded, 1, 2, offload_optimizer="cpu").grads
    engine.close()


def test_planted_fp32_accumulation_is_caught(monkeypatch):
    """Plant accumulation in fp32 instead of the configured bf16: the run drifts from the
    on-device engine by more than the 1e-5 tolerance."""
    monkeypatch.setattr(OffloadMixin, "_first_micro_step", lambda self: self.micro_steps % self.gas == 0)
    real = OffloadMixin._to_host

    def fp32_accumulate(self, bucket, shards, first):
        saved = self.precision
        self.precision = type("P", (), {"grad_dtype": __import__("torch").float32})()
        try:
            real(self, bucket, shards, first)
        finally:
            self.precision = saved
    monkeypatch.setattr(OffloadMixin, "_to_host", fp32_accumulate)
    diff = zl.launch(_worker, world_size=2, args=([(2, True)],), timeout=300, threads=1)[0][0][0]
    assert diff > 1e-5
