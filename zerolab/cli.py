"""Command line: ``python -m zerolab <command>`` (chapter 12 uses ``estimate``).

Each subcommand is two small functions, ``add_<name>_args(parser)`` and
``cmd_<name>(args) -> exit code``, registered in ``COMMANDS``; adding one is
one line in that table.

    python -m zerolab estimate --params 7.5e9 --gpus 64 [--precision mixed]
        [--optimizer adam] [--offload-optimizer cpu] [--offload-param nvme]
        [--config ds.json] [--gpus-per-node 8] [--grad-accum 4] [--link nvlink3]

prints every ZeRO stage side by side: memory per GPU by category, host/NVMe
bytes when offloaded, bytes sent per step and their time on a link.
"""
from __future__ import annotations

import argparse
import sys

GB, MB = 1e9, 1e6
STAGE_NAMES = ("stage 0 (DDP)", "stage 1", "stage 2", "stage 3")


def parse_count(text: str) -> float:
    """'7.5e9', '7.5B', '350M', '1T' -> a number of parameters."""
    t = text.strip().lower().replace("_", "")
    scale = {"k": 1e3, "m": 1e6, "b": 1e9, "g": 1e9, "t": 1e12}.get(t[-1:], 1)
    try:
        value = float(t[:-1] if scale != 1 else t) * scale
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a parameter count: {text!r} (try 7.5e9 or 7.5B)") from None
    if value <= 0:
        raise argparse.ArgumentTypeError(f"parameter count must be > 0, got {text!r}")
    return value


def fmt_bytes(n: float) -> str:
    if n == 0:
        return "0"
    return f"{n / GB:,.2f} GB" if n >= 0.1 * GB else f"{n / MB:,.1f} MB"


def fmt_seconds(s: float) -> str:
    return f"{s * 1e3:,.1f} ms" if s < 10 else f"{s:,.1f} s"


# ---- estimate ----

def add_estimate_args(p: argparse.ArgumentParser):
    from zerolab.theory.network import LINKS
    from zerolab.theory import DEVICES, OPTIMIZERS, PRECISIONS
    p.add_argument("--params", type=parse_count, required=True, help="parameters Ψ, e.g. 7.5e9 or 7.5B")
    p.add_argument("--gpus", type=int, required=True, help="data-parallel ranks N")
    p.add_argument("--gpus-per-node", type=int, default=None, help="splits communication into intra/inter-node")
    p.add_argument("--precision", choices=PRECISIONS, default=None, help="default: mixed (or from --config)")
    p.add_argument("--optimizer", choices=OPTIMIZERS, default=None, help="default: adam (or from --config)")
    p.add_argument("--offload-optimizer", choices=DEVICES, default=None, help="applies to stages 1-3")
    p.add_argument("--offload-param", choices=DEVICES, default=None, help="applies to stage 3")
    p.add_argument("--grad-accum", type=int, default=None, help="micro-batches per optimizer step")
    p.add_argument("--config", default=None, help="a DeepSpeed JSON file: precision, optimizer, offload, "
                                                  "accumulation and ZeRO++ flags come from it")
    p.add_argument("--fp8", action="store_true", help="FP8 weights (1 byte each) beside the 16-bit recipe's "
                   "master and Adam states; parameter all-gathers in FP8 (chapter 1)")
    p.add_argument("--link", choices=sorted(LINKS), default=None, help="intra-node link (default nvlink3)")
    p.add_argument("--inter-link", choices=sorted(LINKS), default=None,
                   help="link between nodes (default infiniband-200g)")
    p.add_argument("--largest-layer", type=parse_count, default=None,
                   help="parameters of the largest layer (for DeepSpeed's ZeRO-3 figure)")


def _settings(args) -> dict:
    """Merge --config (if any) with explicit flags; flags win."""
    s = dict(precision="mixed", optimizer="adam", offload_optimizer="none", offload_param="none", grad_accum=1,
             quantized_weights=False, quantized_gradients=False, hpz=False, config_stage=None,
             gpus_per_node=args.gpus_per_node)
    if args.config:
        from zerolab.config import Config
        cfg = Config.from_deepspeed(args.config, world_size=args.gpus)
        z = cfg.zero
        momentum = float(cfg.optimizer.params.get("momentum", 0) or 0)
        s.update(precision=cfg.precision, grad_accum=cfg.gradient_accumulation_steps, config_stage=z.stage,
                 optimizer="sgd_momentum" if cfg.optimizer.type == "sgd" and momentum > 0 else cfg.optimizer.type,
                 offload_optimizer=z.offload_optimizer.device, offload_param=z.offload_param.device,
                 quantized_weights=z.zero_quantized_weights, quantized_gradients=z.zero_quantized_gradients,
                 hpz=z.zero_hpz_partition_size > 1)
        if s["hpz"] and s["gpus_per_node"] is None:
            s["gpus_per_node"] = z.zero_hpz_partition_size
    for key in ("precision", "optimizer", "offload_optimizer", "offload_param", "grad_accum"):
        if getattr(args, key) is not None:
            s[key] = getattr(args, key)
    return s


def estimate_table(args) -> str:
    """The side-by-side text table ``cmd_estimate`` prints."""
    from zerolab.theory import comm_breakdown, deepspeed_estimate, estimate, step_comm_time
    from zerolab.theory.comm import split_intra_inter
    from zerolab.theory.fp8 import fp8_comm_breakdown, fp8_step_comm_time
    from zerolab.theory.nodes import node_from_links
    s = _settings(args)
    psi, n, gpn = args.params, args.gpus, s["gpus_per_node"]
    if gpn is not None and (gpn < 1 or n % gpn and n > gpn):
        raise ValueError(f"--gpus-per-node must be >= 1 and divide --gpus={n}, got {gpn}")
    spans = gpn is not None and n > gpn
    fp8 = getattr(args, "fp8", False)
    if fp8 and any((s["quantized_weights"], s["quantized_gradients"], s["hpz"])):
        raise ValueError("--fp8 with the config's ZeRO++ keys (zero_quantized_weights, zero_quantized_gradients, "
                         "zero_hpz_partition_size): the estimate models one or the other, not both")
    link = args.link or "nvlink3"
    inter = (args.inter_link or "infiniband-200g") if spans else None
    cols, marks, notes = [], [], []
    for stage in range(4):
        off_opt = s["offload_optimizer"] if stage >= 1 else "none"
        off_par = s["offload_param"] if stage == 3 else "none"
        zpp = dict(quantized_weights=s["quantized_weights"], quantized_gradients=s["quantized_gradients"],
                   hpz=s["hpz"]) if stage == 3 else {}
        est = estimate(psi, n, stage, s["precision"], s["optimizer"], off_opt, off_par, fp8=fp8)
        comm = dict(dtype_bytes=2 if s["precision"] != "fp32" else 4, grad_accum=s["grad_accum"],
                    gpus_per_node=gpn, **zpp)
        if fp8:
            ops = fp8_comm_breakdown(psi, n, stage, s["grad_accum"], gpn)
            seconds = fp8_step_comm_time(psi, n, stage, node_from_links(link, inter, gpn), s["grad_accum"])
        else:
            ops = comm_breakdown(psi, n, stage, **comm)
            seconds = step_comm_time(psi, n, stage, link, inter_link=inter, **comm)
        split = split_intra_inter(ops)
        cols.append(dict(est=est, sent=split["intra"] + split["inter"], inter=split["inter"], time=seconds))
        marks.append("*" if s["config_stage"] == stage else "")
    if s["offload_optimizer"] != "none":
        notes.append(f"offload_optimizer={s['offload_optimizer']} applies to stages 1-3 (stage 0 keeps it on the GPU)")
    if s["offload_param"] != "none":
        notes.append(f"offload_param={s['offload_param']} applies to stage 3 only")
    if any((s["quantized_weights"], s["quantized_gradients"], s["hpz"])):
        notes.append("ZeRO++ flags from the config apply to the stage-3 column only")
    if s["config_stage"] is not None:
        notes.append(f"* the stage set in {args.config}")

    rows = [("GPU: params", lambda c: fmt_bytes(c["est"].params)),
            ("GPU: grads", lambda c: fmt_bytes(c["est"].grads)),
            ("GPU: optimizer state", lambda c: fmt_bytes(c["est"].optimizer)),
            ("GPU: total (model states)", lambda c: fmt_bytes(c["est"].total))]
    if s["offload_optimizer"] == "cpu" or s["offload_param"] == "cpu":
        rows.append(("host RAM per rank", lambda c: fmt_bytes(c["est"].host)))
    if "nvme" in (s["offload_optimizer"], s["offload_param"]):
        rows.append(("NVMe per rank", lambda c: fmt_bytes(c["est"].nvme)))
    rows.append(("sent per step per rank", lambda c: fmt_bytes(c["sent"])))
    if gpn is not None:
        rows.append(("  of which inter-node", lambda c: fmt_bytes(c["inter"])))
    where = f"{link}" + (f" in-node, {inter} between nodes" if inter else "")
    rows.append(("comm time per step", lambda c: fmt_seconds(c["time"])))
    ds = {2: deepspeed_estimate(psi, n, 2, offload_optimizer=s["offload_optimizer"] != "none").gpu}
    if args.largest_layer:
        ds[3] = deepspeed_estimate(psi, n, 3, largest_layer=args.largest_layer,
                                   offload_optimizer=s["offload_optimizer"] != "none",
                                   offload_param=s["offload_param"] != "none"
                                   and s["offload_optimizer"] != "none").gpu
    rows.append(("DeepSpeed's estimator, GPU", lambda c: fmt_bytes(ds[c["est"].stage]) if c["est"].stage in ds
                 else "-"))

    node_txt = f" ({gpn} per node)" if gpn else ""
    head = (f"zerolab estimate: psi = {psi:,.0f} parameters ({psi / 1e9:g}B), N = {n} GPUs{node_txt}\n"
            f"precision {s['precision']}{' + FP8 weights' if fp8 else ''}, optimizer {s['optimizer']}, gradient accumulation {s['grad_accum']}, "
            f"comm on {where} (alpha-beta, no overlap); GB = 1e9 bytes")
    width = max(len(r[0]) for r in rows) + 2
    colw = 16
    lines = [head, "", " " * width + "".join(f"{(name + m):>{colw}}" for name, m in zip(STAGE_NAMES, marks))]
    for label, get in rows:
        lines.append(f"{label:<{width}}" + "".join(f"{get(c):>{colw}}" for c in cols))
    lines += [""] + [f"note: {t}" for t in notes]
    lines.append("DeepSpeed's estimator counts fp32 gradients (ZeRO-2: 2Ψ + 18Ψ/N) and a gathered layer "
                 "(ZeRO-3: 4·largest_layer + 18Ψ/N); chapter 1 explains the difference.")
    return "\n".join(lines).rstrip() + "\n"


def cmd_estimate(args) -> int:
    print(estimate_table(args), end="")
    return 0


# name -> (help, add arguments, run); the lead adds grade, bench, exercises here
def add_gpu_check_args(p: argparse.ArgumentParser):
    pass


def cmd_gpu_check(args) -> int:
    from zerolab.runtime.gpu_check import main as gpu_main
    return gpu_main()


def _lazy(module: str, name: str):
    """(add_args, run) for a subcommand defined in zerolab.<module> as add_<name>_args / cmd_<name>."""
    from importlib import import_module

    def add(p):
        return getattr(import_module(f"zerolab.{module}"), f"add_{name}_args")(p)

    def run(args):
        return getattr(import_module(f"zerolab.{module}"), f"cmd_{name}")(args)
    return add, run


COMMANDS = {
    "estimate": ("memory and communication of every ZeRO stage, side by side", add_estimate_args, cmd_estimate),
    "gpu-check": ("on a machine with CUDA GPUs: the nccl path end to end", add_gpu_check_args, cmd_gpu_check),
    "grade": ("grade exercise notebooks under nbval, check by check", *_lazy("grading.grader", "grade")),
    "exercises": ("list the exercises, copy them to a folder, or reset one", *_lazy("grading.grader", "exercises")),
    "consolidate": ("a sharded checkpoint (zerolab's or DeepSpeed's) -> one fp32 state dict file",
                    *_lazy("engine.checkpoint.consolidate", "consolidate")),
    "convert": ("a checkpoint folder, zerolab's <-> DeepSpeed's (--to deepspeed|zerolab)",
                *_lazy("engine.checkpoint.ds_convert", "convert")),
    "bench": ("time zerolab against torch DDP, ZeroRedundancyOptimizer, FSDP2 and DeepSpeed", *_lazy("bench.cli", "bench")),
}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m zerolab", description="zerolab: the package behind the book")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    sub.required = True
    for name, (help_text, add_args, run) in COMMANDS.items():
        p = sub.add_parser(name, help=help_text, description=help_text)
        add_args(p)
        p.set_defaults(run=run)
    return parser


def main(argv=None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        code = args.run(args)
    except ValueError as e:       # includes ConfigError: a clear message, no traceback
        print(f"error: {e}", file=sys.stderr)
        code = 2
    if argv is None:
        sys.exit(code)
    return code
