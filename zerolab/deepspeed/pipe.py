"""``deepspeed.pipe``: ``PipelineModule``, ``LayerSpec``, ``TiedLayerSpec`` on zerolab's pipeline stages.

A ``PipelineModule`` is a list of layers -- modules, ``LayerSpec``s (a class and
its arguments, built only on the stage that runs it) and plain callables
(``lambda x: x.flatten(1)``) -- cut into ``num_stages`` contiguous stages. The
instance on each rank holds only its own stage's layers, registered under their
index in the list (``"3.weight"``), as DeepSpeed registers them;
``deepspeed.initialize`` runs it with zerolab's pipeline (``zl.mesh(dp=, pp=)``,
``zerolab.parallel.pipeline.train_batch``, ZeRO-0/1 over the DP group), and
``engine.train_batch()`` feeds it (``pipe_engine.py``).

The cut follows DeepSpeed 0.19.8's ``partition_method`` rules (``parts``: the
first layer index of each stage, then the number of layers):

* ``"uniform"``: equal numbers of layers, the first stages one more when it
  does not divide;
* ``"parameters"`` (DeepSpeed's default): balanced trainable-parameter counts
  (each ``LayerSpec`` is built once to count it, as DeepSpeed does, so the
  random stream advances the same way);
* ``"type:REGEX"``: balanced counts of the layers whose class name matches
  the regex (case-insensitive).

"Balanced" is DeepSpeed's dynamic programme over contiguous cuts minimising
(largest - smallest) stage weight, ties broken by the last cut found
(``balanced_parts``, written here from that rule). Differences from
DeepSpeed: ranks are placed DP-outermost (zerolab's mesh: rank = dp_rank x pp +
stage; DeepSpeed's topology puts the pipeline outermost: rank = stage x dp +
dp_rank) -- the same when dp or pp is 1 (what passes between stages is a tensor or a
tuple of tensors, as in DeepSpeed); a ``TiedLayerSpec`` key must sit on
one stage or on the first and the last (zerolab's pipeline sums a tied weight's
gradients over those two, as DeepSpeed sums them over the stages holding it, and
starts the last stage's copy from the first's);
``topology=``, ``seed_layers=True``, activation checkpointing and the
``"profile"`` method are refused by name.
"""
from __future__ import annotations

import re

import torch.distributed as dist
from torch import nn

from zerolab.runtime.mesh import mesh as make_mesh


class LayerSpec:
    """``LayerSpec(nn.Linear, 4, 8, bias=False)``: built (``build()``) only on the stage that holds it."""

    def __init__(self, typename, *module_args, **module_kwargs):
        if not (isinstance(typename, type) and issubclass(typename, nn.Module)):
            raise RuntimeError("LayerSpec only supports torch.nn.Module types.")   # DeepSpeed's message
        self.typename, self.module_args, self.module_kwargs = typename, module_args, module_kwargs

    def __repr__(self):
        args = [repr(a) for a in self.module_args] + [f"{k}={v!r}" for k, v in self.module_kwargs.items()]
        return f"{self.typename.__name__}({', '.join(args)})"

    def build(self, log=False):
        return self.typename(*self.module_args, **self.module_kwargs)


class TiedLayerSpec(LayerSpec):
    """Layers sharing one module (``key``); ``forward_fn(module, x)`` when given, else ``module(x)``."""

    def __init__(self, key, typename, *module_args, forward_fn=None, tied_weight_attr=("weight",), **module_kwargs):
        super().__init__(typename, *module_args, **module_kwargs)
        self.key, self.forward_fn = key, forward_fn
        self.tied_weight_attr = [tied_weight_attr] if isinstance(tied_weight_attr, str) else list(tied_weight_attr)


def uniform_parts(n: int, p: int) -> list:
    """DeepSpeed's ``partition_uniform``: p + 1 boundaries; the first n % p stages one layer more."""
    if n <= p:
        return [min(i, n) for i in range(p + 1)]
    q, r = divmod(n, p)
    return [i * q + min(i, r) for i in range(p + 1)]


def balanced_parts(weights: list, p: int) -> list:
    """Contiguous cut of ``weights`` into ``p`` stages minimising (heaviest - lightest) stage
    (DeepSpeed's ``partition_balanced`` rule; among equal costs the last cut point found wins)."""
    n = len(weights)
    if n <= p:
        return uniform_parts(n, p)
    inf = float("inf")
    prefix = [0]
    for w in weights:
        prefix.append(prefix[-1] + w)
    hi = [[inf] * (p + 1) for _ in range(n + 1)]
    lo = [[inf] * (p + 1) for _ in range(n + 1)]
    cost = [[inf] * (p + 1) for _ in range(n + 1)]
    cut = [[0] * (p + 1) for _ in range(n + 1)]
    hi[0][0] = cost[0][0] = 0
    for i in range(1, n + 1):
        for j in range(1, min(i, p) + 1):
            for k in range(i):
                top, bottom = max(hi[k][j - 1], prefix[i] - prefix[k]), min(lo[k][j - 1], prefix[i] - prefix[k])
                if cost[i][j] >= top - bottom:
                    cost[i][j], hi[i][j], lo[i][j], cut[i][j] = top - bottom, top, bottom, k
    parts = [n]
    for j in range(p, 0, -1):
        parts.append(cut[parts[-1]][j])
    return parts[::-1]


def _name(layer):
    if isinstance(layer, LayerSpec):
        return layer.typename.__name__
    if isinstance(layer, nn.Module):
        return type(layer).__name__
    return getattr(layer, "__name__", None)


def _trainable(module) -> int:
    return sum(p.numel() for p in module.parameters() if p.requires_grad)


def partition(layers: list, num_stages: int, method: str = "parameters") -> list:
    """The p + 1 stage boundaries of ``layers`` by DeepSpeed's ``partition_method`` (module docstring)."""
    m = method.lower()
    if m == "uniform":
        return uniform_parts(len(layers), num_stages)
    if m == "parameters":
        counts = [_trainable(l.build()) if isinstance(l, LayerSpec) else
                  _trainable(l) if isinstance(l, nn.Module) else 0 for l in layers]
        return balanced_parts(counts, num_stages)
    if m.startswith("type:"):
        rx = re.compile(m.split(":")[1], re.IGNORECASE)
        hits = [1 if _name(l) is not None and rx.search(_name(l)) else 0 for l in layers]
        if not any(hits):
            raise RuntimeError(f"Partitioning '{m.split(':')[1]}' found no valid layers to partition.")
        return balanced_parts(hits, num_stages)
    raise NotImplementedError(f"Partitioning method {method} not implemented. (zerolab: 'parameters', 'uniform' "
                              f"or 'type:REGEX'; DeepSpeed refuses 'profile' too)")


class PipelineModule(nn.Module):
    """DeepSpeed's ``PipelineModule(layers, num_stages, loss_fn=..., partition_method=...)``; this rank's stage."""

    def __init__(self, layers, num_stages=None, topology=None, loss_fn=None, seed_layers=False, seed_fn=None,
                 base_seed=1234, partition_method="parameters", activation_checkpoint_interval=0,
                 activation_checkpoint_func=None, checkpointable_layers=None, dynamic_shape=False):
        super().__init__()
        if topology is not None:
            raise NotImplementedError("PipelineModule(topology=...): zerolab places ranks on its own mesh "
                                      "(zl.mesh(dp=, pp=)); give num_stages")
        if num_stages is None:
            raise RuntimeError("must provide num_stages or topology")   # DeepSpeed's assertion
        if seed_layers:
            raise NotImplementedError("PipelineModule(seed_layers=True): per-layer seeds are not implemented; "
                                      "seed once before building the layers")
        if activation_checkpoint_interval:
            raise NotImplementedError(f"PipelineModule(activation_checkpoint_interval="
                                      f"{activation_checkpoint_interval}): activation checkpointing of pipeline "
                                      f"stages is not implemented in zerolab")
        if not dist.is_initialized():
            raise RuntimeError("PipelineModule: torch.distributed is not initialised; call "
                               "deepspeed.init_distributed() before building the PipelineModule (DeepSpeed needs it "
                               "too, to know the stage of this rank)")
        world = dist.get_world_size()
        if not isinstance(num_stages, int) or num_stages < 1 or world % num_stages:
            raise ValueError(f"PipelineModule(num_stages={num_stages!r}): must be a positive integer dividing the "
                             f"world size ({world})")
        specs = list(layers.children()) if isinstance(layers, nn.Sequential) else list(layers)
        if not specs:
            raise ValueError("PipelineModule(layers=[]): no layers")
        for i, l in enumerate(specs):
            if not (isinstance(l, (LayerSpec, nn.Module)) or callable(l)):
                raise TypeError(f"PipelineModule: layer {i} is a {type(l).__name__}; expected an nn.Module, a "
                                f"LayerSpec or a callable")
        self.mesh = make_mesh(dp=world // num_stages, pp=num_stages)
        self.num_stages, self.stage_id, self.loss_fn = num_stages, self.mesh.pp_rank, loss_fn
        self.parts = partition(specs, num_stages, partition_method)
        self._local_start, self._local_stop = self.parts[self.stage_id], self.parts[self.stage_id + 1]
        tied_keys = self._check_tied(specs)
        self.tied_modules, self.forward_funcs = nn.ModuleDict(), []
        for idx in range(self._local_start, self._local_stop):
            layer = specs[idx]
            if isinstance(layer, TiedLayerSpec):
                if layer.key not in self.tied_modules:
                    self.tied_modules[layer.key] = layer.build()
                module, fn = self.tied_modules[layer.key], layer.forward_fn
                self.forward_funcs.append((lambda x, m=module, f=fn: f(m, x)) if fn else module)
            elif isinstance(layer, LayerSpec):
                module = layer.build()
                self.add_module(str(idx), module)
                self.forward_funcs.append(module)
            elif isinstance(layer, nn.Module):
                self.add_module(str(idx), layer)
                self.forward_funcs.append(layer)
            else:
                self.forward_funcs.append(layer)
        # what zl.initialize and zerolab's pipeline read: this is a stage already cut, and which of its
        # weights are tied to the other end's copy (first and last stage; their gradients are summed)
        self.pipeline_position = (self.stage_id, num_stages)
        self.tied = [f"tied_modules.{k}.{a}" for k in tied_keys if k in self.tied_modules
                     for a in self._tied_attrs(specs, k)]
        self.tied_copies = list(self.tied) if self.stage_id == num_stages - 1 and self.stage_id > 0 else []

    def _check_tied(self, specs) -> list:
        """The TiedLayerSpec keys shared by the first and the last stage (zerolab's pipeline sums their
        gradients over that pair, as DeepSpeed all-reduces a tied module's over the stages holding it);
        a key on a stage in between is refused."""
        stages = {}
        for idx, layer in enumerate(specs):
            if isinstance(layer, TiedLayerSpec):
                stages.setdefault(layer.key, set()).add(self.stage_owner(idx))
        ends = {0, self.num_stages - 1}
        split = {k: sorted(v) for k, v in stages.items() if len(v) > 1 and v != ends}
        if split:
            raise NotImplementedError(f"TiedLayerSpec keys {sorted(split)} fall on stages {list(split.values())}: "
                                      f"zerolab ties weights across the first and the last pipeline stage only "
                                      f"(its embedding group); change the partition so each key sits on one stage "
                                      f"or on the two ends")
        return sorted(k for k, v in stages.items() if len(v) > 1)

    @staticmethod
    def _tied_attrs(specs, key) -> list:
        return next(l.tied_weight_attr for l in specs if isinstance(l, TiedLayerSpec) and l.key == key)

    def forward(self, x):
        for f in self.forward_funcs:
            x = f(x)
        return x

    def num_pipeline_stages(self) -> int:
        return self.num_stages

    def stage_owner(self, layer_idx: int) -> int:
        for s in range(self.num_stages):
            if self.parts[s] <= layer_idx < self.parts[s + 1]:
                return s
        raise RuntimeError(f"Layer {layer_idx} not owned? parts={self.parts}")
