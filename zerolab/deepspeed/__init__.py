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
script.py --deepspeed_config ds.json``, or ``python script.py`` (one rank);
DeepSpeed's own ``deepspeed`` launcher is not provided.
"""
from zerolab.deepspeed import comm, pipe, runtime, utils, zero
from zerolab.deepspeed.comm import init_distributed
from zerolab.deepspeed.data import DeepSpeedDataLoader
from zerolab.deepspeed.engine import DeepSpeedEngine
from zerolab.deepspeed.front import add_config_arguments, initialize
from zerolab.deepspeed.pipe import PipelineModule

__all__ = ["initialize", "init_distributed", "add_config_arguments", "comm", "zero", "utils", "runtime", "pipe", "PipelineModule", "DeepSpeedEngine",
           "DeepSpeedDataLoader"]
