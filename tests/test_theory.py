"""The memory and communication model (zerolab.theory.memory, chapters 1-2)."""
import itertools

import pytest

import zerolab as zl
from zerolab.theory import network
from zerolab.theory import (GB, OPTIMIZERS, PRECISIONS, activation_memory, comm_breakdown, comm_volume,
                            deepspeed_estimate, estimate, format_paper_gb, step_comm_time, zero_table1)
from zerolab.theory.comm import split_intra_inter

# ZeRO paper (Rajbhandari et al., SC'20), Table 1, as printed: per-device GB for
# DP degree -> (7.5B: Pos, Pos+g, Pos+g+p, 128B: ..., 1T: ...).
PAPER_TABLE1 = {
    1:    ("120", "120", "120", "2048", "2048", "2048", "16000", "16000", "16000"),
    4:    ("52.5", "41.3", "30", "896", "704", "512", "7000", "5500", "4000"),
    16:   ("35.6", "21.6", "7.5", "608", "368", "128", "4750", "2875", "1000"),
    64:   ("31.4", "16.6", "1.88", "536", "284", "32", "4187", "2218", "250"),
    256:  ("30.4", "15.4", "0.47", "518", "263", "8", "4046", "2054", "62.5"),
    1024: ("30.1", "15.1", "0.12", "513", "257", "2", "4011", "2013", "15.6"),
}
MODELS = (7.5e9, 128e9, 1e12)


@pytest.mark.parametrize("n", sorted(PAPER_TABLE1))
def test_zero_paper_table1_every_cell(n):
    table = zero_table1()
    for (psi, stage), printed in zip(itertools.product(MODELS, (1, 2, 3)), PAPER_TABLE1[n]):
        gb = table[(psi, n, stage)]
        unit = 1 if gb >= 100 else (0.1 if gb >= 10 else 0.01)
        assert abs(gb - float(printed)) < unit, (psi, n, stage, gb, printed)   # agrees to printed precision
        assert format_paper_gb(gb) == printed, (psi, n, stage, gb, printed)   # and prints the same


def test_seed_figures_7_5b_on_64():
    assert [round(estimate(7.5e9, 64, s).gb(), 1) for s in (0, 1, 2, 3)] == [120.0, 31.4, 16.6, 1.9]
    e = estimate(7.5e9, 1, 0)
    assert (e.params, e.grads, e.optimizer) == (15 * GB, 15 * GB, 90 * GB)


# bytes per parameter (params, grads, optimizer), written out independently of the code
PER_PARAM = {
    ("fp32", "adam"): (4, 4, 8), ("fp32", "adamw"): (4, 4, 8),
    ("fp32", "sgd_momentum"): (4, 4, 4), ("fp32", "sgd"): (4, 4, 0),
    ("mixed", "adam"): (2, 2, 12), ("mixed", "adamw"): (2, 2, 12),
    ("mixed", "sgd_momentum"): (2, 2, 8), ("mixed", "sgd"): (2, 2, 4),
    ("mixed_fp32_grads", "adam"): (2, 4, 12), ("mixed_fp32_grads", "adamw"): (2, 4, 12),
    ("mixed_fp32_grads", "sgd_momentum"): (2, 4, 8), ("mixed_fp32_grads", "sgd"): (2, 4, 4),
}


@pytest.mark.parametrize("precision,optimizer", sorted(PER_PARAM))
def test_per_stage_formulas(precision, optimizer):
    p, g, k = PER_PARAM[(precision, optimizer)]
    psi, n = 1_200_000, 8
    expect = {0: (p * psi, g * psi, k * psi), 1: (p * psi, g * psi, k * psi // n),
              2: (p * psi, g * psi // n, k * psi // n), 3: (p * psi // n, g * psi // n, k * psi // n)}
    for stage, (ep, eg, ek) in expect.items():
        e = estimate(psi, n, stage, precision, optimizer)
        assert (e.params, e.grads, e.optimizer, e.total) == (ep, eg, ek, ep + eg + ek)
        assert (e.host, e.nvme) == (0, 0)


def test_padding_uses_ceil_shards():
    e = estimate(10, 4, 3)                       # 10 params on 4 ranks -> shards of 3
    assert (e.params, e.grads, e.optimizer) == (6, 6, 36)


@pytest.mark.parametrize("precision,optimizer", sorted(PER_PARAM))
def test_properties_monotonic_and_n1(precision, optimizer):
    for psi, n in [(7.5e9, 64), (1e6 + 3, 7), (12345, 1)]:
        totals = [estimate(psi, n, s, precision, optimizer).total for s in range(4)]
        assert totals == sorted(totals, reverse=True)
        if n == 1:
            assert len(set(totals)) == 1
    for s in range(4):
        a, b = estimate(5e8, 1, s, precision, optimizer), estimate(5e8, 1, 0, precision, optimizer)
        assert (a.params, a.grads, a.optimizer) == (b.params, b.grads, b.optimizer)


def test_offload_moves_bytes_without_losing_them():
    """Optimizer offload as ZeRO-Offload and DeepSpeed do it (issue 14): the optimizer state and
    an fp32 gradient shard go to the host; the device keeps the parameters (stage 2: 2Ψ,
    stage 3: 2Ψ/N in mixed precision), the host 16Ψ/N per rank."""
    psi, n = 7.5e9, 64
    shard = psi / n
    base = estimate(psi, n, 3)
    opt_cpu = estimate(psi, n, 3, offload_optimizer="cpu")
    assert (opt_cpu.params, opt_cpu.grads, opt_cpu.optimizer, opt_cpu.nvme) == (base.params, 0, 0, 0)
    assert opt_cpu.total == 2 * shard and opt_cpu.host == 16 * shard
    both = estimate(psi, n, 3, offload_optimizer="nvme", offload_param="cpu")
    assert (both.params, both.grads, both.optimizer) == (0, 0, 0)
    assert (both.host, both.nvme) == (base.params + 4 * shard, base.optimizer)
    both_nvme = estimate(psi, n, 3, offload_optimizer="nvme", offload_param="nvme")
    assert both_nvme.nvme == base.params + base.optimizer and both_nvme.total == 0 and both_nvme.host == 4 * shard
    for e in (opt_cpu, both, both_nvme):      # the fp32 gradient shard replaces the 16-bit one: +2Ψ/N
        assert e.all_tiers == base.total + 2 * shard
    z2 = estimate(psi, 8, 2, offload_optimizer="cpu")
    assert (z2.total, z2.grads, z2.host) == (2 * psi, 0, 16 * psi / 8)
    z1 = estimate(psi, 8, 1, offload_optimizer="cpu")
    assert (z1.params, z1.grads, z1.host) == (2 * psi, 2 * psi, 16 * psi / 8)   # stage 1 accumulates whole grads
    f3 = estimate(psi, n, 3, precision="fp32", offload_optimizer="cpu")
    assert (f3.total, f3.host) == (4 * shard, 12 * shard)                       # no master in fp32


def test_offload_agrees_with_deepspeeds_estimator_on_the_device():
    """DeepSpeed's documented formulas (docs/MEASUREMENTS.md): ZeRO-2 + offload: 2Ψ on the GPU;
    ZeRO-3 + optimizer offload: 4 x largest layer + 2Ψ/N = our .total + gathered_working_set."""
    from zerolab.theory import gathered_working_set
    psi, n, largest = 7_000_000_000, 64, 200_000_000
    assert estimate(psi, n, 2, offload_optimizer="cpu").total == deepspeed_estimate(psi, n, 2, offload_optimizer=True).gpu
    ours = estimate(psi, n, 3, offload_optimizer="cpu").total + gathered_working_set(largest)
    ds = deepspeed_estimate(psi, n, 3, largest_layer=largest, offload_optimizer=True).gpu
    assert abs(ours - ds) <= 1
    # host, per node of 8: ours 16Ψ/N per rank x 8 ranks = DeepSpeed's 16Ψ/nodes before its 1.5 factor
    host_node = 8 * estimate(psi, n, 3, offload_optimizer="cpu").host
    assert abs(host_node * 1.5 - deepspeed_estimate(psi, n, 3, largest_layer=largest, offload_optimizer=True,
                                                    gpus_per_node=8).cpu) <= 2
    with pytest.raises(ValueError, match="largest_layer"):
        gathered_working_set(0)


def test_against_installed_deepspeed():
    """The same comparison against DeepSpeed's own functions, where DeepSpeed is installed."""
    from zerolab.bench.peers import deepspeed_available
    if not deepspeed_available():
        pytest.skip("DeepSpeed is not installed (pip install -e '.[bench]')")
    from deepspeed.runtime.zero.stage3 import estimate_zero3_model_states_mem_needs
    from deepspeed.runtime.zero.stage_1_and_2 import estimate_zero2_model_states_mem_needs
    from zerolab.theory import gathered_working_set
    psi, largest = 7_000_000_000, 200_000_000
    _, gpu2 = estimate_zero2_model_states_mem_needs(psi, 8, 8, cpu_offload=True)
    assert gpu2 == estimate(psi, 64, 2, offload_optimizer="cpu").total
    _, gpu3, _ = estimate_zero3_model_states_mem_needs(psi, largest, 8, 8, cpu_offload=True,
                                                       cpu_offload_params=False)
    assert abs(gpu3 - estimate(psi, 64, 3, offload_optimizer="cpu").total - gathered_working_set(largest)) <= 1


@pytest.mark.parametrize("kwargs,names", [
    (dict(stage=5), ["stage", "(0, 1, 2, 3)"]),
    (dict(stage=1, offload_param="cpu"), ["offload_param", "stage 3"]),
    (dict(stage=0, offload_optimizer="cpu"), ["offload_optimizer", "stage 1, 2 or 3"]),
    (dict(precision="fp8"), ["precision", "mixed_fp32_grads"]),
    (dict(optimizer="lamb"), ["optimizer", "sgd_momentum"]),
    (dict(stage=3, offload_param="disk"), ["offload_param", "nvme"]),
    (dict(n_gpus=0), ["n_gpus", ">= 1"]),
    (dict(psi=0), ["psi", "> 0"]),
    (dict(psi=-5), ["psi", "> 0"]),
])
def test_bad_input_names_argument_and_allowed(kwargs, names):
    args = dict(psi=1e9, n_gpus=8, stage=2) | kwargs
    with pytest.raises(ValueError) as err:
        estimate(**args)
    for name in names:
        assert name in str(err.value)


def test_lazy_exports():
    assert zl.estimate is estimate and zl.comm_volume is comm_volume
    assert zl.activation_memory is activation_memory
    assert set(PRECISIONS) == {"fp32", "mixed", "mixed_fp32_grads"} and "adam" in OPTIMIZERS


# ---- activations ----

def test_activation_memory_korthikanti():
    L, h, a, s, b = 24, 2048, 16, 2048, 4
    per_layer = s * b * h * (34 + 5 * a * s / h)         # the paper's 16-bit formula, bytes
    assert activation_memory(L, h, a, s, b) == L * per_layer
    assert activation_memory(L, h, a, s, b, checkpointing=True) == L * 2 * s * b * h + per_layer
    # fp32: every 16-bit tensor doubles, the 1-byte dropout masks do not: 66 sbh + 9 a s^2 b
    assert activation_memory(L, h, a, s, b, dtype_bytes=4) == L * (66 * s * b * h + 9 * a * s * s * b)
    assert activation_memory(L, h, a, s, b, checkpointing=True) < activation_memory(L, h, a, s, b) / 10
    with pytest.raises(ValueError, match="heads"):
        activation_memory(L, h, 0, s, b)


# ---- DeepSpeed's estimators ----

def test_deepspeed_estimators():
    psi, n, largest = 7_000_000_000, 64, 200_000_000
    assert deepspeed_estimate(psi, n, 2).gpu == 2 * psi + 18 * psi // n
    assert deepspeed_estimate(psi, n, 2, offload_optimizer=True).gpu == 2 * psi
    assert deepspeed_estimate(psi, n, 3, largest_layer=largest).gpu == 4 * largest + 18 * psi // n
    assert deepspeed_estimate(psi, n, 3, largest_layer=largest, offload_optimizer=True).gpu \
        == 4 * largest + 2 * psi // n
    off = deepspeed_estimate(psi, n, 3, largest_layer=largest, offload_optimizer=True, offload_param=True,
                             gpus_per_node=8)
    assert off.gpu == 4 * largest and off.cpu == int(psi * 18 / 8 * 1.5)
    # the 1.5 buffer factor scales only the CPU figure
    a = deepspeed_estimate(psi, n, 2, gpus_per_node=8)
    b = deepspeed_estimate(psi, n, 2, gpus_per_node=8, buffer_factor=1.0)
    assert a.gpu == b.gpu and a.cpu == int(1.5 * b.cpu) == int(psi * 4 * 8 * 1.5)
    # ours is smaller than DeepSpeed's ZeRO-2 figure by exactly 4 psi / N (its fp32 gradient partition)
    assert deepspeed_estimate(psi, n, 2).gpu - estimate(psi, n, 2).total == 4 * psi // n
    with pytest.raises(ValueError, match="largest_layer"):
        deepspeed_estimate(psi, n, 3)


# ---- communication ----

@pytest.mark.parametrize("n", [1, 2, 4, 8, 64])
def test_comm_volume_closed_forms(n):
    psi, d = 8_000_000 * 64, 2                          # divisible by every n: no padding
    m = psi * d
    for stage in (0, 1, 2):
        assert comm_volume(psi, n, stage) == 2 * m * (n - 1) // n
    assert comm_volume(psi, n, 3) == 3 * m * (n - 1) // n
    for g in (1, 2, 5):
        assert comm_volume(psi, n, 0, grad_accum=g) == 2 * m * (n - 1) // n
        assert comm_volume(psi, n, 1, grad_accum=g) == 2 * m * (n - 1) // n
        assert comm_volume(psi, n, 2, grad_accum=g) == (g + 1) * m * (n - 1) // n
        assert comm_volume(psi, n, 3, grad_accum=g) == 3 * g * m * (n - 1) // n


def test_comm_volume_is_sum_of_ring_bytes():
    for psi, n, stage, g, gpn, flags in itertools.product(
            (1000, 7.5e9, 12_345_679), (1, 3, 16), range(4), (1, 3), (None, 4), ((0, 0, 0), (1, 1, 1), (1, 0, 0))):
        if stage < 3 and any(flags) or (flags[2] and gpn is None):
            continue
        qw, qg, hpz = map(bool, flags)
        ops = comm_breakdown(psi, n, stage, 2, g, gpn, qw, qg, hpz)
        by_hand = sum(op.count * network.ring_bytes(op.op, op.nbytes, op.group) for op in ops)
        assert comm_volume(psi, n, stage, 2, g, gpn, qw, qg, hpz) == by_hand
        split = split_intra_inter(ops)
        assert split["intra"] + split["inter"] == by_hand


def test_zeropp_flags():
    psi, n, gpn = 64_000_000, 64, 8
    m, r, nodes = 2 * psi, 63 / 64, n // gpn
    ops = {o.what: o for o in comm_breakdown(psi, n, 3, gpus_per_node=gpn)}
    assert ops["params-forward"].bytes == m * r and ops["grads"].bytes == m * r
    s = psi // n                                                # a rank's shard (no padding here)
    w_scales, g_scales = 4 * -(-s // 8000), 4 * -(-s // 4096)  # fp32 scale per group of a shard
    qw = comm_volume(psi, n, 3, quantized_weights=True)
    qg = comm_volume(psi, n, 3, quantized_gradients=True)
    # qwZ: both gathers (forward and backward) send int8 + scales instead of 16-bit
    assert comm_volume(psi, n, 3) - qw == 2 * (m * r - (n - 1) * (s + w_scales))
    # qgZ on one node: one int4 all-to-all (+ scales) instead of the 16-bit reduce-scatter
    assert comm_volume(psi, n, 3) - qg == m * r - (n - 1) * (s // 2 + g_scales)
    allpp = comm_breakdown(psi, n, 3, gpus_per_node=gpn, quantized_weights=True,
                           quantized_gradients=True, hpz=True)
    split = split_intra_inter(allpp)
    fwd = (n - 1) * (s + w_scales) * nodes / n                  # int8 forward gather: 1/K of the ring crosses
    inter_a2a = (nodes - 1) * (s // 2 + g_scales)               # int4 all-to-all among the 8 nodes: all crosses
    assert split["inter"] == round(fwd) + inter_a2a
    plain = split_intra_inter(comm_breakdown(psi, n, 3, gpus_per_node=gpn))
    assert plain == {"intra": 3 * m * r * 7 / 8, "inter": 3 * m * r / 8}   # a ring: 8 of its 64 links cross
    # per node (x K ranks): the paper's 3M -> about 0.75M (0.5M + 0 + 0.25M, plus the scales)
    assert plain["inter"] * gpn == 3 * m * r
    assert 0.7 < split["inter"] * gpn / m < 0.75 * 1.01 and plain["inter"] / split["inter"] > 4
    one_node = split_intra_inter(comm_breakdown(psi, 8, 3, gpus_per_node=8))
    assert one_node["inter"] == 0
    with pytest.raises(ValueError, match="stage 3"):
        comm_volume(psi, n, 2, quantized_weights=True)
    with pytest.raises(ValueError, match="gpus_per_node"):
        comm_volume(psi, n, 3, hpz=True)
    with pytest.raises(ValueError, match="units"):
        comm_volume(psi, n, 3, units=[psi - 1])
    with pytest.raises(ValueError, match="hpz"):
        comm_volume(psi, n, 3, gpus_per_node=8, hpz=3)


def test_estimate_hpz_adds_secondary_partition():
    psi, n = 13e9, 64
    base, hpz = zl.estimate(psi, n, 3), zl.estimate(psi, n, 3, hpz_partition_size=8)
    assert hpz.hpz == 2 * psi / 8 and hpz.params == base.params + hpz.hpz      # 2Ψ/H on top of 2Ψ/N
    assert zl.estimate(psi, n, 3, precision="fp32", hpz_partition_size=8).hpz == 4 * psi / 8
    with pytest.raises(ValueError, match="stage 3"):
        zl.estimate(psi, n, 2, hpz_partition_size=8)
    with pytest.raises(ValueError, match="dividing"):
        zl.estimate(psi, n, 3, hpz_partition_size=3)


def test_step_comm_time_alpha_beta():
    psi, n = 1_000_000_000, 8
    link = network.LINKS["nvlink3"]
    t = step_comm_time(psi, n, 0, "nvlink3")
    assert t == pytest.approx(2 * (n - 1) * link.latency + 2 * 2 * psi * (n - 1) / n / link.bandwidth)
    # stage 3 with g=2: 6 collectives of n-1 steps each
    t3 = step_comm_time(psi, n, 3, link, grad_accum=2)
    assert t3 == pytest.approx(6 * ((n - 1) * link.latency + 2 * psi * (n - 1) / n / link.bandwidth))
    # buckets add latency only
    tb = step_comm_time(psi, n, 0, link, bucket_elems=psi // 10)
    assert tb - t == pytest.approx(9 * 2 * (n - 1) * link.latency)
    # spanning nodes: world collectives use the inter-node link
    ib = network.LINKS["infiniband-200g"]
    t16 = step_comm_time(psi, 16, 3, link, inter_link=ib, gpus_per_node=8)
    assert t16 == pytest.approx(3 * ib.time("all_gather", 2 * psi, 16))
    thpz = step_comm_time(psi, 16, 3, link, inter_link=ib, gpus_per_node=8, hpz=True)
    assert thpz == pytest.approx(2 * ib.time("all_gather", 2 * psi, 16) + link.time("all_gather", 2 * psi, 8))
    assert step_comm_time(psi, 1, 3, link) == 0


def test_estimate_config_reads_stage_precision_optimizer_offload():
    from zerolab.config import estimate_config
    ds = {"bf16": {"enabled": True}, "data_types": {"grad_accum_dtype": "fp32"},
          "optimizer": {"type": "SGD", "params": {"lr": 0.1, "momentum": 0.9}},
          "zero_optimization": {"stage": 3, "offload_optimizer": {"device": "cpu"}}}
    e = estimate_config(1000, 4, ds)
    assert (e.stage, e.precision, e.optimizer_name, e.offload_optimizer) == (3, "mixed_fp32_grads", "sgd_momentum", "cpu")
    assert (e.params, e.grads, e.optimizer, e.host) == (2 * 250, 0, 0, 8 * 250 + 4 * 250)   # fp32 grads on the host
    plain = estimate_config(1000, 4, {"optimizer": {"type": "SGD", "params": {"lr": 0.1}}})
    assert (plain.precision, plain.optimizer_name, plain.total) == ("fp32", "sgd", 8 * 1000)


def test_table1_text_matches_paper_rows():
    from zerolab.theory import table1_text
    lines = table1_text().splitlines()
    assert lines[0].split()[:4] == ["DP", "7.5B", "Pos", "7.5B"] and len(lines) == 1 + len(PAPER_TABLE1)
    for line, (n, cells) in zip(lines[1:], sorted(PAPER_TABLE1.items())):
        assert line.split() == [str(n), *cells]
