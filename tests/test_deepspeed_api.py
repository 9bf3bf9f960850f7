"""``zerolab.deepspeed`` (issue 26): a DeepSpeed training script runs unchanged on zerolab.

The script is ``tests/deepspeed_train.py``'s ``train(deepspeed, argv)``: it
uses only ``deepspeed.*`` names. On 2 gloo ranks under ``zl.launch`` it must

* see DeepSpeed's batches: its ``DistributedSampler`` (shuffle, seed 0,
  padding, the script's ``set_epoch``), micro-batches of
  ``train_micro_batch_size_per_gpu`` -- checked against the order computed
  here from those rules, independently of the sampler;
* end at the parameters of single-process training (plain ``torch.optim.AdamW``
  over the union of the ranks' micro-batches, clipping at 1.0).

Where DeepSpeed imports, the same script runs under DeepSpeed 0.19 on CPU
(``torchrun``, ``DS_ACCELERATOR=cpu``, gloo) and both must agree on every
batch and, within 1e-5, every parameter. Unsupported arguments raise errors
naming the problem.
"""
from __future__ import annotations

import functools
import json
import math
import os
import socket
import sys
import time
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch.utils.data import DistributedSampler

from zerolab.bench.peers import deepspeed_available
import zerolab as zl
import script_util
import zerolab.deepspeed as zds
import deepspeed_train as script

TESTS = Path(__file__).resolve().parent
HAVE_DEEPSPEED = deepspeed_available()  # the real package, not a folder named deepspeed
LR, WD, CLIP, MICRO, GAS, WORLD, EPOCHS = 0.02, 0.01, 1.0, 4, 2, 2, 2


def ds_config(stage: int, optimizer: bool = True) -> dict:
    """Every default where DeepSpeed's differ from zerolab's is set: clipping, weight decay."""
    cfg = {"train_micro_batch_size_per_gpu": MICRO, "gradient_accumulation_steps": GAS, "gradient_clipping": CLIP,
           "zero_optimization": {"stage": stage}}
    if optimizer:
        cfg["optimizer"] = {"type": "AdamW", "params": {"lr": LR, "weight_decay": WD}}
    return cfg


def write(tmp_path, cfg) -> str:
    path = tmp_path / "ds_config.json"
    path.write_text(json.dumps(cfg))
    return str(path)


def _zerolab_rank(argv, kwargs):
    import zerolab.deepspeed as deepspeed   # the one line a DeepSpeed user changes
    return script.train(deepspeed, argv, **kwargs)


def run_zerolab(cfg_path, **kwargs) -> list[dict]:
    return zl.launch(_zerolab_rank, world_size=WORLD, args=(["--deepspeed_config", cfg_path], kwargs), timeout=180)


def expected_batches(rank: int, world: int = WORLD, n: int = script.N_SAMPLES) -> list[list[int]]:
    """DeepSpeed's order from its rules: per epoch a permutation seeded 0 + epoch (the script calls
    set_epoch), padded to a multiple of the world, every WORLD-th index from ``rank``, cut in MICRO."""
    out = []
    for epoch in range(EPOCHS):
        g = torch.Generator()
        g.manual_seed(epoch)
        order = torch.randperm(n, generator=g).tolist()
        total = math.ceil(n / world) * world
        mine = (order + order[: total - n])[rank:total:world]
        out += [mine[i: i + MICRO] for i in range(0, len(mine), MICRO)]
    return out


def reference(batches: list[list[list[int]]]) -> dict:
    """Single-process training over the same micro-batches: each step averages every rank's
    GAS micro-batch losses, clips the global norm, then torch.optim.AdamW."""
    torch.manual_seed(0)
    model = script.Net()
    opt = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=WD)
    _, x, y = script.dataset().tensors
    for step in range(len(batches[0]) // GAS):
        opt.zero_grad()
        for m in range(step * GAS, step * GAS + GAS):
            for rank_batches in batches:
                idx = torch.tensor(rank_batches[m])
                (F.mse_loss(model(x[idx]), y[idx]) / (GAS * len(batches))).backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP)
        opt.step()
    return {n: p.detach() for n, p in model.named_parameters()}


def assert_params_close(got: dict, want: dict, atol: float = 1e-5):
    assert got.keys() == want.keys()
    worst = max((got[n] - want[n]).abs().max().item() for n in want)
    assert worst <= atol, f"parameters differ by up to {worst:.3g} (tolerance {atol:g})"


def check_like_one_process(results, workers=2):
    """``workers``: loader processes per rank -- DeepSpeed's 2, in a zl.launch rank (not daemonic) too."""
    world = len(results)
    for r, res in enumerate(results):
        assert res["rank"] == r and res["world_size"] == world and res["local_rank"] == r == res["args_local_rank"]
        assert res["batches"] == expected_batches(r, world), f"rank {r} did not see DeepSpeed's batches"
        assert res["global_steps"] == len(res["batches"]) // GAS
        assert res["global_samples"] == res["global_steps"] * MICRO * GAS * world
        assert res["lr"] == [LR] and res["micro"] == MICRO and res["gas"] == GAS
        assert res["workers"] == workers
    for res in results[1:]:
        assert_params_close(results[0]["final"], res["final"], atol=0)   # every rank holds the same model
    assert_params_close(results[0]["final"], reference([res["batches"] for res in results]))


# ---------------------------------------------------------------- zerolab alone (always runs)
@pytest.mark.slow
@pytest.mark.parametrize("stage, kwargs", [(0, {}), (1, {}), (2, {"client_optimizer": True}), (3, {"zero_init": True})],
                         ids=["stage0", "stage1", "stage2-client-optimizer", "stage3-zero-init"])
def test_script_runs_unchanged_and_trains_like_one_process(tmp_path, stage, kwargs):
    cfg = ds_config(stage, optimizer=not kwargs.get("client_optimizer"))
    results = run_zerolab(write(tmp_path, cfg), **kwargs)
    assert results[0]["stage"] == stage
    check_like_one_process(results)


@pytest.mark.slow
def test_planted_sampler_without_the_seed_is_caught(tmp_path, monkeypatch):
    # the bug this file guards against: a loader whose order is not DeepSpeed's (seed 1, not 0)
    monkeypatch.setattr("zerolab.deepspeed.data.DistributedSampler", functools.partial(DistributedSampler, seed=1))
    results = run_zerolab(write(tmp_path, ds_config(2)))
    with pytest.raises(AssertionError, match="did not see DeepSpeed's batches"):
        check_like_one_process(results)


def run_script(cfg_path, tmp_path, launcher: list, lib: str, *flags) -> list[dict]:
    """Run tests/deepspeed_train.py as a script (``launcher``: [] for ``python script.py``, or torchrun's)."""
    out = tmp_path / f"{lib}_result"
    env = {**os.environ, "DS_ACCELERATOR": "cpu", "OMP_NUM_THREADS": "1"}
    cmd = [sys.executable, *launcher, str(TESTS / "deepspeed_train.py"), "--lib", lib, "--out", str(out), *flags,
           "--deepspeed_config", cfg_path]
    r = script_util.run_script(cmd, env, timeout=400)
    assert r.returncode == 0, r.stderr[-4000:]
    world = int(launcher[launcher.index("--nproc-per-node") + 1]) if launcher else 1
    return [torch.load(f"{out}.rank{rank}", weights_only=False) for rank in range(world)]


def torchrun(world: int = WORLD) -> list:
    return ["-m", "torch.distributed.run", "--nproc-per-node", str(world), "--master-port", str(_free_port())]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.slow
@pytest.mark.parametrize("launcher", ["python", "torchrun"])
def test_the_script_runs_as_a_script(tmp_path, launcher):
    """``python script.py`` (one rank, started by init_distributed) and ``torchrun``: the loader starts
    DeepSpeed's 2 worker processes per rank there too."""
    cfg = write(tmp_path, ds_config(3))
    results = run_script(cfg, tmp_path, [] if launcher == "python" else torchrun(), "zerolab.deepspeed")
    check_like_one_process(results)


# ---------------------------------------------------------------- the same script under DeepSpeed itself
@pytest.mark.slow
@pytest.mark.skipif(not HAVE_DEEPSPEED, reason="DeepSpeed is not installed")
@pytest.mark.parametrize("stage, flags", [(2, ("--client_optimizer",)), (3, ("--zero_init",))],
                         ids=["stage2-client-optimizer", "stage3-zero-init"])
def test_same_script_under_deepspeed_gives_the_same_batches_and_parameters(tmp_path, stage, flags):
    cfg = write(tmp_path, ds_config(stage, optimizer="--client_optimizer" not in flags))
    theirs = run_script(cfg, tmp_path, torchrun(), "deepspeed", *flags)   # not daemonic: its loader's workers start
    ours = run_zerolab(cfg, **{f.lstrip("-"): True for f in flags})
    for r in range(WORLD):
        assert ours[r]["batches"] == theirs[r]["batches"], f"rank {r}: the two loaders' batches differ"
        for key in ("global_steps", "global_samples", "lr", "stage", "micro", "gas", "boundary", "local_rank",
                    "args_local_rank", "device", "loader_len"):
            assert ours[r][key] == theirs[r][key], key
        assert theirs[r]["workers"] == ours[r]["workers"] == 2   # DeepSpeed's loader workers, in zl.launch too
        assert_params_close(ours[r]["initial"], theirs[r]["initial"], atol=0)
        assert_params_close(ours[r]["final"], theirs[r]["final"])
        assert max(abs(a - b) for a, b in zip(ours[r]["losses"], theirs[r]["losses"])) < 1e-5


# ---------------------------------------------------------------- refusals name the problem (no process group needed)
def _model():
    torch.manual_seed(0)
    return script.Net()


@pytest.mark.parametrize("make_kwargs, error, match", [
    (lambda m: {"mpu": object()}, NotImplementedError, r"mpu=.*zerolab\.parallel"),
    (lambda m: {"mesh_param": (2, 1)}, NotImplementedError, "mesh_param"),
    (lambda m: {"optimizer": torch.optim.RMSprop(m.parameters())}, NotImplementedError,
     r"optimizer=<torch\.optim\.rmsprop\.RMSprop>.*cannot shard"),
    (lambda m: {"optimizer": lambda params: torch.optim.Adagrad(params)}, NotImplementedError, "Adagrad"),
    (lambda m: {"optimizer": torch.optim.Adam(m.parameters(), amsgrad=True)}, NotImplementedError, "amsgrad"),
    (lambda m: {"lr_scheduler": torch.optim.lr_scheduler.StepLR(torch.optim.SGD(m.parameters(), lr=0.1), 1)},
     ValueError, r"lr_scheduler=<StepLR>.*different optimizer"),
    (lambda m: {"config": None}, ValueError, "no config"),
    (lambda m: {"args": type("Args", (), {"deepspeed_config": "ds.json"})()}, ValueError, "both in args"),
    (lambda m: {"model": None}, ValueError, "requires a model"),
], ids=["mpu", "mesh", "rmsprop", "callable-adagrad", "amsgrad", "client-scheduler", "no-config", "two-configs",
        "no-model"])
def test_unsupported_arguments_are_refused_by_name(make_kwargs, error, match):
    model = _model()
    kwargs = {"model": model, "config": ds_config(2, optimizer=False), **make_kwargs(model)}
    with pytest.raises(error, match=match):
        zds.initialize(**kwargs)
    assert not torch.distributed.is_initialized()   # refused before any process group was started


def test_a_used_client_optimizer_is_refused():
    model = _model()
    opt = torch.optim.AdamW(model.parameters())
    model(torch.zeros(1, 4)).sum().backward()
    opt.step()
    with pytest.raises(ValueError, match="already taken steps"):
        zds.initialize(model=model, optimizer=opt, config=ds_config(2, optimizer=False))


def test_client_optimizer_groups_become_the_config_and_model_parameters():
    from zerolab.deepspeed.client import read_client_optimizer
    model = _model()
    opt = torch.optim.Adam([{"params": model.fc1.parameters(), "weight_decay": 0.1},
                            {"params": model.fc2.parameters(), "lr": 0.5}], lr=0.01, betas=(0.8, 0.9))
    section, groups, holder = read_client_optimizer(opt, None, model)
    assert holder is opt   # its param_groups hold the learning rates a client scheduler sets
    assert section == {"type": "Adam", "params": {"lr": 0.01, "betas": [0.8, 0.9], "eps": 1e-8, "weight_decay": 0,
                                                  "adam_w_mode": False}}
    assert [{k: v for k, v in g.items() if k != "params"} for g in groups] == [{"weight_decay": 0.1}, {"lr": 0.5}]
    assert groups[1]["params"] == list(model.fc2.parameters())


def test_zero_init_keeps_the_constructors_values_and_refuses_what_it_cannot_do():
    torch.manual_seed(0)
    with zds.zero.Init(config_dict_or_path=ds_config(3)):
        model = script.Net()
    want = _model()   # the same seed, built plainly
    assert all(p.is_meta for p in model.parameters())   # partitioned: one rank, so each piece is whole
    for (n, p), w in zip(model.named_parameters(), want.parameters()):
        assert torch.equal(p._zl_piece, w.detach().reshape(-1)), n
    with zds.zero.Init(enabled=False):
        assert not script.Net().fc1.weight.is_meta
    with pytest.raises(ValueError, match="torch.bfloat16"):
        zds.zero.Init(dtype=torch.int8)
    for kwargs, match in (({"module": model}, "module="), ({"mpu": object()}, "mpu"),
                          ({"remote_device": "cpu"}, "offload_param")):
        with pytest.raises(NotImplementedError, match=match):
            zds.zero.Init(**kwargs)
    with pytest.raises(NotImplementedError, match="fwd_module"):
        zds.zero.GatheredParameters(list(model.parameters()), fwd_module=model)


def test_add_config_arguments_are_deepspeeds():
    import argparse
    args = zds.add_config_arguments(argparse.ArgumentParser()).parse_args(["--deepspeed", "--deepspeed_config", "c.json"])
    assert (args.deepspeed, args.deepspeed_config, args.deepscale, args.deepscale_config) == (True, "c.json", False, None)
    if HAVE_DEEPSPEED:   # the same arguments, defaults and group as DeepSpeed's own
        import deepspeed
        ours = zds.add_config_arguments(argparse.ArgumentParser())
        theirs = deepspeed.add_config_arguments(argparse.ArgumentParser())
        strip = lambda p: [(a.dest, a.default, type(a).__name__, a.type) for a in p._actions]  # noqa: E731
        assert strip(ours) == strip(theirs)


# ---------------------------------------------------------------- the engine's DeepSpeed surface, on 2 ranks
def _surface(save_dir):
    import zerolab.deepspeed as deepspeed
    deepspeed.init_distributed(dist_backend="gloo")
    rank = deepspeed.comm.get_rank()
    t = torch.tensor([rank + 1.0])
    deepspeed.comm.all_reduce(t)
    deepspeed.comm.barrier()
    assert t.item() == 3.0 and deepspeed.comm.get_world_size() == WORLD
    sched_cfg = {"type": "WarmupLR", "params": {"warmup_max_lr": LR, "warmup_num_steps": 4, "warmup_type": "linear"}}
    torch.manual_seed(0)
    model = script.Net()
    engine, optimizer, loader, lr_scheduler = deepspeed.initialize(
        model=model, model_parameters=model.parameters(), config={**ds_config(2), "scheduler": sched_cfg})
    assert loader is None and engine.module is model and engine.fc1 is model.fc1   # unknown names: the model's
    torch.manual_seed(rank)
    x, y = torch.randn(4, 4), torch.randn(4, 2)
    lrs = []
    for _ in range(2 * GAS):
        assert engine.is_gradient_accumulation_boundary() == (engine.micro_steps % GAS == GAS - 1)
        engine.backward(F.mse_loss(engine(x), y))
        engine.step()
        lrs.append(lr_scheduler.get_lr())
        assert engine.get_lr() == lrs[-1] == [optimizer.param_groups[0]["lr"]]
    assert engine.global_steps == 2 and lr_scheduler.last_batch_iteration == 1
    assert engine.get_global_grad_norm() > 0   # the last step's norm before clipping (DeepSpeed's ZeRO-2 reports it)
    assert engine.was_step_applied() and engine.get_batch_info() == (MICRO * GAS * WORLD, MICRO, GAS)
    assert engine.optimizer_name() == "adamw"   # the config's type, lower case, as DeepSpeed
    for call, match in ((lambda: lr_scheduler.step(), "lr_scheduler.step"), (lambda: optimizer.step(), "engine.step"),
                        (lambda: engine.train_batch(), "train_batch.*PipelineModule"),
                        (lambda: engine.save_checkpoint(save_dir, save_latest=False), "latest")):
        with pytest.raises(NotImplementedError, match=match):
            call()
    with pytest.raises(AssertionError, match="ZeRO stage 2"), engine.no_sync():   # DeepSpeed's own refusal
        pass
    with pytest.raises(AttributeError, match="no attribute 'no_such_thing'"):
        engine.no_such_thing
    # checkpoints with DeepSpeed's keywords and return values
    assert engine.save_checkpoint(save_dir, client_state={"epoch": 3}) is True
    saved = {n: p.detach().clone() for n, p in model.named_parameters()}
    engine.backward(F.mse_loss(engine(x), y))
    engine.step()
    path, client_state = engine.load_checkpoint(save_dir)
    assert path.endswith("global_step2") and client_state == {"epoch": 3} and engine.global_steps == 2
    assert all(torch.equal(saved[n], p) for n, p in model.named_parameters())
    assert engine.save_16bit_model(save_dir, "model.bin") is True and engine.get_mom() == [(0.9, 0.999)]
    if rank == 0:
        assert torch.load(os.path.join(save_dir, "model.bin")).keys() == model.state_dict().keys()
    with pytest.warns(UserWarning, match="no 'latest'"):   # DeepSpeed warns too, and returns (None, None)
        assert engine.load_checkpoint(str(save_dir) + "-missing") == (None, None)
    # stage 1: no_sync is refused by zerolab (DeepSpeed allows it there); no optimizer: backward refuses
    e1, *_ = deepspeed.initialize(model=script.Net(), config=ds_config(1))
    with pytest.raises(NotImplementedError, match="gradient_accumulation_steps"), e1.no_sync():
        pass
    e0, opt0, _, sched0 = deepspeed.initialize(model=script.Net(), config=ds_config(0, optimizer=False))
    assert opt0 is None and sched0 is None and e0.get_lr() == []
    with pytest.raises(RuntimeError, match="must provide an optimizer"):
        e0.backward(e0(x).sum())
    return lrs


@pytest.mark.slow
def test_the_engine_answers_deepspeeds_calls(tmp_path):
    lrs = zl.launch(_surface, world_size=WORLD, args=(str(tmp_path / "ckpt"),), timeout=180)
    assert lrs[0] == lrs[1] and all(isinstance(lr, list) and len(lr) == 1 for lr in lrs[0])


class _Pids(torch.utils.data.Dataset):
    def __len__(self):
        return 64

    def __getitem__(self, i):
        return os.getpid()


def _rank_with_loader_workers(fail: bool):
    """A zl.launch rank iterating a DataLoader with 2 worker processes; rank 1 fails mid-epoch when told."""
    it = iter(torch.utils.data.DataLoader(_Pids(), batch_size=4, num_workers=2))
    pids = sorted({int(p) for _ in range(4) for p in next(it)})
    if fail and torch.distributed.get_rank() == 1:
        with open(os.environ["ZL_TEST_PIDS"], "w") as f:
            f.write(" ".join(map(str, pids)))
        raise ValueError("planted failure with live loader workers")
    torch.distributed.barrier()   # rank 0 is blocked here when rank 1 fails: launch must kill it
    return pids


def _alive(pid):
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


@pytest.mark.slow
def test_loader_workers_start_inside_launch_and_die_with_a_failed_rank(tmp_path, monkeypatch):
    results = zl.launch(_rank_with_loader_workers, world_size=2, args=(False,), timeout=120, threads=1)
    assert all(len(pids) == 2 and os.getpid() not in pids for pids in results)   # two worker processes each
    monkeypatch.setenv("ZL_TEST_PIDS", str(tmp_path / "pids"))
    with pytest.raises(zl.LaunchError, match="planted failure"):
        zl.launch(_rank_with_loader_workers, world_size=2, args=(True,), timeout=120, threads=1)
    pids = [int(p) for p in (tmp_path / "pids").read_text().split()]
    deadline = time.monotonic() + 15   # PyTorch's worker watchdog polls its parent every 5 s
    while any(_alive(p) for p in pids) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not any(_alive(p) for p in pids), "loader workers outlived their failed rank"


def test_repeating_loader_restarts():
    it = zds.utils.RepeatingLoader([1, 2, 3])
    assert [next(it) for _ in range(7)] == [1, 2, 3, 1, 2, 3, 1]
