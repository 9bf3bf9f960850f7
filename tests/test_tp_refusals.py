"""A tensor-parallel model is refused, by name, where it would be trained wrong: by ``zl.initialize``
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
