"""What the engines hold and send, measured, against theory (issue 4, items 7 and 8)."""
from __future__ import annotations

import gc

import pytest
import torch
import torch.distributed as dist

import zerolab as zl
from zerolab.runtime.measure import census, settled_census  # noqa: F401 (other tests import it from here)
from zerolab.theory import bytes_per_param
from zerolab.book.models import MLP, TinyGPT, loss_fn, synthetic_batch

PRECISIONS = {"fp32": {}, "mixed": {"bf16": {"enabled": True}},
              "mixed_fp32_grads": {"bf16": {"enabled": True}, "data_types": {"grad_accum_dtype": "fp32"}}}


def memory_worker(cases, with_census):
    """After backward, before step: memory() by field, and the census of live tensors."""
    rank, n = dist.get_rank(), dist.get_world_size()
    # what the forked rank inherited goes to gc's permanent generation, out of the census's
    # walk (a full walk of pytest's ~400k objects takes ~1 s); everything made after is seen
    gc.collect()
    gc.freeze()
    out = []
    for stage, prec, bucket in cases:
        base = settled_census() if with_census else 0  # what this (forked) process held before the model
        model = TinyGPT.preset("micro", seed=1) if bucket else MLP(frozen=True, unused=True, buffer=True)
        engine = zl.initialize(model, {"optimizer": {"type": "Adam", "params": {"lr": 1e-3}},
                                       "zero_optimization": {"stage": stage, "reduce_bucket_size": bucket or 700},
                                       **PRECISIONS[prec]})
        x, y = synthetic_batch(model, 2 * n, seed=3, rank=rank, world_size=n)
        loss = loss_fn(engine(x), y)
        engine.backward(loss)
        del x, y, loss
        mem = engine.memory()
        held = settled_census() - base if with_census else None
        out.append((mem.as_dict(), held, engine.flat.numel, engine.flat.padded))
        engine.step()
        del engine, model
    gc.unfreeze()
    return out


@pytest.mark.parametrize("n", [2, 3])
def test_memory_equals_estimate_and_census(n):
    cases = [(s, p, b) for s in (0, 1, 2) for p in PRECISIONS for b in ((2000, 10**8) if s == 2 else (2000,))]
    results = zl.launch(memory_worker, world_size=n, args=(cases, True), timeout=300, threads=1)
    for rank_results in results:
        for (stage, prec, bucket), (mem, held, psi, padded) in zip(cases, rank_results):
            exact = zl.estimate(padded, n, stage, precision=prec)   # the formula on the padded Ψ
            assert (mem["params"], mem["grads"], mem["optimizer"]) == (exact.params, exact.grads, exact.optimizer), \
                (n, stage, prec, mem, exact)
            loose = zl.estimate(psi, n, stage, precision=prec)      # the formula on Ψ itself
            assert 0 <= mem["total"] - loose.total <= sum(bytes_per_param(prec)) * (padded - psi)
            # nothing held is left out of the report: the census of live tensors agrees to the byte
            assert held is None or held == mem["total"] + mem["buffers"], (n, stage, prec, bucket, held, mem)


def comm_worker(cases, collectives="reduce_scatter"):
    rank, n = dist.get_rank(), dist.get_world_size()
    out = []
    for stage, prec, gas, bucket in cases:
        model = TinyGPT.preset("micro", seed=1)
        engine = zl.initialize(model, {"optimizer": {"type": "SGD", "params": {"lr": 1e-2}},
                                       "gradient_accumulation_steps": gas,
                                       "zero_optimization": {"stage": stage, "reduce_bucket_size": bucket,
                                                             "allgather_bucket_size": bucket},
                                       "zerolab": {"collectives": collectives}, **PRECISIONS[prec]})
        engine.comm.reset()  # the broadcast at initialize is not part of a step
        for k in range(gas):
            x, y = synthetic_batch(model, 2 * n * gas, seed=3, step=k, rank=rank, world_size=n)
            engine.backward(loss_fn(engine(x), y))
            engine.step()
        recs = [(r.op, r.bytes, r.numel, r.tag) for r in engine.comm.records]
        out.append((recs, engine.flat.padded, len(engine.buckets), len(engine.flat.units),
                    [sum(u.padded for u in b) for b in engine.buckets],
                    [u.padded for b in engine.buckets for u in b],
                    [u.padded for b in engine.buckets for u in reversed(b)]))   # backward order
    return out


@pytest.mark.parametrize("n", [2, 3, 4])
def test_ledger_bytes_equal_comm_volume(n):
    cases = [(s, p, g, b) for s in (0, 1, 2) for p, g in (("fp32", 1), ("mixed", 3), ("mixed_fp32_grads", 2))
             for b in (1500, 10**8)]
    results = zl.launch(comm_worker, world_size=n, args=(cases,), timeout=300, threads=1)
    for rank_results in results:
        for (stage, prec, gas, bucket), (recs, padded, nb, n_units, bucket_numels, unit_numels, backward) in \
                zip(cases, rank_results):
            by_op = {}
            for op, nbytes, _, _ in recs:
                by_op[op] = by_op.get(op, 0) + nbytes
            grad_bytes = 2 if prec == "mixed" else 4       # gradients are reduced in their accumulation dtype
            param_bytes = 4 if prec == "fp32" else 2
            theory_grads = {o.op: o.bytes for o in zl.theory.comm_breakdown(padded, n, stage, grad_bytes, gas)}
            theory_params = {o.op: o.bytes for o in zl.theory.comm_breakdown(padded, n, stage, param_bytes, gas)}
            if stage == 0:
                assert by_op == {"all_reduce": theory_grads["all_reduce"]}
                assert by_op["all_reduce"] == zl.comm_volume(padded, n, 0, grad_bytes, gas)
            else:
                assert by_op == {"reduce_scatter": theory_grads["reduce_scatter"],
                                 "all_gather": theory_params["all_gather"]}, (stage, prec, gas, by_op)
                if grad_bytes == param_bytes:
                    assert sum(by_op.values()) == zl.comm_volume(padded, n, stage, grad_bytes, gas)
            # bucket sizes show as the number and size of the collectives
            reductions = [numel for op, _, numel, _ in recs if op in ("all_reduce", "reduce_scatter")]
            rounds = gas if stage == 2 else 1
            # stages 1-2 reduce-scatter a bucket unit by unit (no packing copy); stage 2 each unit as soon as
            # its gradients are in, in backward order (no whole-bucket staging)
            assert reductions == {0: bucket_numels, 1: unit_numels, 2: backward * rounds}[stage]
            assert len([r for r in recs if r[0] == "all_gather"]) == (n_units if stage else 0)   # unit by unit
            if bucket == 1500:
                assert nb == 5  # small buckets: one unit each (rest: tied wte/head, wpe, 2 blocks, ln_f)
            else:
                assert nb == 1


def no_reduce_scatter_worker(stage):
    rank, n = dist.get_rank(), dist.get_world_size()
    out = []
    for rs in (True, False):
        model = TinyGPT.preset("micro", seed=1)
        engine = zl.initialize(model, {"optimizer": {"type": "SGD", "params": {"lr": 0.1}},
                                       "gradient_accumulation_steps": 2, "zerolab": {"collectives": "reduce_scatter"},
                                       "zero_optimization": {"stage": stage, "reduce_scatter": rs}})
        engine.comm.reset()
        for k in range(2):
            x, y = synthetic_batch(model, 4 * n, seed=3, step=k, rank=rank, world_size=n)
            engine.backward(loss_fn(engine(x), y))
            engine.step()
        out.append((engine.comm.by_op(), engine.full_state_dict(), engine.flat.padded))
    return out


@pytest.mark.parametrize("stage", [1, 2])
def test_reduce_scatter_false_all_reduces_and_trains_the_same(stage):
    n = 3
    (rs, sd_rs, padded), (ar, sd_ar, _) = zl.launch(no_reduce_scatter_worker, world_size=n, args=(stage,),
                                                    threads=1)[0]
    rounds = 2 if stage == 2 else 1
    assert rs["reduce_scatter"] == rounds * padded * 4 * (n - 1) // n
    assert ar["all_reduce"] == rounds * 2 * padded * 4 * (n - 1) // n and "reduce_scatter" not in ar
    for k in sd_rs:
        torch.testing.assert_close(sd_ar[k], sd_rs[k], rtol=1e-5, atol=1e-6)


def test_census_agrees_on_a_model_with_frozen_params_buffers_and_unused_params():
    """Frozen params count as params, the model's buffers as buffers; nothing is missed."""
    cases = [(s, p, 0) for s in (0, 1, 2) for p in ("fp32", "mixed")]
    for rank_results in zl.launch(memory_worker, world_size=2, args=(cases, True), timeout=300, threads=1):
        for case, (mem, held, psi, padded) in zip(cases, rank_results):
            assert mem["buffers"] > 0 and held == mem["total"] + mem["buffers"], (case, held, mem)
