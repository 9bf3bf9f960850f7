"""zerolab: the package behind the zerolab book on data-parallel training.

Public names (docs/ARCHITECTURE.md lists the layers) are loaded lazily, so ``import zerolab`` is cheap
and a notebook pays for matplotlib or the engines only when it uses them.

    import zerolab as zl
    zl.estimate(7.5e9, 64, stage=3).total      # theory   (chapter 1)
    zl.launch(fn, world_size=4)                 # runtime  (chapter 0)
    zl.initialize(model, config)                # engines  (chapters 3-7)
"""
from importlib import import_module

__version__ = "0.1.0"

# public name -> module that defines it
_EXPORTS = {
    # theory (chapters 1-2)
    "estimate": "zerolab.theory.memory",
    "estimate_config": "zerolab.config",
    "deepspeed_estimate": "zerolab.theory.ds_estimate",
    "comm_breakdown": "zerolab.theory.comm",
    "context_bytes": "zerolab.theory.context",           # context parallelism's bytes (chapter 11)
    "by_axis": "zerolab.theory.comm",                     # 3D: bytes per mesh group (chapter 10)
    "step_time_3d": "zerolab.theory.time3d",              # 3D: the time model's step and TFLOP/s (chapter 10)
    "step_comm_time": "zerolab.theory.comm",
    "zero_table1": "zerolab.theory.memory",
    "table1_text": "zerolab.theory.memory",
    "Estimate": "zerolab.theory.memory",
    "comm_volume": "zerolab.theory.comm",
    "activation_memory": "zerolab.theory.activations",
    "Config": "zerolab.config",
    "ConfigError": "zerolab.config",
    "Link": "zerolab.theory.network",
    "LINKS": "zerolab.theory.network",
    "Node": "zerolab.theory.nodes",
    "NODES": "zerolab.theory.nodes",
    "Hardware": "zerolab.theory.hardware",
    "HARDWARE": "zerolab.theory.hardware",
    "choose_stage": "zerolab.theory.plan",
    "replay": "zerolab.theory.replay",                    # time on modelled GPUs from a traced run (chapters 3-14)
    "Cluster": "zerolab.theory.replay",
    "ModelShape": "zerolab.theory.shapes",
    # runtime (chapters 0, 2); `launch` itself is imported eagerly below
    "LaunchError": "zerolab.runtime.collect",
    "CommLedger": "zerolab.runtime.comm",
    "census": "zerolab.runtime.measure",
    "MemoryReport": "zerolab.runtime.measure",
    "mesh": "zerolab.runtime.mesh",                       # 3D: dp x tp x pp (chapter 10)
    "Mesh": "zerolab.runtime.mesh",
    # tensor parallelism (chapter 10)
    "tensor_parallel": "zerolab.parallel",
    "vocab_parallel_cross_entropy": "zerolab.parallel",
    "context_attention": "zerolab.parallel",             # context parallelism: Ulysses, ring (chapter 11)
    "MoELayer": "zerolab.parallel",                      # expert parallelism (chapter 11)
    "recompute": "zerolab.parallel.recompute",             # activation recomputation: full, selective
    # engines (chapters 3-9)
    "initialize": "zerolab.engine",
    "gathered_parameters": "zerolab.engine",
    "zero_init": "zerolab.engine.bigmodel.zero_init",     # partitioned construction (chapter 6)
    "set_leaf_modules": "zerolab.engine.unit_order",   # ZeRO-3: a module gathered whole (chapter 6)
    "consolidate_fp32": "zerolab.engine.checkpoint.consolidate",     # checkpoints (chapter 8)
    "CheckpointError": "zerolab.engine.checkpoint.files",
    # book helpers
    "show": "zerolab.book",
}

# The function `launch` shares its name with its module: bind it eagerly, or the
# first `import zerolab.runtime.launch` would leave `zl.launch` pointing at the module.
from zerolab.runtime.launch import launch  # noqa: E402

__all__ = sorted(_EXPORTS) + ["launch", "__version__"]


def __getattr__(name):
    try:
        module = _EXPORTS[name]
    except KeyError:
        raise AttributeError(f"module 'zerolab' has no attribute {name!r}") from None
    value = getattr(import_module(module), name)
    globals()[name] = value  # cache: next access is a plain attribute
    return value


def __dir__():
    return __all__
