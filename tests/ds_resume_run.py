"""DeepSpeed's half of tests/test_ds_checkpoint_resume.py: train, save, resume, on CPU ranks with gloo.

    DS_ACCELERATOR=cpu python tests/ds_resume_run.py WORK STAGE WORLD DTYPE K M [SUB_GROUP_SIZE]

Each rank (``torch.multiprocessing.spawn``):
  A. builds the fixture model (tests/fixtures/make_ds_checkpoints.py's Tiny: a tied weight, a frozen
     parameter, a buffer) from seed 0, trains K steps, ``save_checkpoint(WORK/ds, "k")``, trains M more
     steps and saves ``WORK/ds_after`` (tag "km"): what zerolab must reach after loading ``WORK/ds``;
  B. if ``WORK/zl`` exists (zerolab's ``save_checkpoint(..., format="deepspeed")``): builds the model
     from another seed, ``load_checkpoint(WORK/zl)``, saves what it loaded to ``WORK/zl_loaded``,
     trains M steps and saves ``WORK/zl_then_ds``.
The optimizer is DeepSpeed's own from the config's "optimizer" section ("AdamW": its FusedAdam, whose
param groups carry ``bias_correction``), as a DeepSpeed user gets it, not a client torch optimizer.
SUB_GROUP_SIZE (stage 3): ``zero_optimization.sub_group_size``, so that a tiny model is cut into several
sub-groups as DeepSpeed cuts every model above 1e9 parameters by default.
Each rank writes its losses to ``WORK/ds_losses.rank{r}.pt``. The batches, the config and the loss are
``batch``, ``config`` and ``loss`` below, which the zerolab half imports.
"""
from __future__ import annotations

import importlib
import os
import sys
from pathlib import Path

import torch

from zerolab.runtime.group_exit import close_at_exit


def _fixture_module():
    """tests/fixtures/make_ds_checkpoints.py, loaded by its path: putting tests/fixtures on ``sys.path``
    would make its ``deepspeed/`` folder (DeepSpeed's files) importable as a namespace package called
    ``deepspeed`` wherever DeepSpeed itself is not installed."""
    import importlib.util
    if "make_ds_checkpoints" in sys.modules:
        return sys.modules["make_ds_checkpoints"]
    path = Path(__file__).resolve().parent / "fixtures" / "make_ds_checkpoints.py"
    spec = importlib.util.spec_from_file_location("make_ds_checkpoints", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules["make_ds_checkpoints"] = module
    spec.loader.exec_module(module)
    return module


Tiny = _fixture_module().Tiny

LR, WD, CLIP = 0.05, 0.01, 1.0


def config(stage: int, dtype: str, sub_group_size: int | None = None) -> dict:
    zero = {"stage": stage}
    if stage == 3:
        zero["stage3_param_persistence_threshold"] = 0
    if sub_group_size:
        zero["sub_group_size"] = sub_group_size
    cfg = {"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 1, "gradient_clipping": CLIP,
           "optimizer": {"type": "AdamW", "params": {"lr": LR, "weight_decay": WD}},
           "zero_optimization": zero, "steps_per_print": 1000,
           "scheduler": {"type": "WarmupLR", "params": {"warmup_min_lr": 0.01, "warmup_max_lr": LR,
                                                        "warmup_num_steps": 4, "warmup_type": "linear"}}}
    if dtype == "bf16":
        cfg["bf16"] = {"enabled": True}
    return cfg


def batch(step: int, rank: int) -> torch.Tensor:
    return torch.randint(0, 7, (2, 4), generator=torch.Generator().manual_seed(100 * step + rank))


def loss(out: torch.Tensor) -> torch.Tensor:
    return out.float().pow(2).mean()


def _engine(deepspeed, stage, dtype, seed, sub_group_size=None):
    torch.manual_seed(seed)
    cfg = config(stage, dtype, sub_group_size)
    if stage == 3:
        with deepspeed.zero.Init(config_dict_or_path=cfg):
            model = Tiny()
    else:
        model = Tiny()
    params = [p for p in model.parameters() if p.requires_grad]   # DeepSpeed builds its FusedAdam over them
    engine, optimizer, *_ = deepspeed.initialize(model=model, model_parameters=params, config=cfg)
    inner = getattr(optimizer, "optimizer", optimizer)
    assert type(inner).__name__ == "FusedAdam", f"DeepSpeed built {type(inner).__name__}, not its FusedAdam"
    return engine


def _train(engine, rank, first, steps):
    out = []
    for s in range(first, first + steps):
        value = loss(engine(batch(s, rank)))
        engine.backward(value)
        engine.step()
        out.append(value.item())
    return out


def rank_main(rank, work, stage, world, dtype, k, m, port, sub_group_size=None):
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world),
                      MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    importlib.import_module("deepspeed.comm.torch")   # skip the JIT build of an inference-only op
    sys.modules["deepspeed.comm.torch"].build_shm_op = lambda *a, **kw: None
    import deepspeed
    deepspeed.init_distributed(dist_backend="gloo")
    close_at_exit()   # DeepSpeed leaves torch's gloo group alive at exit: it can abort (runtime/group_exit.py)
    work = Path(work)
    a = _engine(deepspeed, stage, dtype, 0, sub_group_size)
    losses = {"A": _train(a, rank, 0, k)}
    a.save_checkpoint(str(work / "ds"), tag="k")
    losses["A"] += _train(a, rank, k, m)
    a.save_checkpoint(str(work / "ds_after"), tag="km")
    if (work / "zl").is_dir():
        b = _engine(deepspeed, stage, dtype, 1, sub_group_size)
        path, _ = b.load_checkpoint(str(work / "zl"))
        assert path is not None, "DeepSpeed found no checkpoint in WORK/zl"
        losses["B_steps"] = b.global_steps
        b.save_checkpoint(str(work / "zl_loaded"), tag="k")   # what DeepSpeed holds right after loading
        losses["B"] = _train(b, rank, k, m)
        b.save_checkpoint(str(work / "zl_then_ds"), tag="km")
    torch.save(losses, work / f"ds_losses.rank{rank}.pt")
    torch.distributed.barrier()


def main(argv):
    work, stage, world, dtype, k, m = argv[0], int(argv[1]), int(argv[2]), argv[3], int(argv[4]), int(argv[5])
    sub_group_size = int(argv[6]) if len(argv) > 6 else None
    import socket
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    torch.multiprocessing.spawn(rank_main, args=(work, stage, world, dtype, k, m, port, sub_group_size), nprocs=world, join=True)
    for p in Path(work).glob("*/*.py"):   # DeepSpeed's copies of its converter scripts
        p.unlink()


if __name__ == "__main__":
    main(sys.argv[1:])
