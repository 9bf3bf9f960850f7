"""Model parallelism composed with ZeRO (chapter 10): tensor-parallel layers and the plans that
convert a model to them (Megatron-LM's scheme). Imports torch, the runtime (``zl.mesh``'s groups
and their communicators) and the theory; never the engine, the book or the bench: the engine
shards a converted model over the mesh's DP group like any other model.

Files: ``ops`` (the conjugate operators f and g, the vocabulary-parallel
cross-entropy), ``layers`` (column- and row-parallel linear layers, the
vocabulary-parallel embedding), ``sequence`` (sequence parallelism wired into
a converted model), ``plan`` (``tensor_parallel``: a plan of
globs over module names; ``tp_dims`` / ``gather_tp``: the full state back),
``check`` (the conversion checked against the plain model), ``regions`` (whole parameters
inside a split region: their gradients all-reduced over TP), ``rng`` (the dropout RNG tracker),
``cross_entropy`` (the loss over vocabulary-split logits),
``pipeline`` (``pipeline_stage``, the GPipe and 1F1B schedules, ``train_batch``; interleaved 1F1B in
``pipeline_interleaved``, zero bubble's B/W split and ZB-H1 in ``pipeline_zb``),
``context`` (context parallelism: ``context_ulysses``' all-to-alls, ``context_ring``'s ring attention),
``experts`` (expert parallelism, chapter 11: ``MoELayer``, its experts over the mesh's ep group; ``experts_gate``:
top-k, capacity, the balancing loss),
``recompute`` (``zl.recompute``: activation recomputation, full or selective).
"""
from zerolab.parallel.check import TensorParallelCheckError
from zerolab.parallel.context import (ContextParallelAttention, ContextParallelLM, context_attention,
                                      ring_attention, split_sequence, ulysses_attention)
from zerolab.parallel.experts import MoELayer, detach_experts, expert_parameters, reduce_expert_grads
from zerolab.parallel.layers import ColumnParallelLinear, RowParallelLinear, VocabParallelEmbedding
from zerolab.parallel.ops import (copy_to_tp, gather_from_sequence, gather_from_tp, reduce_from_tp,
                                  reduce_scatter_to_sequence, scatter_to_sequence, vocab_parallel_cross_entropy)
from zerolab.parallel.pipeline import pipeline_stage, schedule, split_blocks, train_batch
from zerolab.parallel.regions import replicated_in_split_params
from zerolab.parallel.sequence import sequence_parallel_params
from zerolab.parallel.plan import (GPT_PLAN, GPT_SP_PLAN, HF_GPT2_PLAN, HF_LLAMA_PLAN, gather_3d, gather_tp,
                                   tensor_parallel, tp_dims)

__all__ = ["TensorParallelCheckError", "replicated_in_split_params", "ColumnParallelLinear", "RowParallelLinear", "VocabParallelEmbedding", "copy_to_tp", "reduce_from_tp",
           "gather_from_tp", "vocab_parallel_cross_entropy", "gather_from_sequence", "reduce_scatter_to_sequence",
           "scatter_to_sequence", "sequence_parallel_params", "GPT_SP_PLAN", "GPT_PLAN", "HF_GPT2_PLAN",
           "HF_LLAMA_PLAN", "tensor_parallel", "tp_dims", "gather_tp", "gather_3d",
           "pipeline_stage", "schedule", "split_blocks", "train_batch",
           "ContextParallelAttention", "ContextParallelLM", "context_attention", "ring_attention", "split_sequence",
           "ulysses_attention", "MoELayer", "detach_experts", "expert_parameters", "reduce_expert_grads"]
