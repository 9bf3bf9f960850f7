"""Read checkpoint files written by DeepSpeed itself (ZeRO-1/2/3), safely and without DeepSpeed (chapter 8).

What DeepSpeed writes in ``<dir>/<tag>/`` (``<dir>/latest`` names the tag):

    mp_rank_00_model_states.pt                    stages 1-2 (rank 0): buffers, parameter names and shapes
    zero_pp_rank_{r}_mp_rank_00_model_states.pt   stage 3 (every rank): the same, and frozen-parameter fragments
    [bf16_]zero_pp_rank_{r}_mp_rank_00_optim_states.pt   rank r's fp32 master partition and Adam moments

This file finds the tag and the files and unpickles them; ``ds_merge.py``
turns the partitions back into whole fp32 weights.

DeepSpeed's files pickle four DeepSpeed objects besides tensors and
containers. They are read with torch's restricted (``weights_only``)
unpickler, which maps exactly these names to plain values and refuses any
other class with an error naming it and the file (never ``weights_only=False``
on a file that may come from anyone):

    deepspeed.runtime.zero.config.ZeroStageEnum            -> int (the stage)
    deepspeed.runtime.fp16.loss_scaler.LossScaler          -> dict of its fields
    deepspeed.runtime.fp16.loss_scaler.DynamicLossScaler   -> dict of its fields
    deepspeed.utils.tensor_fragment.fragment_address       -> dict(numel=, start=)
"""
from __future__ import annotations

import pickle
import pickletools
import re
import zipfile
from pathlib import Path

import torch


class UnsafeCheckpointError(ValueError):
    """A checkpoint file pickles something that is neither a tensor nor one of DeepSpeed's known plain classes."""


class PlainRecord(dict):
    """Stand-in for a pickled DeepSpeed object: the object's fields as a dict."""

    def __setstate__(self, state):
        parts = state if isinstance(state, tuple) else (state,)
        for part in parts:                       # (dict, slots) or dict
            if part:
                self.update(part)


def zero_stage_value(value):
    """Stand-in for ``ZeroStageEnum(value)``: the stage as an int."""
    return int(value)


DEEPSPEED_NAMES = {
    "deepspeed.runtime.zero.config.ZeroStageEnum": zero_stage_value,
    "deepspeed.runtime.fp16.loss_scaler.LossScaler": PlainRecord,
    "deepspeed.runtime.fp16.loss_scaler.DynamicLossScaler": PlainRecord,
    "deepspeed.utils.tensor_fragment.fragment_address": PlainRecord,
}
# what torch itself pickles in a checkpoint (its weights_only unpickler allows these too)
TORCH_NAMES = re.compile(r"(collections\.OrderedDict|torch\.(\w+Storage|Size|Tensor|device|dtype|float\w*|bfloat16"
                         r"|int\w*|uint\w*|bool|complex\w*)|torch\._utils\._rebuild_\w+|torch\._tensor\._rebuild_\w+"
                         r"|torch\.nn\.parameter\.Parameter|builtins\.(set|frozenset|bytearray|slice|complex))")


def pickle_globals(path: Path) -> list[str]:
    """Every class or function a torch zip checkpoint's pickle names (read from data.pkl, no tensors loaded)."""
    with zipfile.ZipFile(path) as z:
        pkl = [n for n in z.namelist() if n.endswith("/data.pkl") or n == "data.pkl"]
        if not pkl:
            raise ValueError(f"{path}: not a torch checkpoint (no data.pkl inside the zip)")
        data = z.read(pkl[0])
    found, strings, memo = [], [], {}
    for op, arg, _ in pickletools.genops(data):
        if op.name in ("GLOBAL", "INST"):
            found.append(arg.replace(" ", "."))
        elif op.name in ("SHORT_BINUNICODE", "BINUNICODE", "UNICODE", "BINUNICODE8"):
            strings.append(arg)
        elif op.name in ("BINGET", "LONG_BINGET", "GET"):
            strings.append(memo.get(arg))
        elif op.name in ("BINPUT", "LONG_BINPUT", "PUT") and strings:
            memo[arg] = strings[-1]
        elif op.name == "MEMOIZE" and strings:
            memo[len(memo)] = strings[-1]
        elif op.name == "STACK_GLOBAL":
            if len(strings) < 2 or None in strings[-2:]:
                found.append("<a class whose name is computed at load time>")
            else:
                found.append(f"{strings[-2]}.{strings[-1]}")
    return found


def load_restricted(path) -> dict:
    """``torch.load`` a DeepSpeed file with only tensors, containers and the four DeepSpeed names allowed."""
    path = Path(path)
    try:
        names = pickle_globals(path)
    except (zipfile.BadZipFile, EOFError, ValueError) as e:
        raise ValueError(f"{path}: cannot read it as a torch checkpoint ({e})") from None
    refused = sorted({n for n in names if n not in DEEPSPEED_NAMES and not TORCH_NAMES.fullmatch(n)})
    if refused:
        raise UnsafeCheckpointError(
            f"{path}: refusing to load: its pickle names {', '.join(refused)}, which is not a tensor, a container "
            f"or one of the DeepSpeed classes this reader knows ({', '.join(sorted(DEEPSPEED_NAMES))}). "
            f"Loading it could run arbitrary code.")
    allowed = [(obj, name) for name, obj in DEEPSPEED_NAMES.items()]
    try:
        with torch.serialization.safe_globals(allowed):
            obj = torch.load(path, map_location="cpu", weights_only=True, mmap=True)
    except pickle.UnpicklingError as e:
        raise UnsafeCheckpointError(f"{path}: refused by torch's restricted unpickler: {e}") from None
    except (RuntimeError, EOFError, OSError) as e:
        raise ValueError(f"{path}: corrupt or truncated checkpoint file ({e})") from None
    return plain(obj)


def plain(obj):
    """Replace the stand-ins by plain dicts, recursively (tensors untouched; an OrderedDict stays one)."""
    if isinstance(obj, dict):
        kind = dict if isinstance(obj, PlainRecord) else type(obj)
        return kind((k, plain(v)) for k, v in obj.items())
    if isinstance(obj, list):
        return [plain(v) for v in obj]
    return obj


def natural_key(path: Path):
    """Sort rank files by rank number: rank_2 before rank_10."""
    return [int(t) if t.isdigit() else t for t in re.split(r"(\d+)", path.name)]


def checkpoint_files(tag_dir: Path) -> tuple[list[Path], list[Path]]:
    """(model-state files, optimizer-state files) of one DeepSpeed tag directory, in rank order."""
    model = sorted(tag_dir.glob("*_model_states.pt"), key=natural_key)
    optim = sorted(tag_dir.glob("*_optim_states.pt"), key=natural_key)
    return model, optim


def resolve_tag_dir(checkpoint_dir, tag=None) -> Path:
    """``<dir>/<tag>``, the tag read from ``<dir>/latest`` when not given (``dir`` may be the tag folder)."""
    root = Path(checkpoint_dir)
    if not root.is_dir():
        raise FileNotFoundError(f"checkpoint directory {root} does not exist")
    if tag is None and checkpoint_files(root)[1]:
        return root
    if tag is None:
        latest = root / "latest"
        if not latest.is_file():
            raise FileNotFoundError(f"{root}: no 'latest' file naming the checkpoint tag; pass tag= "
                                    f"(tags here: {sorted(p.name for p in root.iterdir() if p.is_dir())})")
        tag = latest.read_text().strip()
    tag_dir = root / str(tag)
    if not tag_dir.is_dir():
        raise FileNotFoundError(f"{root}: no directory for tag {tag!r}")
    return tag_dir


def is_deepspeed_checkpoint(checkpoint_dir, tag=None) -> bool:
    """True when ``checkpoint_dir`` (or its ``latest``/``tag`` subdirectory) holds a checkpoint saved by
    DeepSpeed: ZeRO rank files whose model states carry DeepSpeed's ``ds_version`` key. Reads only the
    small pickle of one model-state file, no tensor."""
    try:
        tag_dir = resolve_tag_dir(checkpoint_dir, tag)
    except FileNotFoundError:
        return False
    model, optim = checkpoint_files(tag_dir)
    if not model or not optim:
        return False
    try:
        with zipfile.ZipFile(model[0]) as z:
            pkl = [n for n in z.namelist() if n.endswith("data.pkl")]
            return bool(pkl) and b"ds_version" in z.read(pkl[0])
    except (zipfile.BadZipFile, OSError):
        return False


def read_model_states(files: list[Path]) -> list[dict]:
    out = []
    for f in files:
        sd = load_restricted(f)
        for key in ("buffer_names", "param_shapes", "module"):
            if key not in sd:
                raise ValueError(f"{f}: not a DeepSpeed model-state file (no {key!r} key)")
        out.append({
            "buffers": {k: v.float() if v.is_floating_point() else v
                        for k, v in sd["module"].items() if k in sd["buffer_names"]},
            "param_shapes": sd["param_shapes"],
            "frozen_shapes": sd.get("frozen_param_shapes") or {},
            "frozen_fragments": sd.get("frozen_param_fragments") or {},
            "shared": list((sd.get("shared_params") or {}).items()),
        })
    return out
