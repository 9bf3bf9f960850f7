"""Sequence parallelism on Hugging Face's GPT-2 is refused at conversion, by name (it failed in forward with
shape errors). A tensor-parallel model is refused, by name, where it would be trained wrong: by ``zl.initialize``
without the mesh it was converted over (the TP ranks would be trained as DP replicas, rank 0's slices
broadcast over rank 1's), by ``zerolab.deepspeed.initialize`` (which has no mesh), by a mesh of another tp."""
from __future__ import annotations

import zerolab as zl
from zerolab.book.models import TinyGPT
from zerolab.parallel import tensor_parallel

CFG = {"optimizer": {"type": "Adam", "params": {"lr": 1e-3}}, "train_micro_batch_size_per_gpu": 1}


def _initialize_worker():
    mesh = zl.mesh(tp=2)
    errors = []

    def tp_model():
        return tensor_parallel(TinyGPT(vocab=64, n_layer=1, n_head=2, d_model=16, seq_len=8), mesh)

    for call in (lambda: zl.initialize(tp_model(), CFG),
                 lambda: __import__("zerolab.deepspeed", fromlist=["initialize"]).initialize(model=tp_model(),
                                                                                             config=CFG),
                 lambda: zl.initialize(tp_model(), CFG, mesh=zl.mesh(dp=2))):
        try:
            call()
            errors.append(None)
        except ValueError as e:
            errors.append(str(e))
    return errors


def test_tp_model_needs_its_mesh():
    for errors in zl.launch(_initialize_worker, 2, timeout=120, threads=1):
        assert all(e is not None for e in errors), errors
        for e in errors[:2]:
            assert "'wte' is a tensor-parallel layer (VocabParallelEmbedding, tp=2)" in e and "mesh=mesh" in e, e
        assert "'wte' is a tensor-parallel layer over tp=2, but the mesh has tp=1" in errors[2], errors[2]


def _hf_sp_worker():
    from transformers import GPT2Config, GPT2LMHeadModel
    from tp_util import conversion_errors
    from zerolab.parallel import HF_GPT2_PLAN
    cfg = GPT2Config(vocab_size=128, n_positions=16, n_embd=32, n_layer=1, n_head=4, bos_token_id=0, eos_token_id=0)
    mesh = zl.mesh(tp=2)
    return conversion_errors([(lambda: GPT2LMHeadModel(cfg), HF_GPT2_PLAN, True),
                              (lambda: GPT2LMHeadModel(cfg), {**HF_GPT2_PLAN, "transformer.wpe": "sequence"}, True)],
                             mesh)


def test_sequence_parallel_on_hf_gpt2_refused_by_name():
    import pytest
    pytest.importorskip("transformers")
    from tp_util import assert_named
    errors = zl.launch(_hf_sp_worker, 2, timeout=120, threads=1)[0]
    want = "sequence_parallel=True does not support Hugging Face's GPT2LMHeadModel"
    assert_named(errors, [want, want])
