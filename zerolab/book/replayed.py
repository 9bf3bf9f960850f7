"""Small traced runs, replayed on modelled GPU clusters: the clock of the book's timing lessons (chapters 3-6, 9).

A laptop's wall time says nothing about GPUs: gloo's collectives run on the same cores as the
compute. So each timing lesson records the engine's *real schedule* on a few CPU ranks, once
per setting, and replays it with ``zl.replay`` on a named cluster (``theory.replay``):

* ``record(settings)`` launches the ranks once and traces one optimizer step per setting (after
  a warm-up step, which also records ZeRO-3's unit order). The model is a ``TinyGPT`` at toy width
  with the *target's* layer count, so the engine's order of units, buckets and collectives is the
  target's, unit by unit; ``replay(..., model=)`` gives every unit the target's bytes and FLOPs.
* ``replay_all(traces, cluster)``: one ``Replay`` per setting on ``cluster`` (``CLUSTERS``: one
  DGX H100 node; two cloud nodes with one 100 Gb/s NIC each).
* ``lesson(settings, clusters)``: both at once, ``{cluster: {name: Replay}}`` — what a chapter calls;
  ``table`` prints it, ``plot_replays`` draws rank 0's replayed lanes with ``plots.plot_timeline``.

Every number it returns is *replayed on a modelled cluster*, never measured.
"""
from __future__ import annotations

TOY = dict(vocab=96, n_head=2, d_model=32, seq_len=16)   # the recorded width; the replay sets the size
TARGET = "llama-2-7b"                                      # the default target shape (theory.SHAPES)
CLUSTERS = {"dgx-h100": "one DGX H100 node (8 GPUs on NVLink)",
            "cloud-100gbe:2": "2 cloud nodes of 8 A100, one 100 Gb/s NIC each"}
BATCH = 2                                                   # rows per rank in the recorded step


def layer_elements(d_model: int = TOY["d_model"]) -> int:
    """A bound on one recorded TinyGPT block's elements, under two blocks' (12·d² + 13·d each): the
    size of "one layer" in a bucket or the prefetch window."""
    return 16 * d_model * d_model


def config(zero: dict, bf16: bool = True, zerolab: dict | None = None) -> dict:
    """A traced run's config: the ring pair of collectives, ``zero`` on top of the replay's defaults.

    ZeRO-3's thresholds are the target's, not the toy's: nothing persistent and a unit released after
    use unless ``zero`` says otherwise; the prefetch window, when on, one recorded layer."""
    base = {"stage": 0, "stage3_param_persistence_threshold": 0, "stage3_max_reuse_distance": 0,
            "stage3_prefetch_bucket_size": layer_elements()}
    cfg = {"optimizer": {"type": "Adam", "params": {"lr": 1e-3}},
           "zero_optimization": {**base, **zero},
           "zerolab": {"trace": True, "collectives": "reduce_scatter", **(zerolab or {})}}
    if bf16:
        cfg["bf16"] = {"enabled": True}
    return cfg


def traced_steps(configs: dict, layers: int, batch: int = BATCH, warmup: bool = True) -> dict:
    """Runs on every rank: per setting, ``engine.events`` of one optimizer step after a warm-up step
    (``warmup=False``: the first step, enough where the order of collectives is fixed from the start)."""
    import torch
    import zerolab.engine as engine_api
    from zerolab.book.models import TinyGPT
    torch.set_num_threads(1)
    out = {}
    for name, cfg in configs.items():
        model = TinyGPT(n_layer=layers, **TOY)
        engine = engine_api.initialize(model, cfg)
        g = torch.Generator().manual_seed(engine.rank)
        x = torch.randint(0, TOY["vocab"], (batch, TOY["seq_len"]), generator=g)
        for _ in range(2 if warmup else 1):
            engine.events.clear()   # keeps the trace-meta record
            for _ in range(engine.gas):
                logits = engine(x)
                engine.backward(torch.nn.functional.cross_entropy(logits.flatten(0, 1).float(), x.flatten()))
                engine.step()
        out[name] = list(engine.events)
        engine.close()
    return out


def record(settings: dict, model=TARGET, world_size: int = 2, ranks_per_node: int | None = None,
           timeout: float = 600) -> dict:
    """``{name: traces}``: one traced step per setting (``name -> config``, see ``config``), all in one
    ``zl.launch`` of ``world_size`` ranks; the TinyGPT has ``model``'s layer count."""
    from zerolab.runtime.launch import launch
    from zerolab.theory.shapes import get_shape
    layers = get_shape(model).layers
    per_rank = launch(traced_steps, world_size=world_size, args=(settings, layers), threads=1,
                      ranks_per_node=ranks_per_node, timeout=timeout)
    return {name: [r[name] for r in per_rank] for name in settings}


def replay_all(traces: dict, cluster, model=TARGET) -> dict:
    """``{name: Replay}``: every setting's traces replayed on ``cluster`` at ``model``'s size."""
    from zerolab.theory.replay import replay
    return {name: replay(t, cluster, model=model) for name, t in traces.items()}


def table(replays: dict, title: str = "") -> str:
    """A text table of replayed step seconds, exposed communication and MFU, one row per setting and cluster.

    ``replays``: ``{cluster: {name: Replay}}``."""
    lines = [title] if title else []
    lines.append(f"{'cluster (modelled)':<22}{'setting':<28}{'step s':>9}{'exposed comm s':>16}{'MFU':>7}")
    for cluster, reps in replays.items():
        for name, rep in reps.items():
            lines.append(f"{cluster:<22}{name:<28}{rep.step_seconds:>9.3f}{rep.exposed_comm[0]:>16.3f}"
                         f"{rep.mfu:>7.0%}")
    return "\n".join(lines)


def lesson(settings: dict, clusters=tuple(CLUSTERS), model=TARGET, **record_kw) -> dict:
    """``{cluster: {name: Replay}}``: each setting (``name -> zero_optimization keys``, on top of
    ``config``'s) traced once and replayed on every cluster at ``model``'s size. ``record_kw``: for
    ``record`` (``world_size``, ``ranks_per_node``)."""
    traces = record({name: config(zero) for name, zero in settings.items()}, model=model, **record_kw)
    return {c: replay_all(traces, c, model=model) for c in clusters}


def plot_replays(replays: dict, names=None, rank: int = 0):
    """A figure of rank ``rank``'s replayed lanes (compute, all-gather, reduce-scatter), one panel per
    cluster and setting (``names``, default all), drawn by ``plots.plot_timeline`` as a measured run's
    lanes are; the panels of one cluster share its time axis. ``replays``: ``{cluster: {name: Replay}}``."""
    from matplotlib.figure import Figure
    from zerolab.book import plots
    panels = [(c, n) for c, reps in replays.items() for n in (names or reps)]
    fig = Figure(figsize=(10, 0.6 + 1.5 * len(panels)), layout="constrained")
    axes = fig.subplots(len(panels), 1, squeeze=False)[:, 0]
    for ax, (c, n) in zip(axes, panels):
        rep = replays[c][n]
        plots.plot_timeline(rep, ax=ax, ranks=[rank],
                            title=f"{n}: rank {rank} replayed on {rep.cluster} (modelled), "
                                  f"{rep.step_seconds:.3f} s per step")
        ax.set_xlim(0, 1.02e3 * max(r.step_seconds for r in replays[c].values()))
    return fig
