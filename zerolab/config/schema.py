"""The readers every config section uses (chapter 12): JSON with comments, typed values, key tables.

Each section of the DeepSpeed JSON has a file beside this one holding its key
table, its defaults (a dataclass) and its reader: ``zero`` (zero_optimization
and its offload sections), ``optimizer`` (optimizer, scheduler), ``precision``
(fp16, bf16, data_types) and ``core`` (the top level and the ``"zerolab"``
section). This file has only what they share.
"""
from __future__ import annotations

import difflib
import json
import os
import warnings


class ConfigError(ValueError):
    """A DeepSpeed-style config that zerolab cannot accept; names the key and what is allowed."""


def strip_comments(text: str) -> str:
    """Remove // and # comments and trailing commas outside JSON strings."""
    out, i, n, in_str = [], 0, len(text), False
    while i < n:
        c = text[i]
        if in_str:
            out.append(c)
            if c == "\\" and i + 1 < n:
                out.append(text[i + 1])
                i += 1
            elif c == '"':
                in_str = False
        elif c == '"':
            in_str = True
            out.append(c)
        elif c == "#" or text.startswith("//", i):
            while i < n and text[i] != "\n":
                i += 1
            continue
        elif c in "}]":
            j = len(out) - 1                       # drop a trailing comma before } or ]
            while j >= 0 and out[j].isspace():
                j -= 1
            if j >= 0 and out[j] == ",":
                del out[j]
            out.append(c)
        else:
            out.append(c)
        i += 1
    return "".join(out)


def load_json(ds) -> dict:
    """A dict, a path to a JSON file (comments allowed), or JSON text."""
    if isinstance(ds, dict):
        return ds
    if isinstance(ds, (str, os.PathLike)):
        if isinstance(ds, str) and ds.lstrip().startswith("{"):
            text, where = ds, "config text"
        else:
            try:
                with open(ds, encoding="utf-8") as f:
                    text, where = f.read(), os.fspath(ds)
            except OSError as e:
                raise ConfigError(f"cannot read config file {os.fspath(ds)!r}: {e.strerror}") from None
        try:
            data = json.loads(strip_comments(text))
        except json.JSONDecodeError as e:
            raise ConfigError(f"{where}: not valid JSON (after removing comments): {e}") from None
        if not isinstance(data, dict):
            raise ConfigError(f"{where}: the top level must be a JSON object, got {type(data).__name__}")
        return data
    raise ConfigError(f"config must be a dict, a path or a zerolab.Config, got {type(ds).__name__}")


def section(raw, path: str, ignored: list, known, aliases=None, skip=()) -> dict:
    """Check a section's keys against its table: ``known`` keys are kept (``aliases``, DeepSpeed's
    short names, resolved), ``skip`` keys (valid in DeepSpeed, not implemented here) go to
    ``ignored``, unknown keys warn with the closest known one."""
    if raw is None:
        return {}
    if not isinstance(raw, dict):
        raise ConfigError(f"{path or 'config'}: expected a JSON object, got {raw!r}")
    aliases = aliases or {}
    out = {}
    for key, value in raw.items():
        name = aliases.get(key, key)
        full = f"{path}.{key}" if path else key
        if name in known:
            if name in out:
                raise ConfigError(f"{full}: given twice (once under an alias)")
            out[name] = value
        elif key in skip:
            ignored.append(full)
        else:
            close = difflib.get_close_matches(key, list(known) + list(aliases) + list(skip), n=1)
            hint = f"; did you mean {close[0]!r}?" if close else f"; known keys: {', '.join(known)}"
            warnings.warn(f"unknown key {full!r}{hint} (ignored)", UserWarning, stacklevel=4)
    return out


def is_auto(v) -> bool:
    return v is None or (isinstance(v, str) and v.strip().lower() == "auto")


def read_int(d: dict, key: str, path: str, default, minimum=0):
    """An integer >= minimum; accepts 5e8, "5e8", "auto" (-> default)."""
    if key not in d or is_auto(d[key]):
        return default
    v, full = d[key], f"{path}.{key}" if path else key
    if isinstance(v, str):
        try:
            v = float(v)
        except ValueError:
            raise ConfigError(f"{full}: expected an integer >= {minimum} (e.g. 5e8), got {d[key]!r}") from None
    if isinstance(v, bool) or not isinstance(v, (int, float)) or v != v or v != int(v):
        raise ConfigError(f"{full}: expected an integer >= {minimum} (e.g. 5e8), got {d[key]!r}")
    if v < minimum:
        raise ConfigError(f"{full}: must be >= {minimum}, got {d[key]!r}")
    return int(v)


def read_float(d: dict, key: str, path: str, default, minimum=0.0):
    if key not in d or is_auto(d[key]):
        return default
    v, full = d[key], f"{path}.{key}" if path else key
    if isinstance(v, bool) or not isinstance(v, (int, float)) or v != v:
        raise ConfigError(f"{full}: expected a number >= {minimum}, got {v!r}")
    if v < minimum:
        raise ConfigError(f"{full}: must be >= {minimum}, got {v!r}")
    return float(v)


def read_bool(d: dict, key: str, path: str, default):
    if key not in d or is_auto(d[key]):
        return default
    v = d[key]
    if not isinstance(v, bool):
        raise ConfigError(f"{path}.{key}: expected true or false, got {v!r}")
    return v


def read_choice(d: dict, key: str, path: str, default, allowed, lower=True):
    if key not in d or is_auto(d[key]):
        return default
    v = d[key]
    norm = v.lower() if (lower and isinstance(v, str)) else v
    if norm not in allowed:
        raise ConfigError(f"{path}.{key}: {v!r} is not allowed; expected one of {allowed}")
    return norm
