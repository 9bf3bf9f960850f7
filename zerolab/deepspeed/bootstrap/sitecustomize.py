"""Started by ``zerolab-deepspeed`` (on the children's PYTHONPATH only): ``import deepspeed`` is zerolab's in this
process (``zerolab.deepspeed.hook``); then any other ``sitecustomize`` further along the path runs as usual."""
import os
import sys

if os.environ.get("ZEROLAB_DEEPSPEED_ALIAS") == "1":
    from zerolab.deepspeed.hook import install
    install()

_here = os.path.dirname(os.path.abspath(__file__))
for _d in sys.path:
    _f = os.path.join(_d or os.getcwd(), "sitecustomize.py")
    if os.path.abspath(_d or os.getcwd()) != _here and os.path.isfile(_f):
        import importlib.util as _u
        _spec = _u.spec_from_file_location("_sitecustomize_next", _f)
        _spec.loader.exec_module(_u.module_from_spec(_spec))
        break
