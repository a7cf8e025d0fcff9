"""A sweep over model sizes (`+experiment=ladder`): each encoding's verdicts by parameter count,
as a table in summary.md and a plot, by_size.png. Parity is judged within a size, since a larger
model is better at L whatever its encoding (report.py partitions the gaps by model_shape)."""
from __future__ import annotations

from pathlib import Path
from typing import Callable, Dict, List, Optional, Tuple

from posbench.core.parity import Gap
from posbench.core.plots import plain_log_y, pyplot, save_figure

SHAPE_KEYS = ("n_layer", "n_head", "d_model")


def model_shape(record: dict) -> tuple:
    """A run's model size as its shape; parameter counts differ within one shape (a learned
    table adds its own)."""
    return tuple(record.get("model", {}).get(k) for k in SHAPE_KEYS)


def shape_params(records: List[dict]) -> Dict[tuple, int]:
    """shape -> its fewest parameters over the records: the size that names it."""
    sizes: Dict[tuple, int] = {}
    for record in records:
        params = record.get("model", {}).get("params")
        if params is not None:
            shape = model_shape(record)
            sizes[shape] = min(sizes.get(shape, params), params)
    return sizes


def size_label(params: float) -> str:
    """1.25e8 -> '125M', 214000 -> '214K'."""
    for value, prefix in ((1e9, "B"), (1e6, "M"), (1e3, "K")):
        if params >= value:
            return f"{params / value:.3g}{prefix}"
    return f"{params:g}"


def by_size(groups: Dict[str, List[dict]], series_of: Dict[str, str]
            ) -> Dict[str, Dict[int, str]]:
    """series -> parameter count -> the group at that size (a series is a group's label without
    its model keys: one encoding across the sizes)."""
    sizes = shape_params([r for members in groups.values() for r in members])
    out: Dict[str, Dict[int, str]] = {}
    for label, members in groups.items():
        if model_shape(members[0]) in sizes:
            out.setdefault(series_of[label], {})[sizes[model_shape(members[0])]] = label
    return out


def report_lines(groups: Dict[str, List[dict]], series_of: Dict[str, str],
                 at_train: Callable[[str], Optional[dict]], ratio: Callable[[str], Optional[float]],
                 gaps: Dict[str, Gap], path: Path) -> List[str]:
    """summary.md's section by model size, and its plot at `path`; nothing when the groups are of
    one size. `at_train(label)`: the group's ppl statistics at L ({mean, ci95}); `ratio(label)`:
    its extrapolation ratio, ppl at the longest length over ppl at L."""
    table = by_size(groups, series_of)
    sizes = sorted({size for row in table.values() for size in row})
    if len(sizes) < 2:
        return []

    def cells(value: Callable[[str], str]) -> List[str]:
        return [f"| {series} | " + " | ".join(value(row[s]) if s in row else "—" for s in sizes)
                + " |" for series, row in table.items()]

    def ppl_cell(label: str) -> str:
        stats, gap = at_train(label), gaps.get(label)
        if stats is None:
            return "—"
        return f"{stats['mean']:.3f}" + (f" ({gap.cell()})" if gap is not None else "")

    header = "| series | " + " | ".join(size_label(s) for s in sizes) + " |"
    rule = "|---|" + "---:|" * len(sizes)
    ratio_cell = lambda label: "—" if ratio(label) is None else f"{ratio(label):.2f}"
    lines = ["", "By model size (parameters; a series is one encoding across the sizes). "
             "Perplexity at the training length, with the gap to the best group of the same "
             "size:", "", header, rule, *cells(ppl_cell),
             "", "Extrapolation ratio, ppl at the longest evaluated length over ppl at L, by "
             "size (by_size.png draws both):", "", header, rule, *cells(ratio_cell)]
    plot(table, sizes, at_train, ratio, path)
    return lines


def plot(table: Dict[str, Dict[int, str]], sizes: List[int],
         at_train: Callable[[str], Optional[dict]], ratio: Callable[[str], Optional[float]],
         path: Path) -> None:
    """Two panels against parameters (log): ppl at L with its seeds' interval, and the
    extrapolation ratio (1: no worse past L than at L)."""
    from matplotlib.ticker import FixedLocator, FuncFormatter, NullLocator

    plt = pyplot()
    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4.5))
    for series, row in table.items():
        points: List[Tuple[int, dict]] = [(s, at_train(row[s])) for s in sorted(row)]
        points = [(s, stats) for s, stats in points if stats is not None]
        if points:
            xs, stats = zip(*points)
            left.errorbar(xs, [p["mean"] for p in stats], yerr=[p["ci95"] for p in stats],
                          marker="o", capsize=3, label=series)
        ratios = [(s, ratio(row[s])) for s in sorted(row) if ratio(row[s]) is not None]
        if ratios:
            right.plot(*zip(*ratios), marker="o", label=series)
    right.axhline(1.0, color="gray", linestyle="--", linewidth=0.8)
    for ax, ylabel in ((left, "perplexity at the training length L"),
                       (right, "ppl(longest) / ppl(L)")):
        ax.set_xscale("log")
        ax.xaxis.set_major_locator(FixedLocator(sizes))
        ax.xaxis.set_minor_locator(NullLocator())
        ax.xaxis.set_major_formatter(FuncFormatter(lambda v, _: size_label(v)))
        ax.set_xlabel("model parameters")
        ax.set_ylabel(ylabel)
        plain_log_y(ax)
        ax.grid(True, which="major", alpha=0.3)
    left.set_title("at L: lower is better", fontsize=10)
    right.set_title("past L: 1 is no worse than at L", fontsize=10)
    right.legend(loc="upper left", bbox_to_anchor=(1.01, 1), fontsize=8, frameon=False)
    save_figure(plt, fig, path)

