"""A Hugging Face checkpoint's names to the model's: transformers' own conversion mapping (chapter 6).

Transformers 5 keeps a mixture of experts fused in memory (``mlp.experts.gate_up_proj``, one 3-D
tensor for all the experts) but ``save_pretrained`` writes each expert under its own names
(``mlp.experts.3.gate_proj.weight``), and renames some modules on the way (Mixtral's
``block_sparse_moe``); its loader converts back with the model's *conversion mapping*
(``transformers.conversion_mapping``: renamings, and converters that stack the experts and
concatenate gate and up). ``hf_names(model, sd, current)`` applies that same mapping, so
``engine.load_state_dict`` reads a Mixtral, Qwen2-MoE, DeepSeek-V3 or OLMoE file that
``save_pretrained`` wrote. A name already the model's is kept as it is; a converted (fused)
tensor is built whole in memory (a view of the file otherwise), so a rank reads every expert of a
layer it loads. Without transformers, or for a model that is not a ``PreTrainedModel``, nothing
changes.
"""
from __future__ import annotations

from copy import deepcopy

from zerolab.engine.bigmodel.materialize import hf_model


def hf_names(model, sd: dict, current: dict) -> dict:
    """``sd`` with the names the model's Hugging Face conversion mapping gives (see the module docstring)."""
    hf = hf_model(model)
    if hf is None or all(k in current for k in sd):
        return sd
    try:
        from transformers.conversion_mapping import get_model_conversion_mapping
        from transformers.core_model_loading import (WeightConverter, WeightRenaming, dot_natural_key,
                                                     rename_source_key)
    except ImportError:
        return sd
    mapping = get_model_conversion_mapping(hf)
    renamings = [t for t in mapping if isinstance(t, WeightRenaming)]
    converters = [t for t in mapping if isinstance(t, WeightConverter)]
    by_pattern = {pattern: c for c in converters for pattern in c.source_patterns}
    out, fused = {}, {}
    for key in sorted(sd, key=dot_natural_key):   # experts in their order: 2 before 10
        if key in current:
            out[key] = sd[key]
            continue
        name, pattern = rename_source_key(key, renamings, converters)
        if name not in current:
            out[key] = sd[key]   # not the model's under any name: left for the key check to report
        elif pattern is None:
            out[name] = sd[key]
        else:   # one of the tensors a converter joins into ``name``
            fused.setdefault(name, deepcopy(by_pattern[pattern])).add_tensor(name, key, pattern, sd[key])
    for name, converter in fused.items():
        for target, t in converter.convert(name, model=hf, config=hf.config).items():
            out[target] = t[0] if isinstance(t, list) else t
    return out
