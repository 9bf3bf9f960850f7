"""Run ``examples/deepspeed/SCRIPT.py`` unchanged (``runpy``) as ``torchrun tests/ds_example_runner.py SCRIPT ARGS``.

Under ``DS_LIB=deepspeed`` it first stubs DeepSpeed's just-in-time build of a
shared-memory communication op used only for inference (about 90 s of compiling
on a fresh machine); nothing the example calls uses it.
"""
import importlib
import os
import runpy
import sys

if os.environ.get("DS_LIB") == "deepspeed":
    importlib.import_module("deepspeed.comm.torch")
    sys.modules["deepspeed.comm.torch"].build_shm_op = lambda *a, **k: None
    from zerolab.runtime.group_exit import close_at_exit
    close_at_exit()   # DeepSpeed leaves torch's gloo group alive at exit: it can abort (runtime/group_exit.py)
sys.argv = sys.argv[1:]
runpy.run_path(sys.argv[0], run_name="__main__")
