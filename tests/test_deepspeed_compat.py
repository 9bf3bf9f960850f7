"""The README's DeepSpeed compatibility table is ``zerolab.deepspeed.compat.markdown()`` exactly, and every
name it marks supported or differs exists in ``zerolab.deepspeed`` (a renamed or removed call fails here)."""
from __future__ import annotations

import re
from pathlib import Path

import zerolab.deepspeed as zds
from zerolab.deepspeed import compat
from zerolab.deepspeed.engine import DeepSpeedEngine, DeepSpeedOptimizer, DeepSpeedScheduler
from zerolab.deepspeed.pipe_engine import PipelineEngine

README = Path(__file__).resolve().parents[1] / "README.md"


def readme_table() -> str:
    text = README.read_text()
    start, end = text.find(compat.BEGIN), text.find(compat.END)
    assert start >= 0 and end > start, "the README has no generated DeepSpeed compatibility table"
    return text[start:end + len(compat.END)]


def test_readme_table_is_the_generated_one():
    assert readme_table() == compat.markdown(), ("README.md's DeepSpeed table differs from "
                                                 "zerolab.deepspeed.compat.markdown(): paste the new one in")


def _names(row: str):
    """``deepspeed.comm.get_rank / get_world_size`` -> ("deepspeed.comm", [attrs]); None for rows naming
    arguments or prose (``initialize(optimizer=...)``, ``the deepspeed launcher``)."""
    parts = row.split(" / ")
    if any("(" in p or " " in p for p in parts) or "." not in parts[0]:
        return None
    owner, first = parts[0].rsplit(".", 1)
    return owner, [first, *parts[1:]]


OWNERS = {"engine": (DeepSpeedEngine, PipelineEngine), "optimizer": (DeepSpeedOptimizer,),
          "lr_scheduler": (DeepSpeedScheduler,)}
# set per instance in DeepSpeedEngine.__init__, not class attributes
INSTANCE = {"local_rank", "config"}


def _owner(owner: str):
    if owner in OWNERS:
        return OWNERS[owner]
    obj = zds
    for part in owner.split(".")[1:]:   # deepspeed.comm -> zerolab.deepspeed.comm
        obj = getattr(obj, part)
    return (obj,)


def test_every_listed_name_exists():
    checked = 0
    for name, status, why in compat.TABLE:
        assert status in (compat.SUPPORTED, compat.DIFFERS, compat.REFUSED) and why
        found = _names(name)
        if found is None or status == compat.REFUSED:
            continue
        owner, attrs = found
        for attr in attrs:
            assert attr in INSTANCE or all(hasattr(t, attr) for t in _owner(owner)), \
                f"{name}: {attr} is not in zerolab.deepspeed"
            checked += 1
    assert checked >= 30


def test_table_counts():
    c = compat.counts()
    assert sum(c.values()) == len(compat.TABLE) and all(c.values())
    for line in [l for l in compat.markdown().splitlines()[1:-1] if l != "|---|---|---|"]:
        assert line.startswith("| ") and not re.search(r"\|\s*\|", line), line   # no empty cell


def test_set_random_seed_seeds_python_numpy_and_torch():
    import random

    import numpy as np
    import torch

    import zerolab.deepspeed as deepspeed

    def draw():
        return random.random(), float(np.random.rand()), torch.rand(3).tolist()
    deepspeed.runtime.utils.set_random_seed(3)
    a = draw()
    deepspeed.runtime.utils.set_random_seed(3)
    assert draw() == a
    deepspeed.runtime.utils.set_random_seed(4)
    assert all(x != y for x, y in zip(draw(), a))
