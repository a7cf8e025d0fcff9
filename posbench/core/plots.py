"""Plots shared by a run's results, the report, inspect, retrieval and the training log: a metric
against length with plain tick labels and a legend beside the axes, small multiples of a score
per task, per-position losses, and one way of writing a figure (matplotlib's file-only Agg
backend, written atomically)."""
from __future__ import annotations

import math
import textwrap
from pathlib import Path
from typing import Dict, List, Optional, Tuple

import numpy as np

from posbench.core.io import atomic_path
from posbench.core.parity import Gap

METRICS = {"ppl": ("perplexity", True), "accuracy": ("exact-match accuracy", False)}


def pyplot():
    """matplotlib.pyplot on the file-only Agg backend (no display needed)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


LEGEND_ENTRIES = 20  # more curves than this: the legend names the first and counts the rest
LEGEND_CHARS = 48  # a longer legend label is cut (summary.md has it whole)


def _figure():
    plt = pyplot()
    return plt, *plt.subplots(figsize=(7, 4.5))


def save_figure(plt, fig, path: Path) -> None:
    # tight: the saved image grows to hold a legend outside the axes and a long title
    with atomic_path(path) as tmp:
        fig.savefig(tmp, dpi=120, format="png", bbox_inches="tight")
    plt.close(fig)


def plain_number(value: float) -> str:
    """A tick label without powers: 3.5, 128, 2048."""
    return str(int(round(value))) if abs(value - round(value)) < 1e-9 else f"{value:.3g}"


def log_ticks(lo: float, hi: float) -> List[float]:
    """Three to eight round values spanning lo..hi for a log axis: 1-2-5 and finer steps of each
    decade, or, when those leave more than half the range without a tick (8, 9, 10 for 8..18.5),
    evenly spaced values of two significant digits."""
    decades = range(math.floor(math.log10(lo)), math.ceil(math.log10(hi)) + 1)
    for mantissas in ((1,), (1, 3), (1, 2, 5), (1, 1.5, 2, 3, 5, 7), tuple(range(1, 10))):
        ticks = [m * 10.0 ** k for k in decades for m in mantissas if lo <= m * 10.0 ** k <= hi]
        if len(ticks) > 8:
            break
        if len(ticks) >= 3 and np.diff(np.log([lo, *ticks, hi])).max() <= math.log(hi / lo) / 2:
            return ticks
    step = float(f"{(hi - lo) / 4:.1g}")
    return [round(v, 10) for v in np.arange(math.ceil(lo / step) * step, hi, step)]


def plain_log_y(ax) -> None:
    """A log y axis (perplexity) labelled at log_ticks of its limits as plain numbers, with no
    minor labels (matplotlib's own write 10^1 and 9x10^0 and may label one tick in a range).
    Call it once the data is drawn: the ticks come from the limits."""
    from matplotlib.ticker import FixedLocator, FuncFormatter, NullLocator

    ax.set_yscale("log")
    ax.yaxis.set_major_locator(FixedLocator(log_ticks(*ax.get_ylim())))
    ax.yaxis.set_minor_locator(NullLocator())
    ax.yaxis.set_major_formatter(FuncFormatter(lambda v, _: plain_number(v)))


def plain_length_axes(ax, lengths: List[int], log_y: bool, most: int = 12) -> None:
    """Ticks at the evaluated lengths (at most `most`) and, on a log y axis, at round values;
    all labelled as plain numbers."""
    from matplotlib.ticker import FixedLocator, FuncFormatter, NullLocator

    lengths = sorted(set(lengths))
    every = math.ceil(len(lengths) / most)
    ax.xaxis.set_major_locator(FixedLocator(lengths[::every]))
    ax.xaxis.set_minor_locator(NullLocator())
    ax.xaxis.set_major_formatter(FuncFormatter(lambda v, _: plain_number(v)))
    if log_y:
        plain_log_y(ax)


def legend_beside(ax, panels=None) -> None:
    """Outside the axes, so that curves keep the whole plot; a long list is cut with a count.
    `panels`: those whose curves it names, each label once in their order (default: `ax`)."""
    from matplotlib.lines import Line2D

    entries = {}
    for panel in panels if panels is not None else [ax]:
        for handle, label in zip(*panel.get_legend_handles_labels()):
            entries.setdefault(label, handle)
    handles, labels = list(entries.values()), list(entries)
    labels = [text if len(text) <= LEGEND_CHARS else text[:LEGEND_CHARS - 1] + "…"
              for text in labels]
    if len(handles) > LEGEND_ENTRIES:
        more = len(handles) - LEGEND_ENTRIES + 1
        handles = handles[:LEGEND_ENTRIES - 1] + [Line2D([], [], linestyle="none")]
        labels = labels[:LEGEND_ENTRIES - 1] + [f"and {more} more (summary.md)"]
    ax.legend(handles, labels, loc="upper left", bbox_to_anchor=(1.01, 1), fontsize=8,
              frameon=False)


def draw_curve(ax, points: List[Tuple[int, float, Optional[float]]], colour, label: str,
               seeds: Optional[List[Tuple[int, float]]] = None, **style) -> None:
    """One label's (length, mean, +-band) points as a line, shaded where every point has a band,
    and `seeds`, each seed's own (length, value), as small open circles in its colour, so the
    spread is seen and not only its band."""
    xs, ys, bands = zip(*sorted(points))
    ax.plot(xs, ys, label=label, color=colour, **style)
    if seeds:
        sx, sy = zip(*seeds)
        ax.scatter(sx, sy, s=14, facecolors="none", edgecolors=[colour], linewidths=0.8,
                   alpha=0.8, zorder=3)
    if all(b is not None for b in bands):
        ax.fill_between(xs, [y - b for y, b in zip(ys, bands)],
                        [y + b for y, b in zip(ys, bands)], color=colour, alpha=0.2)


def plot_curves(series: Dict[str, List[Tuple[int, float, Optional[float]]]], train_len: int,
                path: Path, title: str = "", band_label: str = "", metric: str = "ppl",
                gaps: Optional[Dict[str, Gap]] = None,
                base_of: Optional[Dict[str, str]] = None,
                seeds: Optional[Dict[str, List[Tuple[int, float]]]] = None) -> None:
    """A metric (METRICS) against length, one line per label, optional +-band, the training
    length marked. With `gaps`, each label shows its parity gap and an under-trained curve is
    dashed. `base_of` maps a re-score's label to its original's: drawn dotted in the original's
    colour, so that each overlays the curve it re-scored. `seeds`: each seed's own points of a
    label, drawn as small open circles in its colour, so the spread is seen and not only its
    band. Written atomically."""
    ylabel, log_y = METRICS[metric]
    plt, fig, ax = _figure()
    gaps, base_of = gaps or {}, base_of or {}
    colours = plt.get_cmap("tab10" if len(series) - len(base_of) <= 10 else "tab20").colors
    colour_of: Dict[str, tuple] = {}
    markers = "osD^vP*X"
    lengths = []
    # first: a legend cut short still names it
    ax.axvline(train_len, color="gray", linestyle="--", label=f"train length {train_len}")
    for label, points in series.items():
        if not points:
            continue
        lengths += [x for x, _, _ in points]
        base = base_of.get(label)
        if base is None:
            colour = colour_of.setdefault(label, colours[len(colour_of) % len(colours)])
            gap = gaps.get(label)
            text = label if gap is None else f"{label} ({gap.cell()} at L)"
            style = dict(linestyle="--" if gap is not None and gap.under_trained else "-",
                         marker="o")
        else:
            colour = colour_of.get(base) or colour_of.setdefault(
                base, colours[len(colour_of) % len(colours)])
            text = label
            siblings = [other for other, its in base_of.items() if its == base]
            style = dict(linestyle=":", marker=markers[1 + siblings.index(label) % 7])
        draw_curve(ax, points, colour, text, (seeds or {}).get(label), **style)
    ax.set_xscale("log", base=2)
    if not log_y:
        ax.set_ylim(-0.02, 1.02)
    plain_length_axes(ax, lengths + [train_len], log_y)
    ax.set_xlabel("evaluation length (tokens)")
    ax.set_ylabel(ylabel)
    ax.set_title("\n".join(textwrap.fill(line, 70) for line in
                           (title + (f"\nshaded: {band_label}" if band_label else "")).split("\n")),
                 fontsize=10)
    ax.grid(True, which="major", alpha=0.3)
    legend_beside(ax)
    save_figure(plt, fig, path)


def plot_panels(panels: Dict[str, Dict[str, Tuple[list, Optional[list]]]], path: Path,
                title: str, xlabel: str, ylabel: str,
                lengths: Optional[Dict[str, int]] = None) -> None:
    """Small multiples of a score in [0, 1]: one panel per key of `panels` (a task), in it one
    curve per label, given as ((x, mean, +-band or None) points, each seed's (x, value) or None)
    and drawn as draw_curve draws it, in the same colour in every panel; one legend for all
    (legend_beside, beside the first row). x
    is a length over L, shared by the panels, with L at 1; or, with `lengths` (panel -> its
    training length), each panel's own lengths in tokens with its L marked. For
    sweeps over several tasks, whose curves would crowd one axis. Written atomically."""
    plt = pyplot()
    columns = min(4, len(panels))
    rows = math.ceil(len(panels) / columns)
    fig, axes = plt.subplots(rows, columns, figsize=(3.2 * columns, 2.6 * rows),
                             sharex=lengths is None, sharey=True, squeeze=False)
    labels = list(dict.fromkeys(label for curves in panels.values() for label in curves))
    colours = plt.get_cmap("tab10" if len(labels) <= 10 else "tab20").colors
    colour_of = {label: colours[i % len(colours)] for i, label in enumerate(labels)}
    flat = list(axes.flat)
    for ax, (name, curves) in zip(flat, panels.items()):
        mark = 1.0 if lengths is None else lengths[name]
        ax.axvline(mark, color="gray", linestyle="--", linewidth=0.8, label="L")
        for label, (points, seeds) in curves.items():
            draw_curve(ax, points, colour_of[label], label, seeds, marker="o", markersize=3)
        if lengths is not None:
            plain_length_axes(ax, [x for points, _ in curves.values() for x, _, _ in points],
                              log_y=False, most=5)
        ax.set_title(name, fontsize=9)
        ax.set_ylim(-0.02, 1.02)
        ax.grid(True, alpha=0.3)
    for i, ax in enumerate(flat):
        if i >= len(panels):
            ax.set_visible(False)
        # the lowest panel of each column carries the x labels, above an empty slot too
        elif i + columns >= len(panels) or lengths is not None:
            ax.xaxis.set_tick_params(labelbottom=True)
            ax.set_xlabel(xlabel)
    for row in axes:
        row[0].set_ylabel(ylabel)
    legend_beside(axes[0][-1], panels=flat[:len(panels)])
    fig.suptitle("\n".join(textwrap.fill(line, 100) for line in title.split("\n")),
                 fontsize=10)
    fig.tight_layout()
    save_figure(plt, fig, path)


def plot_per_position(curve: List[dict], train_len: int, path: Path, title: str = "") -> None:
    """Mean loss by position in the window, one line per evaluation length."""
    plt, fig, ax = _figure()
    for point in curve:
        bins = point.get("per_position")
        if bins:
            xs = [(s + e + 1) / 2 for s, e in zip(bins["start"], bins["end"])]
            ax.plot(xs, bins["loss"], marker=".", label=f"length {point['length']}")
    ax.axvline(train_len, color="gray", linestyle="--", label=f"train length {train_len}")
    ax.set_xscale("log", base=2)
    # plain powers of two (matplotlib's own labels, 2^k, are mathtext: slower and harder to read)
    lo, hi = ax.get_xlim()
    first, last = max(0, math.ceil(math.log2(lo))), math.floor(math.log2(hi))
    plain_length_axes(ax, [2 ** k for k in range(first, last + 1)], log_y=False)
    ax.set_xlabel("position in the window (tokens of context)")
    ax.set_ylabel("mean loss (nats)")
    ax.set_title(title)
    ax.grid(True, which="major", alpha=0.3)
    ax.legend(fontsize=8)
    save_figure(plt, fig, path)
