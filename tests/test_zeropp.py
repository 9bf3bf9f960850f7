"""ZeRO++ (issue 13): simulated nodes and the ledger's intra/inter split, the quantizer, qwZ, hpZ and
qgZ measured against comm_breakdown, accuracy against exact ZeRO-3, hpZ's memory, bad input.
Each check has a planted bug next to it that it must catch."""
from __future__ import annotations

import os
import time

import pytest
import torch
import torch.distributed as dist

import zerolab as zl
from zerolab.book.models import TinyGPT, loss_fn, synthetic_batch
from zerolab.engine.zeropp import quantize as q
from zerolab.engine.zeropp.engine import ZeroPPEngine, qgz_reduce
from zerolab.runtime.comm import Communicator
from zerolab.theory.comm import comm_breakdown, quantized_bytes, split_intra_inter

FLAGS = {"zero3": {}, "qwZ": {"zero_quantized_weights": True}, "hpZ": {"zero_hpz_partition_size": 2},
         "qgZ": {"zero_quantized_gradients": True},
         "all": {"zero_quantized_weights": True, "zero_hpz_partition_size": 2, "zero_quantized_gradients": True}}


# ---------------------------------------------------------------- nodes and the ledger
def _nodes_worker():
    c = Communicator(link={"intra": zl.Link("fast", 1e12), "inter": zl.Link("slow", 1e8, 0.05)})
    for g in (c.intra.group, c.inter.group):   # gloo connects a group on first use: not part of the timing
        dist.barrier(group=g)
    env = (os.environ["LOCAL_RANK"], os.environ["LOCAL_WORLD_SIZE"], os.environ["GROUP_RANK"])
    c.all_gather(torch.empty(4000), torch.ones(1000), tag="world")                 # ring over 4: 2 of 4 links cross
    t = time.perf_counter()
    c.intra.all_gather(torch.empty(2000), torch.ones(1000), tag="intra")           # fast link
    t_intra = time.perf_counter() - t
    t = time.perf_counter()
    c.inter.all_to_all(torch.empty(2000), torch.ones(2000), tag="inter")           # slow link: >= 0.05 s
    t_inter = time.perf_counter() - t
    c.all_to_all(torch.empty(4000), torch.ones(4000), tag="a2a")                   # 2 of 3 peers on the other node
    # seconds = issue -> completion, not issue -> wait
    plain = Communicator(ranks_per_node=2)
    h = plain.all_gather(torch.empty(4000), torch.ones(1000), async_op=True, tag="late-wait")
    time.sleep(0.3)
    h.wait()
    recs = {r.tag: (r.bytes, r.inter_bytes) for r in c.ledger.records}
    return (env, recs, c.ledger.total_bytes(scope="inter"), c.ledger.total_bytes(scope="intra"),
            t_intra, t_inter, plain.ledger.records[0].seconds, [(c.intra.members, c.inter.members)])


def test_simulated_nodes_split_bytes_and_time_per_tier():
    res = zl.launch(_nodes_worker, 4, ranks_per_node=2, timeout=120)
    for rank, (env, recs, inter, intra, t_intra, t_inter, late, groups) in enumerate(res):
        assert env == (str(rank % 2), "2", str(rank // 2))
        assert groups == [([rank // 2 * 2, rank // 2 * 2 + 1], [rank % 2, rank % 2 + 2])]
        # algorithm bytes (fp32): all-gather of 16,000 B over 4 ranks: 3/4 sent, half of it on a crossing link
        assert recs == {"world": (12000, 6000), "intra": (4000, 0), "inter": (4000, 4000), "a2a": (12000, 8000)}
        assert (inter, intra) == (6000 + 4000 + 8000, 6000 + 4000 + 4000)
        assert t_inter >= 0.05 + 4000 / 1e8 and t_intra < 0.05    # each tier runs on its own link
        assert late < 0.25          # completed long before it was waited on (planted: timing to wait() -> 0.3 s)
    with pytest.raises(ValueError, match="ranks_per_node"):
        zl.launch(_nodes_worker, 4, ranks_per_node=3)


def test_ledger_scope_rule_planted():
    """The sums: a planted 'whole ring is inter' record would book 3000, not 1500."""
    from zerolab.runtime.comm import CommLedger, CommRecord
    led = CommLedger(records=[CommRecord("all_gather", 3000, 0.0, 1, "float32", 4, inter_bytes=1500)])
    assert led.total_bytes(scope="inter") == 1500 and led.total_bytes(scope="intra") == 1500
    with pytest.raises(ValueError, match="scope"):
        led.total_bytes(scope="node")


# ---------------------------------------------------------------- the quantizer
@pytest.mark.parametrize("bits, length, group", [(8, 1000, 64), (8, 8001, 8000), (4, 999, 50), (4, 4, 3)])
def test_pack_roundtrip_and_size(bits, length, group):
    x = torch.randn(3, length) * torch.logspace(-3, 2, 3)[:, None]     # rows of very different scales
    buf = q.pack(x, bits, group)
    assert buf.dtype == torch.uint8 and buf.shape == (3, quantized_bytes(length, bits, group))
    back = q.unpack(buf, length, bits, group)
    _, scales = q.quantize_rows(x, bits, group)
    half_step = scales.repeat_interleave(group, dim=1)[:, :length] / 2
    assert torch.all((back - x).abs() <= half_step * (1 + 1e-5) + 1e-12)   # error <= half a step, per group
    assert not torch.equal(back, x)                                          # it did quantize


# ---------------------------------------------------------------- qgZ's reordering
def _qgz_worker(planted):
    c = Communicator()
    n, r = c.world_size, c.rank
    R = 24
    # row j (destined to rank j) is constant (r+1)(j+1): int4 represents it exactly, so the result is exact
    rows = torch.tensor([[(r + 1.0) * (j + 1)] * R for j in range(n)])
    if planted:      # forget the swizzle: send the rows in rank order to the local peers
        from zerolab.engine.zeropp.engine import a2a_reduce
        m, k = n // c.ranks_per_node, c.ranks_per_node
        part = a2a_reduce(c.intra, rows.reshape(k, m, R), 7, "x")
        return a2a_reduce(c.inter, part.view(m, 1, R), 7, "y")[0].tolist()
    return qgz_reduce(c, rows.reshape(-1), group=7).tolist()


@pytest.mark.parametrize("n, k", [(4, 2), (4, 4), (4, 1)])
def test_qgz_hierarchical_all_to_all_gives_each_rank_its_shard(n, k):
    tri = n * (n + 1) / 2
    for rank, out in enumerate(zl.launch(_qgz_worker, n, args=(False,), ranks_per_node=k)):
        assert out == pytest.approx([tri * (rank + 1)] * 24, rel=1e-6)


def test_qgz_without_swizzle_planted_is_caught():
    res = zl.launch(_qgz_worker, 4, args=(True,), ranks_per_node=2)
    assert any(out != pytest.approx([10 * (rank + 1)] * 24, rel=1e-6) for rank, out in enumerate(res))


# ---------------------------------------------------------------- the engine: bytes, memory, accuracy
class ForwardOnlyQwZ(ZeroPPEngine):
    """Planted: quantizes only the forward gather (what comm_breakdown used to assume)."""

    def fetch_unit(self, i):
        if self._in_backward and self.hpz_comm is None:
            return super(ZeroPPEngine, self).fetch_unit(i)
        return super().fetch_unit(i)


def _train(flags, steps, engine_cls=None, seed=1):
    rank, n = dist.get_rank(), dist.get_world_size()
    model = TinyGPT.preset("micro", seed=seed)
    cfg = {"optimizer": {"type": "Adam", "params": {"lr": 3e-3}}, "bf16": {"enabled": True},
           "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0,
                                 "stage3_max_reuse_distance": 0, "stage3_prefetch_bucket_size": 0, **flags},
           # units "rest + blocks": every unit holds a matrix, so qgZ quantizes all of them, as _predicted
           # assumes (with the default units the final norm is a unit of vectors: plain reduce-scatter)
           "zerolab": {"units": ["Block"]}}
    e = zl.initialize(model, cfg)
    if engine_cls is not None:
        e.close()
        model = TinyGPT.preset("micro", seed=seed)
        e = engine_cls(model, zl.Config.from_deepspeed(cfg))
    e.comm.reset()
    losses = []
    for s in range(steps):
        x, y = synthetic_batch(model, 4 * n, seed=3, step=s, rank=rank, world_size=n)
        loss = loss_fn(e(x), y)
        e.backward(loss)
        e.step()
        total = loss.detach().float().reshape(1)
        dist.all_reduce(total)
        losses.append(total.item() / n)
    return e, losses


def _predicted(e, flags, steps):
    k = e.communicator.ranks_per_node
    ops = comm_breakdown(e.flat.numel, e.world_size, 3, 2, 1, k,
                         quantized_weights=bool(flags.get("zero_quantized_weights")),
                         quantized_gradients=bool(flags.get("zero_quantized_gradients")),
                         hpz=flags.get("zero_hpz_partition_size", 1),
                         units=[u.numel for u in e.flat.units], weight_group=e.config.qwz_group_size,
                         gradient_group=getattr(e, "qgz_groups", [1])[0])
    split = split_intra_inter(ops)
    return {k2: v * steps for k2, v in split.items()}


def _bytes_worker(steps):
    out = {}
    for name, flags in FLAGS.items():
        e, losses = _train(flags, steps)
        assert len(e.buckets) == 1
        out[name] = dict(inter=e.comm.total_bytes(scope="inter"), intra=e.comm.total_bytes(scope="intra"),
                         predicted=_predicted(e, flags, steps), losses=losses, params=e.memory().params,
                         padded=e.flat.padded, shard=e.flat.shard_numel,
                         state=[p.detach().float().clone() for p in e.full_state_dict().values()])
        e.close()
    e, _ = _train(FLAGS["qwZ"], steps, engine_cls=ForwardOnlyQwZ)
    out["planted"] = dict(inter=e.comm.total_bytes(scope="inter"), predicted=_predicted(e, FLAGS["qwZ"], steps))
    return out


@pytest.fixture(scope="module")
def two_by_two():
    """4 ranks as 2 nodes x 2, 30 steps of TinyGPT (micro) per variant: every rank's results."""
    return zl.launch(_bytes_worker, 4, args=(30,), ranks_per_node=2, timeout=600)


def test_inter_and_intra_bytes_equal_comm_breakdown(two_by_two):
    for res in two_by_two:
        for name in FLAGS:
            r = res[name]
            assert (r["inter"], r["intra"]) == (r["predicted"]["inter"], r["predicted"]["intra"]), name
        assert res["planted"]["inter"] != res["planted"]["predicted"]["inter"]   # forward-only qwZ is caught
        base, allpp = res["zero3"]["inter"], res["all"]["inter"]
        # the paper's 4x less cross-node traffic: 2 x 2 nodes would give 4.5x without scales; the micro
        # model's 32-element qgZ groups (DeepSpeed's rule for 32-wide matrices) add 1 byte per 4 of int4
        assert 3.9 < base / allpp < 4.5


def test_hpz_is_exact_and_holds_its_secondary_partition(two_by_two):
    for res in two_by_two:
        z3, hpz = res["zero3"], res["hpZ"]
        assert hpz["losses"] == z3["losses"]                 # the same weights, gathered inside the node
        assert all(torch.equal(a, b) for a, b in zip(hpz["state"], z3["state"]))
        assert hpz["params"] == z3["params"] + 2 * hpz["padded"] // 2    # bf16 secondary: padded Ψ / H
        assert z3["params"] == 2 * z3["shard"]
        est = zl.estimate(hpz["padded"], 4, 3, hpz_partition_size=2)
        assert hpz["params"] == est.params


def test_quantized_training_stays_within_a_few_percent_of_zero3(two_by_two):
    res = two_by_two[0]
    exact = res["zero3"]["losses"]
    assert exact[-1] < 0.9 * exact[0]                        # it learns
    for name in ("qwZ", "qgZ", "all"):
        gap = abs(res[name]["losses"][-1] - exact[-1]) / exact[-1]
        assert gap < 0.03, (name, gap)
        assert res[name]["losses"] != exact                  # and it did quantize
    assert all(r["all"]["losses"] == res["all"]["losses"] for r in two_by_two)   # every rank agrees


# ---------------------------------------------------------------- bad input
def _bad_worker(zero, extra):
    model = TinyGPT.preset("micro", seed=0)
    try:
        zl.initialize(model, {"optimizer": {"type": "Adam"}, "zero_optimization": {"stage": 3, **zero}, **extra})
    except zl.ConfigError as err:
        return str(err)
    return "accepted"


def test_hpz_size_must_divide_ranks_per_node():
    msgs = zl.launch(_bad_worker, 4, args=({"zero_hpz_partition_size": 4}, {"bf16": {"enabled": True}}),
                     ranks_per_node=2)
    assert all("zero_hpz_partition_size" in m and "ranks per node (2)" in m for m in msgs)


@pytest.mark.parametrize("cfg, match", [
    ({"zero_optimization": {"stage": 2, "zero_hpz_partition_size": 2}}, "need stage 3"),
    ({"zero_optimization": {"stage": 3, "zero_quantized_gradients": True}}, "zero_quantized_gradients needs 16-bit"),
    ({"zero_optimization": {"stage": 3, "zero_quantized_weights": True, "offload_optimizer": {"device": "cpu"}}},
     "offload"),
    ({"zerolab": {"qwz_group_size": 0}}, "zerolab.qwz_group_size"),
    ({"zerolab": {"link": {"intra": "nvlink3"}}}, "'intra' and 'inter'"),
    ({"zerolab": {"link": {"intra": "nvlink3", "inter": "pigeon"}}}, "zerolab.link.inter"),
])
def test_bad_zeropp_config_is_a_config_error(cfg, match):
    with pytest.raises(zl.ConfigError, match=match):
        zl.Config.from_deepspeed(cfg)


def test_group_sizes_and_tier_links_are_read():
    c = zl.Config.from_deepspeed({"zerolab": {"qwz_group_size": 512, "qgz_group_size": 64,
                                              "link": {"intra": "nvlink3", "inter": "ethernet-10g"}}})
    assert (c.qwz_group_size, c.qgz_group_size, c.link) == (512, 64, {"intra": "nvlink3", "inter": "ethernet-10g"})
    assert zl.Config.from_deepspeed({}).qwz_group_size == 8000


# ---------------------------------------------------------------- 8 ranks as 2 x 4 (out of make test)
@pytest.mark.skipif(os.environ.get("ZEROLAB_LONG") != "1", reason="8 ranks: set ZEROLAB_LONG=1 (kept out of make test)")
def test_eight_ranks_as_two_nodes_of_four():
    variants = {**FLAGS, "hpZ-2": {"zero_hpz_partition_size": 2}, "hpZ-4": {"zero_hpz_partition_size": 4}}
    variants.pop("hpZ")
    variants["all"] = {**variants["all"], "zero_hpz_partition_size": 4}

    def worker():
        out = {}
        for name, flags in variants.items():
            e, losses = _train(flags, 3)
            out[name] = (e.comm.total_bytes(scope="inter"), e.comm.total_bytes(scope="intra"),
                         _predicted(e, flags, 3), losses[-1])
            e.close()
        return out
    for res in zl.launch(worker, 8, ranks_per_node=4, timeout=900):
        for name, (inter, intra, predicted, _) in res.items():
            assert (inter, intra) == (predicted["inter"], predicted["intra"]), name
        assert res["hpZ-4"][3] == res["zero3"][3] == res["hpZ-2"][3]
        assert res["zero3"][0] / res["all"][0] > 3.5


def _gathered_worker():
    model = TinyGPT.preset("micro", seed=1)
    e = zl.initialize(model, {"optimizer": {"type": "Adam"}, "bf16": {"enabled": True},
                              "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0,
                                                    "zero_quantized_weights": True}})
    before = e.full_state_dict()
    with zl.gathered_parameters(e, model.blocks[0], modifier_rank=0):
        read = model.blocks[0].attn.q.weight.detach().float().clone()
    after = e.full_state_dict()
    exact = before["blocks.0.attn.q.weight"].bfloat16().float()
    return torch.equal(read, exact), all(torch.equal(before[k], after[k]) for k in before)


def test_gathered_parameters_under_qwz_are_exact_and_write_back_nothing():
    """Planted: with int8 gathers inside gathered_parameters, the read differs and modifier_rank writes
    the rounded weights back into every shard."""
    for read_exact, unchanged in zl.launch(_gathered_worker, 2):
        assert read_exact and unchanged


def _accumulation_worker(planted):
    rank, n = dist.get_rank(), dist.get_world_size()
    shards = {}
    for name, flags in (("zero3", {}), ("qgZ", {"zero_quantized_gradients": True})):
        model = TinyGPT.preset("micro", seed=1)
        e = zl.initialize(model, {"optimizer": {"type": "Adam"}, "bf16": {"enabled": True},
                                  "gradient_accumulation_steps": 2,
                                  "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0, **flags}})
        for micro in range(2):
            if planted and flags and micro == 1:   # planted: the second micro-batch overwrites the shard
                e.micro_steps = 0
            x, y = synthetic_batch(model, 4 * n, seed=3, step=micro, rank=rank, world_size=n)
            e.backward(loss_fn(e(x), y))
            if micro == 0:
                e.step()
        shards[name] = e.grad_shard.float().clone()
        e.close()
    return float((shards["qgZ"] - shards["zero3"]).norm() / shards["zero3"].norm())


def test_qgz_accumulates_micro_batches():
    errors = zl.launch(_accumulation_worker, 4, args=(False,), ranks_per_node=2)
    assert max(errors) < 0.25, errors             # int4 noise on the sum of two micro-batches (about 0.1)
    planted = zl.launch(_accumulation_worker, 4, args=(True,), ranks_per_node=2)
    assert min(planted) > 0.45, planted           # one micro-batch lost (about 0.7)
