"""Activation memory: what a transformer keeps for backward (chapter 1; the 3D terms: chapter 10).

``estimate`` (``zerolab.theory.memory``) counts model states: parameters, gradients,
optimizer state. Activations come on top, grow with sequence length and micro-batch,
and are not partitioned by ZeRO at all: this is why ZeRO alone does not make a model
fit, and why chapter 1's Memory Explorer draws them beside the model states.
Pure arithmetic, no torch; bytes everywhere.

The count is Korthikanti et al. 2022 ("Reducing Activation Recomputation in Large
Transformer Models", section 4 and Table 2), written for any value width d
(``dtype_bytes``; d = 2 in 16-bit training). One GPT layer over s tokens, b sequences,
hidden h, a heads, tensor-parallel degree t, keeps these tensors for backward:

    tensor                                        bytes        split by TP   split by TP+SP
    two LayerNorm inputs                          2 d sbh      no            yes
    the QKV matmul's input (LN output)            d sbh        no            yes
    Q, K, V                                       3 d sbh      yes           yes
    attention output (the projection's input)     d sbh        yes           yes
    the MLP's first matmul input (LN output)      d sbh        no            yes
    GeLU input, GeLU output (4h wide each)        8 d sbh      yes           yes
    two dropout masks (1 byte)                    2 sbh        no            yes
    softmax output, its dropout output            2 d a s^2 b  yes           yes
    the attention dropout mask (1 byte)           a s^2 b      yes           yes

so   linear = sbh (4d + 2) + 12 d sbh / t     (TP, no SP; d = 2: sbh (10 + 24/t))
     linear = sbh (16d + 2) / t               (TP + SP;   d = 2: sbh 34/t)
     scores = (2d + 1) a s^2 b / t            (d = 2: 5 a s^2 b / t; Table 2 writes 5as/(ht) sbh)

``recompute`` (what backward recomputes instead of keeping):

* ``"none"``: each layer keeps linear + scores.
* ``"selective"`` (Korthikanti's selective recomputation): the attention core — QKᵀ, softmax,
  dropout, the product with V — is recomputed from Q, K, V, so the layer keeps ``linear`` only.
  Extra cost: the core's FLOPs once more (4·s²·h per sequence a layer, a few percent at s = 2k).
* ``"full"`` (activation checkpointing; ``checkpointing=True`` is the same): each layer keeps its
  input, d·sbh (d·sbh/t with SP: the input is sequence-sharded), and backward reruns one layer's
  forward at a time, so one layer's full set (linear + scores, the "working set") exists at once
  on top. Extra cost: one more forward, about +1/3 of the step's FLOPs.

``flash_attention=True``: the fused kernel never stores the s x s scores; it keeps one fp32
log-sum-exp per head and token, 4·a·s·b/t bytes, and regenerates the dropout mask from the RNG.

``cp`` (context parallelism): each rank holds s/cp of the tokens, so every sbh term uses s/cp.
The queries of a rank are its s/cp tokens; ring attention passes the keys and values around the
ring and scores the rank's queries against one s/cp block at a time. Without a fused kernel every
block's scores are kept for backward: the rank's s/cp queries against all s keys,
(2d+1)·a·(s/cp)·s·b/t. With FlashAttention only the log-sum-exp of its s/cp queries is kept; the
K/V blocks in flight are transient (backward sends them round the ring again) and not counted.

``pp`` (pipeline parallelism, 1F1B): a stage holds ceil(L/pp) layers, and the first stage has pp
micro-batches in flight at 1F1B's steady state (it starts pp forwards before its first backward),
so it keeps pp x its layers' activations — as much as the whole model for one micro-batch
(Korthikanti section 4.2.3). The last stage has one micro-batch in flight but holds the logits.
The result is the larger of the two stages (with pp = 1 they are the same stage). The schedule's
micro-batches are assumed to be at least pp (1F1B needs that to fill the pipe); interleaved
schedules keep more and are not modelled.

``vocab`` (V): the logits and the loss. The head produces s·b·V logits per rank (V/t of them,
rounded up, under vocabulary-parallel TP) and the loss works in fp32. Two fp32 copies are counted,
4 bytes x 2 x s·b·V: the fp32 logits (the 16-bit head output cast up for the loss; Hugging Face
models also return it as ``outputs.logits``) and the softmax (log-probabilities) the cross-entropy
keeps for its backward. One copy of a 4,096-token sequence at V = 50,257 is 0.82 GB. ``vocab=None``
leaves them out (as before). Embeddings and the final LayerNorm are left out.
"""
from __future__ import annotations

RECOMPUTE = ("none", "selective", "full")
LOGITS_COPIES = 2         # fp32 logits + the loss's fp32 softmax (see above)


def _int(name, v, low=1):
    if isinstance(v, bool) or not isinstance(v, int) or v < low:
        raise ValueError(f"{name} must be an integer >= {low}, got {v!r}")
    return v


def _mode(checkpointing, recompute) -> str:
    if not isinstance(checkpointing, bool):
        raise ValueError(f"checkpointing must be True or False, got {checkpointing!r}")
    if recompute is None:
        return "full" if checkpointing else "none"
    if recompute not in RECOMPUTE:
        raise ValueError(f"recompute={recompute!r} is not allowed; expected one of {RECOMPUTE}")
    if checkpointing and recompute != "full":
        raise ValueError(f"conflicting arguments: checkpointing=True means recompute='full', "
                         f"but recompute={recompute!r} was given; pass one of them")
    return recompute


def activation_terms(layers, hidden, heads, seq_len, micro_batch, checkpointing=False, dtype_bytes=2,
                     flash_attention=False, *, recompute=None, tp=1, sp=False, cp=1, pp=1, vocab=None) -> dict:
    """The bytes ``activation_memory`` adds up, by term, for the pipeline stage that holds most:

    ``layers`` (what the stage's layers keep for all micro-batches in flight: the full sets, or with
    "full" the checkpointed inputs), ``working`` (with "full": one layer's recomputed set),
    ``logits`` (fp32 logits and softmax), ``stage`` ("first" or "last"), ``per_layer`` (one layer,
    one micro-batch, kept), ``in_flight`` (micro-batches the stage holds).
    """
    for name, v in (("layers", layers), ("hidden", hidden), ("heads", heads), ("seq_len", seq_len),
                    ("micro_batch", micro_batch), ("dtype_bytes", dtype_bytes), ("tp", tp), ("cp", cp),
                    ("pp", pp)):
        _int(name, v)
    if dtype_bytes not in (1, 2, 4):
        raise ValueError(f"dtype_bytes must be one of (1, 2, 4), got {dtype_bytes!r}")
    for name, v in (("flash_attention", flash_attention), ("sp", sp)):
        if not isinstance(v, bool):
            raise ValueError(f"{name} must be True or False, got {v!r}")
    mode = _mode(checkpointing, recompute)
    if heads % tp or hidden % tp:
        raise ValueError(f"tp={tp} must divide heads ({heads}) and hidden ({hidden}): TP splits the heads")
    if seq_len % cp:
        raise ValueError(f"cp={cp} must divide seq_len ({seq_len}): each rank holds seq_len/cp tokens")
    if pp > layers:
        raise ValueError(f"pp={pp} exceeds layers ({layers}): every pipeline stage needs a layer")
    if vocab is not None:
        _int("vocab", vocab)
    s, b, h, a, d, t = seq_len // cp, micro_batch, hidden, heads, dtype_bytes, tp
    sbh = s * b * h
    if sp:
        linear = sbh * (16 * d + 2) // t
    else:
        linear = sbh * (4 * d + 2) + 12 * d * sbh // t
    keys = seq_len                                # each rank's s/cp queries against all the keys
    scores = 4 * (a // t) * s * b if flash_attention else (2 * d + 1) * (a // t) * s * keys * b
    full_set = linear + scores                    # one layer, one micro-batch, nothing recomputed
    per_layer = {"none": full_set, "selective": linear, "full": d * sbh // (t if sp else 1)}[mode]
    working = full_set if mode == "full" else 0
    stage_layers = -(-layers // pp)
    logits = LOGITS_COPIES * 4 * s * b * -(-vocab // t) if vocab else 0
    first = {"layers": stage_layers * pp * per_layer, "working": working, "logits": logits if pp == 1 else 0,
             "stage": "first", "in_flight": pp}
    last = {"layers": stage_layers * per_layer, "working": working, "logits": logits, "stage": "last",
            "in_flight": 1}
    total = lambda x: x["layers"] + x["working"] + x["logits"]
    out = first if pp == 1 or total(first) >= total(last) else last
    return {**out, "per_layer": per_layer, "total": total(out), "recompute": mode}


def activation_memory(layers, hidden, heads, seq_len, micro_batch, checkpointing=False,
                      dtype_bytes=2, flash_attention=False, *, recompute=None, tp=1, sp=False, cp=1, pp=1,
                      vocab=None) -> int:
    """Bytes of activations a GPT-like transformer stores for backward, per rank (the module
    docstring derives every term).

    Without tensor, sequence, context or pipeline parallelism and without logits:

        per_layer = sbh (16 d + 2) + a s^2 b (2 d + 1)      (d = 2: sbh (34 + 5as/h))
        recompute="none":       layers * per_layer
        recompute="selective":  layers * sbh (16 d + 2)
        recompute="full":       layers * d * sbh + per_layer     (checkpointing=True: the same)

    ``flash_attention=True`` replaces a s^2 b (2 d + 1) by 4 a s b. ``tp``/``sp``: Korthikanti's
    Table 2 (sbh (10 + 24/t + 5as/(ht)) at d = 2 without SP, sbh (34/t + 5as/(ht)) with it);
    ``cp``: s/cp tokens per rank; ``pp``: the 1F1B stage that holds most; ``vocab``: + two fp32
    copies of the logits. ``activation_terms`` gives the same bytes by term.
    """
    return activation_terms(layers, hidden, heads, seq_len, micro_batch, checkpointing, dtype_bytes,
                            flash_attention, recompute=recompute, tp=tp, sp=sp, cp=cp, pp=pp,
                            vocab=vocab)["total"]
