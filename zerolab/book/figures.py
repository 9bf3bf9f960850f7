"""Conceptual figures drawn from the package's real state (chapters 1, 3, 4, 5).

Not pictures pasted in: each figure reads what it shows from zerolab itself.

* ``holdings`` / ``partition_figure``: who holds which elements of the parameters,
  gradients and optimizer state at each ZeRO stage — the ZeRO paper's partition
  picture, laid out by the engine's own ``FlatParams`` (units, padding, shards)
  and sharded as ``zl.estimate`` says each stage shards (chapters 1, 3, 4, 5).
* ``bucket_path_figure``: the path of a gradient from autograd's hook to a bucket
  to a collective, with the buckets ``engine.buckets.group_units`` forms (DDP:
  all-reduce; ZeRO-1/2: reduce-scatter, then all-gather of the parameters).
* ``activation_figure``: activation bytes against sequence length, plain, with
  checkpointing and with FlashAttention (``zl.activation_memory``, chapter 1).

Every function draws on an ``Axes`` (or makes a figure) and returns
``(fig, alt)``: the figure and its alt text, a sentence describing what it shows,
for ``plots.show(fig, alt=alt)``.
"""
from __future__ import annotations

from zerolab.book.plots import COLORS, STAGE_NAMES, new_axes
from zerolab.engine.buckets import group_units
from zerolab.theory.activations import activation_memory
from zerolab.theory.memory import estimate

STATES = ("params", "grads", "optimizer")
LANE_BYTES = {"params": 2, "grads": 2, "optimizer": 12}     # mixed-precision Adam: lane height ∝ bytes


def sharded(stage: int) -> tuple[str, ...]:
    """The model states ``stage`` divides by N, read from ``zl.estimate`` (not a table of our own)."""
    full, split = estimate(10**6, 1, 0).as_dict(), estimate(10**6, 4, stage).as_dict()
    return tuple(c for c in STATES if split[c] < full[c])


def holdings(flat, stage: int) -> dict:
    """``{category: [[(start, end), ...] per rank]}``: the flat elements each rank holds.

    Replicated categories: every rank holds every unit's real elements. Sharded ones:
    rank r holds ``[offset + r*S, offset + (r+1)*S)`` of every unit (padding included).
    """
    n = flat.padded // flat.shard_numel if flat.shard_numel else 1
    cut = sharded(stage)
    out = {}
    for cat in STATES:
        out[cat] = [[(u.offset + r * u.shard, u.offset + (r + 1) * u.shard) if cat in cut
                     else (u.offset, u.offset + u.numel) for u in flat.units] for r in range(n)]
    return out


def partition_figure(flat, stages=(0, 1, 2, 3)):
    """One panel per stage: a row per rank, a lane per model state (height ∝ its bytes), flat elements across."""
    from matplotlib.figure import Figure
    from matplotlib.patches import Rectangle
    n = flat.padded // flat.shard_numel
    fig = Figure(figsize=(2.9 * len(stages) + 1.2, 1.4 + 0.75 * n), layout="constrained")
    axes = fig.subplots(1, len(stages), squeeze=False)[0]
    height = sum(LANE_BYTES.values())
    for ax, stage in zip(axes, stages):
        held = holdings(flat, stage)
        for r in range(n):
            y = r * (height + 4)
            for cat in STATES:
                ax.add_patch(Rectangle((0, y), flat.padded, LANE_BYTES[cat], facecolor="#eeeeee", edgecolor="none"))
                for a, b in held[cat][r]:
                    ax.add_patch(Rectangle((a, y), b - a, LANE_BYTES[cat], facecolor=COLORS[cat], edgecolor="none",
                                           label=cat if (r, a) == (0, 0) else None))
                y += LANE_BYTES[cat]
        for u in flat.units:
            ax.axvline(u.offset, color="white", linewidth=1.5)
            if u.padded > u.numel:      # a few elements: their true width, and a marker that stays visible
                ax.axvspan(u.offset + u.numel, u.offset + u.padded, color="black", alpha=0.25, linewidth=0)
                ax.plot([u.offset + u.numel] * n, [r * (height + 4) - 1.2 for r in range(n)], linestyle="none",
                        marker="v", markersize=4, color="black", gid="padding", clip_on=False)
        ax.set_xlim(0, flat.padded)
        ax.set_ylim(n * (height + 4) - 4, -3)                    # room above rank 0 for its padding marks
        ax.set_yticks([r * (height + 4) + height / 2 for r in range(n)], [f"rank {r}" for r in range(n)])
        ax.set_xticks([u.offset + u.padded / 2 for u in flat.units], [u.name for u in flat.units], fontsize=7,
                      rotation=90 if len(flat.units) > 4 else 0)
        cut = sharded(stage)
        ax.set_title(f"{STAGE_NAMES[stage]}\nsharded: {', '.join(cut) if cut else 'nothing'}", fontsize=9)
        if ax is not axes[0]:
            ax.set_yticks([])
    pads = {u.name: u.padded - u.numel for u in flat.units if u.padded > u.numel}
    handles = [Rectangle((0, 0), 1, 1, color=COLORS[c]) for c in STATES]
    labels = [f"{c} ({LANE_BYTES[c]} bytes/param)" for c in STATES]
    if pads:
        from matplotlib.lines import Line2D
        handles.append(Line2D([], [], linestyle="none", marker="v", markersize=4, color="black"))
        labels.append(f"padding ({min(pads.values())}-{max(pads.values())} zero elements per unit)")
    fig.legend(handles=handles, labels=labels, fontsize=8, ncols=2, loc="outside upper center",
               frameon=False)
    fig.supxlabel("flat parameter space (elements), unit after unit; grey: not held"
                  + ("; ▼: where a unit's padding starts" if pads else f"; no padding: N = {n} divides every unit"),
                  fontsize=8)
    alt = (f"Partition picture for {n} ranks and {len(flat.units)} units: for "
           + "; ".join(f"{STAGE_NAMES[s]} every rank holds "
                       + ", ".join(f"1/{n} of the {c}" if c in sharded(s) else f"all {c}" for c in STATES)
                       for s in stages) + "."
           + (" Padding, marked by a triangle: " + ", ".join(f"{k} {v}" for k, v in pads.items())
              + " zero element(s)." if pads else " No padding: every unit splits evenly."))
    return fig, alt


def bucket_path_figure(flat, bucket_size: int, op="all_reduce", gather_bucket=None, keep_shard=False, ax=None):
    """Hook -> bucket -> collective: units in backward order, grouped as ``group_units`` groups them."""
    from matplotlib.patches import FancyArrowPatch, Rectangle
    fig, ax = new_axes(ax, figsize=(9, 3.6))
    buckets = group_units(flat.units, bucket_size)
    order = [u for b in buckets for u in b]                    # backward order, as the hooks fire
    total = sum(u.padded for u in order)
    x, gap = 0.0, total * 0.015
    small, prev_small = 0, False
    palette = ["#4C72B0", "#DD8452", "#55A868", "#C44E52", "#8172B3", "#937860"]
    for i, b in enumerate(buckets):
        start = x
        for u in b:
            ax.add_patch(Rectangle((x, 2.2), u.padded, 0.6, facecolor=COLORS["grads"], edgecolor="white"))
            if u.padded >= 0.06 * total:
                ax.text(x + u.padded / 2, 2.5, u.name, ha="center", va="center", fontsize=7, color="white")
            else:   # too narrow for its name: above the box, alternating heights so neighbours do not collide
                small = small + 1 if prev_small else 0
                ax.text(x + u.padded / 2, 2.86 + 0.14 * (small % 2), u.name, ha="center", va="bottom", fontsize=6)
            prev_small = u.padded < 0.06 * total
            x += u.padded
        width = x - start
        ax.add_patch(Rectangle((start, 1.1), width, 0.6, facecolor=palette[i % 6], alpha=0.85))
        ax.text(start + width / 2, 1.4, f"bucket {i}\n{int(width):,} elements", ha="center", va="center", fontsize=7,
                color="white")
        ax.add_patch(FancyArrowPatch((start + width / 2, 2.15), (start + width / 2, 1.75), arrowstyle="-|>",
                                     mutation_scale=10))
        label = (f"{len(b)} x {op.replace('_', '-')}: each unit's\nas soon as it is complete,\nkeep own 1/N, free it"
                 if keep_shard else op.replace("_", "-"))      # stage 2 reduces unit by unit (stage2.reduce_units)
        ax.add_patch(FancyArrowPatch((start + width / 2, 1.05), (start + width / 2, 0.55), arrowstyle="-|>",
                                     mutation_scale=10))
        ax.text(start + width / 2, 0.3, f"{i + 1}. {label}", ha="center", va="center", fontsize=7)
        x += gap
    ax.text(-gap, 2.5, "gradients\n(hook fires)", ha="right", va="center", fontsize=8)
    ax.text(-gap, 1.4, "buckets", ha="right", va="center", fontsize=8)
    ax.text(-gap, 0.35, "collectives\n(in order)", ha="right", va="center", fontsize=8)
    alt = (f"Backward produces gradients from the last unit to the first; with reduce_bucket_size "
           f"{bucket_size:,} they form {len(buckets)} bucket(s) ("
           + "; ".join(f"bucket {i}: {' + '.join(u.name for u in b)}" for i, b in enumerate(buckets))
           + (f"); each unit is reduced by its own {op.replace('_', '-')} as soon as the unit is complete, without "
              f"waiting for the rest of its bucket, in backward order on every rank; the rank keeps its 1/N and frees "
              f"the unit's buffer" if keep_shard else
              f"), each reduced by one {op.replace('_', '-')} as soon as it is complete, in bucket order on every rank"))
    if gather_bucket is not None:
        gathers = group_units(flat.units, gather_bucket)
        ax.text(total / 2, -0.35, f"after the step: {len(gathers)} all-gather(s) of the updated parameters "
                f"(allgather_bucket_size {gather_bucket:,})", ha="center", va="center", fontsize=8,
                bbox=dict(facecolor=COLORS["params"], alpha=0.25, edgecolor="none"))
        alt += f"; after the optimizer step {len(gathers)} all-gather(s) bring back the updated parameters"
    ax.set_xlim(-total * 0.16, x)
    ax.set_ylim(-0.7 if gather_bucket is not None else 0, 3.3)
    ax.axis("off")
    ax.set_title(f"From gradient hook to bucket to {op.replace('_', '-')} (N = {flat.padded // flat.shard_numel})",
                 fontsize=10)
    return fig, alt + "."


def activation_figure(shape: dict, seq_lens=(512, 1024, 2048, 4096, 8192), ax=None):
    """Activation GB per micro-batch against s: plain (quadratic term), checkpointed, FlashAttention (linear)."""
    fig, ax = new_axes(ax, figsize=(6.4, 3.8))
    shape = {k: v for k, v in shape.items() if k != "seq_len"}
    modes = {"stored (Korthikanti et al.)": {}, "activation checkpointing": {"checkpointing": True},
             "FlashAttention": {"flash_attention": True}}
    for name, kw in modes.items():
        ax.plot(seq_lens, [activation_memory(**shape, seq_len=s, **kw) / 1e9 for s in seq_lens], marker="o",
                label=name)
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("sequence length s (tokens)")
    ax.set_ylabel("activations per micro-batch (GB = 1e9 bytes)")
    ax.set_title(f"Activations of a {shape['layers']}-layer GPT, h = {shape['hidden']}, micro-batch "
                 f"{shape['micro_batch']}", fontsize=10)
    ax.grid(True, which="major", alpha=0.3)
    ax.legend(fontsize=8)
    last = {name: activation_memory(**shape, seq_len=seq_lens[-1], **kw) / 1e9 for name, kw in modes.items()}
    alt = (f"Log-log plot of activation memory against sequence length from {seq_lens[0]} to {seq_lens[-1]}: "
           f"stored activations grow faster than linearly (quadratic attention scores), reaching "
           f"{last['stored (Korthikanti et al.)']:.0f} GB; checkpointing gives {last['activation checkpointing']:.0f}"
           f" GB and FlashAttention, linear in s, {last['FlashAttention']:.0f} GB at the longest sequence.")
    return fig, alt
