"""``zerolab-deepspeed`` / ``python -m zerolab.deepspeed``: DeepSpeed's launcher for an unchanged script.

    zerolab-deepspeed --num_gpus 2 train.py --deepspeed_config ds.json

takes DeepSpeed's launcher arguments where they make sense on one machine
(``--num_gpus``/``--num_accelerators``, ``--include``/``--exclude localhost:0,1``,
``--master_port``, ``--master_addr``, ``--module``, ``--no_python`` refused,
``--no_local_rank``; ``--num_nodes`` above 1, other hosts and ``--launcher`` are
refused by name) and starts the ranks with torchrun. Each rank runs the script
through ``run_child`` (``python -m zerolab.deepspeed.launch --child``), which adds
DeepSpeed's ``--local_rank=N`` argument, as DeepSpeed's launcher does. The
children's environment alone gets ``bootstrap/`` on ``PYTHONPATH`` and
``ZEROLAB_DEEPSPEED_ALIAS=1``: their ``import deepspeed`` (and
``importlib.metadata.version("deepspeed")``) is zerolab's (``hook.py``). This
process, and any started without the launcher, are left alone.
"""
from __future__ import annotations

import argparse
import os
import runpy
import subprocess
import sys

from zerolab.deepspeed.hook import ENV

BOOTSTRAP = os.path.join(os.path.dirname(os.path.abspath(__file__)), "bootstrap")


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="zerolab-deepspeed", description="DeepSpeed's launcher on zerolab: runs "
                                "USER_SCRIPT on N local ranks (torchrun) with `import deepspeed` = zerolab.deepspeed")
    p.add_argument("--num_gpus", "--num_accelerators", type=int, default=-1, dest="num_gpus",
                   help="ranks on this machine (default: the CUDA devices, else 1)")
    p.add_argument("--num_nodes", type=int, default=-1)
    p.add_argument("-i", "--include", type=str, default="", help="localhost:0,1 -- these local slots")
    p.add_argument("-e", "--exclude", type=str, default="", help="localhost:1 -- all local slots but these")
    p.add_argument("-H", "--hostfile", type=str, default=None)
    p.add_argument("--master_port", type=int, default=29500)
    p.add_argument("--master_addr", type=str, default="127.0.0.1")
    p.add_argument("--launcher", type=str, default="pdsh")
    p.add_argument("--module", action="store_true", help="USER_SCRIPT is a module name (python -m)")
    p.add_argument("--no_python", action="store_true")
    p.add_argument("--no_local_rank", action="store_true", help="do not pass --local_rank to the script")
    p.add_argument("user_script", type=str)
    p.add_argument("user_args", nargs=argparse.REMAINDER)
    return p


def _slots(spec: str) -> list[int]:
    """``localhost:0,1`` (or ``localhost``, ``127.0.0.1:0``) -> the slot numbers; other hosts refused."""
    out = []
    for part in spec.split("@"):
        host, _, slots = part.partition(":")
        if host not in ("localhost", "127.0.0.1"):
            raise SystemExit(f"zerolab-deepspeed: --include/--exclude host {host!r}: only this machine (localhost) "
                             f"is supported; zerolab's launcher starts ranks on one machine")
        out += [int(s) for s in slots.split(",") if s] if slots else []
    return out


def num_ranks(args, devices: int) -> int:
    if args.num_nodes > 1:
        raise SystemExit(f"zerolab-deepspeed: --num_nodes {args.num_nodes}: one machine only; for several run "
                         f"torchrun --nnodes on each")
    if args.hostfile and os.path.isfile(args.hostfile):
        raise SystemExit(f"zerolab-deepspeed: --hostfile {args.hostfile}: multi-node hostfiles are not supported")
    if args.launcher != "pdsh":
        raise SystemExit(f"zerolab-deepspeed: --launcher {args.launcher}: zerolab starts ranks with torchrun only")
    if args.no_python:
        raise SystemExit("zerolab-deepspeed: --no_python: the ranks run Python (zerolab.deepspeed)")
    if args.include and args.exclude:
        raise SystemExit("zerolab-deepspeed: --include and --exclude are mutually exclusive (as in DeepSpeed)")
    if args.include:
        slots = _slots(args.include)
        return len(slots) or max(devices, 1)
    n = args.num_gpus if args.num_gpus > 0 else max(devices, 1)
    if args.exclude:
        n -= len([s for s in _slots(args.exclude) if s < n])
    if n < 1:
        raise SystemExit("zerolab-deepspeed: no ranks left to start")
    return n


def child_env(env=None) -> dict:
    """The ranks' environment: the bootstrap first on PYTHONPATH, the alias switched on."""
    env = dict(os.environ if env is None else env)
    path = [BOOTSTRAP] + [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p]
    here = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    if here not in path:   # the children import this zerolab
        path.append(here)
    env.update(PYTHONPATH=os.pathsep.join(path), **{ENV: "1"})
    env.setdefault("DS_ACCELERATOR", "cuda" if _cuda_devices() else "cpu")
    return env


def _cuda_devices() -> int:
    try:
        import torch
        return torch.cuda.device_count() if torch.cuda.is_available() else 0
    except ImportError:
        return 0


def command(args) -> list[str]:
    n = num_ranks(args, _cuda_devices())
    cmd = [sys.executable, "-m", "torch.distributed.run", f"--nproc-per-node={n}", f"--master-port={args.master_port}",
           f"--master-addr={args.master_addr}", "-m", "zerolab.deepspeed.launch", "--child"]
    cmd += ["--no_local_rank"] if args.no_local_rank else []
    cmd += ["--module"] if args.module else []
    return cmd + [args.user_script, *args.user_args]


def run_child(argv: list[str]) -> None:
    """Inside a rank: DeepSpeed's ``--local_rank=N`` added, then the user's script as ``__main__``."""
    module = "--module" in argv[:2]
    local = "--no_local_rank" not in argv[:2]
    argv = [a for i, a in enumerate(argv) if not (i < 2 and a in ("--module", "--no_local_rank"))]
    script, rest = argv[0], argv[1:]
    if local:
        rest = rest + [f"--local_rank={os.environ.get('LOCAL_RANK', '0')}"]
    sys.argv = [script, *rest]
    if module:
        runpy.run_module(script, run_name="__main__", alter_sys=True)
    else:
        sys.path.insert(0, os.path.dirname(os.path.abspath(script)))
        runpy.run_path(script, run_name="__main__")


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv[:1] == ["--child"]:
        run_child(argv[1:])
        return 0
    args = parser().parse_args(argv)
    return subprocess.call(command(args), env=child_env())


if __name__ == "__main__":
    sys.exit(main())
