"""``python -m zerolab bench``'s arguments and entry point (``zerolab.cli.COMMANDS``).

Without ``--sweep``: the side-by-side bench (``runner.bench``); with it, the
scaling sweep (``sweep.sweep``), narrowed by the same ``--models``,
``--world-sizes`` and ``--stages``; with ``--meshes`` (or ``--3d``): ours under
tensor and pipeline parallelism beside PyTorch's (``mesh3d.bench_3d``); with
``--replay CLUSTER ...``: ours traced at each stage and replayed on modelled GPU
clusters (``replay.replay_bench``; modelled, nothing timed).
"""
from __future__ import annotations

from zerolab.bench import peers as bp
from zerolab.bench.runner import bench


# defaults: (bench, --sweep)
DEFAULTS = dict(world_sizes=([2, 4], [1, 2, 4]), steps=(2, 1), repeats=(10, 3), warmup=(2, 1), batch=(8, 4))


def add_bench_args(p):
    p.add_argument("--world-sizes", type=int, nargs="+", default=None, metavar="N",
                   help="default: 2 4 (--sweep: 1 2 4)")
    p.add_argument("--stages", type=int, nargs="+", default=[0, 1, 2, 3], choices=range(4), metavar="S")
    p.add_argument("--steps", type=int, default=None, help="timed steps per contender per round (default 2; --sweep 1)")
    p.add_argument("--repeats", type=int, default=None, help="interleaved rounds (default 10; --sweep 3)")
    p.add_argument("--warmup", type=int, default=None, help="untimed steps per contender first (default 2; --sweep 1)")
    p.add_argument("--model", choices=sorted(bp.BENCH_MODELS), default="small")
    p.add_argument("--batch", type=int, default=None,
                   help="global batch (rows of seq_len tokens; default 8; --sweep: 4, the strong-scaling batch)")
    p.add_argument("--sweep", action="store_true",
                   help="the scaling sweep: --models x --world-sizes x --stages, strong and weak scaling, "
                        "memory against the formula (adds 'sweep' to bench.json, writes sweep.png and sweep.md)")
    p.add_argument("--models", nargs="+", choices=sorted(bp.BENCH_MODELS), default=None, metavar="MODEL",
                   help="--sweep: TinyGPT presets (default: small medium large)")
    p.add_argument("--micro-batch", type=int, default=1, help="--sweep: rows per rank for weak scaling")
    p.add_argument("--no-peers", dest="peers", action="store_false", help="--sweep: ours only")
    p.add_argument("--out", default="build/bench", help="folder for bench.json and bench.png ('' = none)")
    p.add_argument("--overlap", action="store_true", help="ours only: overlap_comm off/on, loopback and --link")
    p.add_argument("--link", default=None, help="simulated link for --overlap (zerolab.theory.network.LINKS; default demo)")
    p.add_argument("--bucket", type=float, default=None,
                   help="reduce/allgather_bucket_size in elements for ours and DeepSpeed (default: DeepSpeed's "
                        "5e8; with --overlap: Ψ/4)")
    p.add_argument("--overlap-comm", choices=("on", "off"), default=None,
                   help="overlap_comm for ours and DeepSpeed (default: DeepSpeed's, off for stages 0-2)")
    p.add_argument("--no-memory", dest="memory", action="store_false", help="skip the profiler memory pass")
    p.add_argument("--timeout", type=float, default=1800, help="seconds per world size")
    p.add_argument("--meshes", nargs="+", default=None, metavar="DPxTPxPP",
                   help="3D instead of the DP bench: ours under TP / PP beside DTensor TP + FSDP2 and "
                        "torch.distributed.pipelining, one launch per mesh (e.g. 2x2x1 1x1x2 or 2x2x1,1x1x2; "
                        "--3d = 2x2x1 1x1x2 2x1x2); writes bench3d.json and bench3d.md")
    p.add_argument("--replay", nargs="+", default=None, metavar="CLUSTER",
                   help="instead of timing: trace ours at each --stages and --world-sizes and replay the traces on "
                        "modelled GPU clusters (zl.replay presets, e.g. dgx-h100 dgx-h100:2 cloud-100gbe:2); "
                        "writes replay.json and replay.md (modelled, not measured)")
    p.add_argument("--3d", dest="three_d", action="store_true", help="the same as --meshes 2x2x1 1x1x2 2x1x2")


def cmd_bench(args) -> int:
    meshes = [m for text in args.meshes or [] for m in text.split(",") if m]
    meshes = meshes or (["2x2x1", "1x1x2", "2x1x2"] if args.three_d else None)
    if meshes:
        return _cmd_meshes(args, meshes)
    if args.replay:
        return _cmd_replay(args)
    for name, (plain, sweep) in DEFAULTS.items():
        if getattr(args, name) is None:
            setattr(args, name, sweep if args.sweep else plain)
    if args.sweep:
        from zerolab.bench.sweep import SWEEP_MODELS, sweep
        if args.overlap or args.link is not None:
            raise ValueError("--sweep times the contenders side by side: no --overlap or --link")
        sweep(models=args.models or SWEEP_MODELS, world_sizes=args.world_sizes, stages=args.stages,
              global_batch=args.batch, micro_batch=args.micro_batch, steps=args.steps, repeats=args.repeats,
              warmup=args.warmup, out=args.out, timeout=args.timeout, peers=args.peers)
        return 0
    if args.models is not None:
        raise ValueError("--models narrows --sweep; the bench takes one --model")
    if args.link is not None:
        from zerolab.theory.network import get_link
        get_link(args.link)  # ValueError names the presets
    bench(world_sizes=args.world_sizes, stages=args.stages, steps=args.steps, repeats=args.repeats,
          model=args.model, out=args.out, overlap=args.overlap, link=args.link,
          bucket=int(args.bucket) if args.bucket else None,
          overlap_comm=None if args.overlap_comm is None else args.overlap_comm == "on",
          batch=args.batch, warmup=args.warmup, memory=args.memory, timeout=args.timeout)
    return 0


def _cmd_meshes(args, meshes) -> int:
    from zerolab.bench.mesh3d import bench_3d
    from zerolab.bench.peers3d import parse_mesh
    if args.sweep or args.overlap or args.link is not None or args.models is not None:
        raise ValueError("--meshes / --3d run ours beside the 3D peers: no --sweep, --overlap, --link or --models")
    if args.world_sizes is not None or args.stages != [0, 1, 2, 3]:
        raise ValueError("--meshes sets the ranks (dp*tp*pp) and the stages (TP: ZeRO-3, PP: ZeRO-1) itself: "
                         "no --world-sizes or --stages")
    for m in meshes:
        parse_mesh(m)   # ValueError names the form
    bench_3d(meshes=meshes, model=args.model, batch=args.batch or 8, steps=args.steps or 2,
             repeats=args.repeats or 5, warmup=args.warmup or 2, memory=args.memory, out=args.out,
             timeout=min(args.timeout, 900))
    return 0


def _cmd_replay(args) -> int:
    from zerolab.bench import replay as br
    if args.sweep or args.overlap or args.link is not None or args.models is not None:
        raise ValueError("--replay traces ours and replays it on modelled clusters: no --sweep, --overlap, --link "
                         "or --models")
    result = br.replay_bench(args.replay, stages=args.stages, world_sizes=args.world_sizes or DEFAULTS["world_sizes"][0],
                             model=args.model, batch=args.batch or DEFAULTS["batch"][0],
                             overlap_comm=None if args.overlap_comm is None else args.overlap_comm == "on",
                             bucket=int(args.bucket) if args.bucket else None, timeout=min(args.timeout, 900))
    print(br.text(result), flush=True)
    if args.out:
        br.save(result, args.out)
    return 0
