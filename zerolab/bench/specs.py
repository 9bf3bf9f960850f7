"""Who runs in ``python -m zerolab bench``: one ``Spec`` per contender (chapter 12).

``compare_specs``: ours at each stage, then its peers (``peers.PEERS``), all on
one DeepSpeed-style config; ``overlap_specs``: ours only, ``overlap_comm`` off and
on, on raw loopback and on a simulated link. The notes say what was skipped.
"""
from __future__ import annotations

from dataclasses import dataclass

from zerolab.bench import peers as bp


@dataclass
class Spec:
    """One contender: which runner, which stage, which config."""
    key: str     # unique in a run, e.g. "ours-1", "deepspeed-1", "ours-2-overlap-demo"
    kind: str    # a key of bench_peers.KINDS
    stage: int
    label: str
    cfg: dict


def model_params(preset: str) -> int:
    return sum(p.numel() for p in bp.build_model(preset).parameters())


def compare_specs(stages, world_size: int, batch: int, overlap_comm=None,
                  bucket=None) -> tuple[list[Spec], list[str]]:
    """Ours at each stage, then its peers (bench_peers.PEERS); notes say what was skipped.
    ``overlap_comm`` / ``bucket`` go into the config ours and DeepSpeed share (None: defaults)."""
    specs, notes, micro = [], [], batch // world_size
    have_ds = bp.deepspeed_available()
    if not have_ds and any(s in (1, 2, 3) for s in stages):
        notes.append("DeepSpeed is not installed (pip install 'zerolab[bench]'): its rows are skipped")
    for s in stages:
        cfg = bp.ds_config(s, micro, overlap_comm=overlap_comm, bucket=bucket)
        if bp.ours_available(s):
            specs.append(Spec(f"ours-{s}", "ours", s, bp.label("ours", s), cfg))
        else:
            notes.append(f"zerolab stage {s} is not implemented yet: only its peers run")
        for kind in bp.PEERS[s]:
            if kind == "deepspeed" and not have_ds:
                continue
            specs.append(Spec(f"{kind}-{s}", kind, s, bp.label(kind, s), cfg))
    if any(sp.kind == "deepspeed" for sp in specs) and bucket is None:
        notes.append("DeepSpeed allocates a reduce_bucket_size buffer up front (5e8 fp32 elements = 2 GB by "
                     "default); on CPU nobody touches its pages, so it is not resident and not in 'peak'")
    notes.append("algo MB/step counts the ring algorithm's bytes; gloo moves more (its reduce-scatter is an "
                 "all-reduce inside), so time, not bytes, is where gloo's choices show")
    return specs, notes


def overlap_specs(stages, world_size: int, batch: int, bucket: int, link: str) -> tuple[list[Spec], list[str]]:
    """Ours only: overlap_comm off/on x raw loopback / simulated ``link``."""
    specs, notes, micro = [], [], batch // world_size
    for s in stages:
        if not bp.ours_available(s):
            notes.append(f"zerolab stage {s} is not implemented yet: skipped")
            continue
        for where in (None, link):
            for overlap in (False, True):
                if s == 3:  # stage 3's overlap is prefetch: the next unit's all-gather in flight
                    knobs, what = dict(overlap_comm=overlap, stage3_prefetch_bucket_size=bucket if overlap else 0), \
                        "prefetch+overlap"
                else:
                    knobs, what = dict(overlap_comm=overlap), "overlap_comm"
                cfg = bp.ds_config(s, micro, bucket=bucket, link=where, **knobs)
                key = f"ours-{s}-{'overlap' if overlap else 'serial'}-{where or 'loopback'}"
                extra = f", {what} {'on' if overlap else 'off'}, {where or 'loopback'}"
                specs.append(Spec(key, "ours", s, bp.label("ours", s, extra), cfg))
    return specs, notes
