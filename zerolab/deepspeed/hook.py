"""``import deepspeed`` resolved to ``zerolab.deepspeed``, in the processes of ``zerolab-deepspeed`` only.

``DeepSpeedAlias`` is a meta-path finder placed first on ``sys.meta_path``:
``deepspeed`` and every ``deepspeed.x.y`` are the modules ``zerolab.deepspeed.x.y``
(the same objects under both names), ``importlib.util.find_spec("deepspeed")``
answers with zerolab's file, and its ``find_distributions`` makes
``importlib.metadata.version("deepspeed")`` report the release zerolab follows,
marked as zerolab's (``0.19.8+zerolab``), ahead of any real DeepSpeed installed.
``install()`` is called by the bootstrap ``sitecustomize`` the launcher puts on
the children's ``PYTHONPATH`` (``bootstrap/``); nothing is installed into
site-packages, and a process started otherwise (``python script.py``) imports
whatever ``deepspeed`` is installed.
"""
from __future__ import annotations

import importlib
import importlib.abc
import importlib.machinery
import importlib.metadata as md
import sys

ALIAS, TARGET = "deepspeed", "zerolab.deepspeed"
ENV = "ZEROLAB_DEEPSPEED_ALIAS"   # set by the launcher in the children's environment


class _Existing(importlib.abc.Loader):
    """Loads ``deepspeed.x`` as the already imported ``zerolab.deepspeed.x``."""

    def __init__(self, module):
        self.module = module

    def create_module(self, spec):
        return self.module

    def exec_module(self, module):
        pass


class _Metadata(md.Distribution):
    def read_text(self, filename):
        if filename in ("METADATA", "PKG-INFO"):
            from zerolab.deepspeed import __version__
            return (f"Metadata-Version: 2.1\nName: deepspeed\nVersion: {__version__}\n"
                    f"Summary: zerolab's DeepSpeed front door (zerolab.deepspeed)\n")
        return None

    def locate_file(self, path):
        return None


class DeepSpeedAlias(importlib.abc.MetaPathFinder):
    def find_spec(self, fullname, path=None, target=None):
        if fullname != ALIAS and not fullname.startswith(ALIAS + "."):
            return None
        real = TARGET + fullname[len(ALIAS):]
        try:
            module = importlib.import_module(real)
        except ModuleNotFoundError as e:
            if e.name != real:
                raise
            return None   # no such module in zerolab: a plain ModuleNotFoundError (the parent's path has none)
        spec = importlib.machinery.ModuleSpec(fullname, _Existing(module), origin=getattr(module, "__file__", None),
                                              is_package=hasattr(module, "__path__"))
        if hasattr(module, "__path__"):
            spec.submodule_search_locations = list(module.__path__)
        spec.has_location = spec.origin is not None
        return spec

    def find_distributions(self, context=md.DistributionFinder.Context()):
        name = (context.name or "").replace("-", "_").lower()
        return iter([_Metadata()] if name == ALIAS else [])


def install() -> DeepSpeedAlias:
    """Put the alias first on ``sys.meta_path`` (once); drop any ``deepspeed`` imported before it."""
    for f in sys.meta_path:
        if isinstance(f, DeepSpeedAlias):
            return f
    for name in [n for n in sys.modules if n == ALIAS or n.startswith(ALIAS + ".")]:
        del sys.modules[name]
    finder = DeepSpeedAlias()
    sys.meta_path.insert(0, finder)
    return finder


def installed() -> bool:
    return any(type(f).__name__ == "DeepSpeedAlias" for f in sys.meta_path)
