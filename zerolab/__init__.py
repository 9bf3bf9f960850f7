"""zerolab: the package behind the zerolab book on data-parallel training.

Public names (see DESIGN.md) are loaded lazily, so ``import zerolab`` is cheap
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
    "estimate": "zerolab.theory",
    "Estimate": "zerolab.theory",
    "comm_volume": "zerolab.theory",
    "activation_memory": "zerolab.theory",
    "Config": "zerolab.config",
    "ConfigError": "zerolab.config",
    "Link": "zerolab.network",
    "LINKS": "zerolab.network",
    # runtime (chapters 0, 2)
    "launch": "zerolab.launch",
    "LaunchError": "zerolab.launch",
    "CommLedger": "zerolab.comm",
    "census": "zerolab.measure",
    "MemoryReport": "zerolab.measure",
    # engines (chapters 3-8)
    "initialize": "zerolab.engine",
    "gathered_parameters": "zerolab.engine",
    # book helpers
    "show": "zerolab.book",
}

__all__ = sorted(_EXPORTS) + ["__version__"]


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
