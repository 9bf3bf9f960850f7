"""DeepSpeed's front door on zerolab's engines: ``import zerolab.deepspeed as deepspeed``.

A training script written for DeepSpeed runs with that one import changed:

    import zerolab.deepspeed as deepspeed
    parser = deepspeed.add_config_arguments(argparse.ArgumentParser())
    deepspeed.init_distributed(dist_backend="gloo")
    engine, optimizer, loader, lr_scheduler = deepspeed.initialize(
        args=parser.parse_args(), model=model, model_parameters=model.parameters(), training_data=dataset)
    for x, y in loader:
        loss = loss_fn(engine(x.to(engine.device)), y.to(engine.device))
        engine.backward(loss)
        engine.step()

The names, signatures, defaults and return values are DeepSpeed 0.19.8's
(``front``: ``initialize``, ``add_config_arguments``; ``comm``: ``init_distributed``
and the process-group calls; ``zero``: ``Init``, ``GatheredParameters``;
``engine``: what the returned engine answers; ``data``: the loader's batch
order; ``utils``: ``RepeatingLoader``). Underneath is ``zl.initialize``, so ``engine.memory()`` and
``engine.comm`` tell what the script's job holds and sends. What zerolab cannot
do raises ``NotImplementedError`` naming the DeepSpeed call and what to use.
Run it with ``zl.launch(fn, world_size=N)``, ``torchrun --nproc-per-node N
script.py --deepspeed_config ds.json``, or ``python script.py`` (one rank). A
script left as it is (``import deepspeed``) runs under ``zerolab-deepspeed`` /
``python -m zerolab.deepspeed``, DeepSpeed's launcher arguments on torchrun
(``launch.py``), with ``deepspeed`` resolved to this package in its processes only.
"""
from zerolab.deepspeed import accelerator, comm, moe, ops, pipe, runtime, utils, zero
from zerolab.deepspeed.accelerator import get_accelerator
from zerolab.deepspeed.comm import init_distributed
from zerolab.deepspeed.data import DeepSpeedDataLoader
from zerolab.deepspeed.engine import DeepSpeedEngine
from zerolab.deepspeed.front import add_config_arguments, initialize
from zerolab.deepspeed.pipe import PipelineModule

# the DeepSpeed release whose API this follows, marked as zerolab's (what `import deepspeed` reports under the
# zerolab-deepspeed launcher, importlib.metadata included: launch.py)
DEEPSPEED_VERSION = "0.19.8"
__version__ = f"{DEEPSPEED_VERSION}+zerolab"
__version_major__, __version_minor__, __version_patch__ = 0, 19, 8

__all__ = ["initialize", "init_distributed", "add_config_arguments", "comm", "zero", "utils", "runtime", "pipe",
           "PipelineModule", "DeepSpeedEngine", "DeepSpeedDataLoader", "accelerator", "get_accelerator", "moe", "ops"]
