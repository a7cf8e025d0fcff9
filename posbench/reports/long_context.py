"""RULER and LongPPL across the groups of a report (eval.ruler, eval.longppl), the view that
compares encodings: per group (report.py's groups, seeds averaged), the mean over its seeds by
length with a 95% Student-t interval, and each seed's own point.

- ruler_by_group.png: a panel for the tasks' average and one per task, RULER's score, recall
  (each run's mean over depths; exact match where some run was scored before recall existed),
  against length, a line per group; in summary.md a table per panel.
- longppl_by_group.png: perplexity on every scored token beside LongPPL on the key tokens alone,
  the same windows, two panels sharing the length axis; in summary.md a table of LongPPL with the
  key tokens' count.

Each is written only when some run of the folder holds its evaluation. A view whose groups are
all re-scores with some changes in common names those once, not in every label.
"""
from __future__ import annotations

import math
from collections import defaultdict
from pathlib import Path
from typing import Callable, Dict, List, Optional, Tuple

from posbench.core.plots import (draw_curve, legend_beside, plain_length_axes, pyplot,
                                 save_figure)
from posbench.evaluations.longppl import settings
from posbench.reports.stats import BAND, mean_band
from posbench.runs.rescore import change_label
from posbench.runs.results import rescore_label

RULER_PLOT, LONGPPL_PLOT = "ruler_by_group.png", "longppl_by_group.png"
# the score's name, and what it is
SCORE_NAMES = {"recall": ("recall", "RULER's score: the share of the answer's items found"),
               "exact_match": ("exact match", "some runs were scored before recall existed")}
AVERAGE = "average"
DASHES = ("--", ":", "-.")
# length -> (the value of each run that has one, how many runs scored that length)
Seeds = Dict[int, Tuple[List[float], int]]


def seed_values(records: List[dict], points: Callable[[dict], List[dict]], key: str) -> Seeds:
    """Per length, `key` of each record's point (`points(record)`: its by_length), where it is
    not missing or null (a cell out of memory, a length without key tokens)."""
    values, scored = defaultdict(list), defaultdict(int)
    for record in records:
        for p in points(record):
            scored[p["length"]] += 1
            if p.get(key) is not None:
                values[p["length"]].append(p[key])
    return {n: (values[n], scored[n]) for n in sorted(scored)}


def cell(values: List[float], scored: int, digits: int, note: str = "") -> str:
    """mean ± its interval over seeds, then in parentheses `note` and how many of the runs had a
    value where some had none."""
    if not values:
        return "—"
    s = mean_band(values)
    text = f"{s['mean']:.{digits}f}" + (f" ± {s['ci95']:.{digits}f}" if s["n"] > 1 else "")
    notes = [note] * bool(note) + [f"{s['n']} of {scored} seeds"] * (s["n"] < scored)
    return text + (f" ({'; '.join(notes)})" if notes else "")


def without_shared_changes(groups: Dict[str, List[dict]]) -> Tuple[Dict[str, List[dict]], str]:
    """One view's groups relabelled without the re-score changes that all of them share (a
    LongPPL re-score's evaluator and block, say), and those changes once, for the view's heading;
    as they are and "" where the groups share none (a run's own results change nothing)."""
    changes = [members[0].get("rescore", {}).get("changes", {}) for members in groups.values()]
    shared = {key: value for key, value in changes[0].items()
              if all(key in c and c[key] == value for c in changes)}
    if not shared:
        return groups, ""
    relabelled = {}
    for label, members in groups.items():
        rest = {key: value for key, value in members[0]["rescore"]["changes"].items()
                if key not in shared}
        base = label.removesuffix(f" ({rescore_label(members[0])})")
        relabelled[base + (f" ({change_label(rest)})" if rest else "")] = members
    return relabelled, f"every group re-scored with {change_label(shared)}"


def train_lengths(groups: Dict[str, List[dict]]) -> Dict[str, int]:
    return {label: members[0]["train"]["seq_len"] for label, members in groups.items()}


def table(rows: Dict[str, Dict[int, str]], train_of: Dict[str, int]) -> List[str]:
    """A markdown table of groups x lengths; the training length's column marked (L) where the
    groups share one."""
    lengths = sorted({n for row in rows.values() for n in row})
    trained = {train_of[label] for label in rows}
    head = [f"{n} (L)" if trained == {n} else str(n) for n in lengths]
    return (["| group | " + " | ".join(head) + " |", "|---|" + "---:|" * len(lengths)]
            + [f"| {label} | " + " | ".join(row.get(n, "—") for n in lengths) + " |"
               for label, row in rows.items()])


def series(values: Seeds) -> Tuple[List[Tuple[int, float, Optional[float]]],
                                   List[Tuple[int, float]]]:
    """The plotted mean (length, mean, its interval or None for one seed) and each seed's point."""
    means = [(n, s["mean"], s["ci95"] if s["n"] > 1 else None)
             for n, s in ((n, mean_band(xs)) for n, (xs, _) in values.items() if xs)]
    return means, [(n, x) for n, (xs, _) in values.items() for x in xs]


def draw_panel(ax, panel: Dict[str, Seeds], train_of: Dict[str, int], colours: Dict[str, tuple],
               log_y: bool) -> None:
    """One metric by length, a line per group with its band and seeds; each training length
    dashed (its own dashes where the groups have several)."""
    lengths = []
    for label, values in panel.items():
        means, seeds = series(values)
        if means:
            lengths += [n for n, _, _ in means]
            draw_curve(ax, means, colours[label], label, seeds, marker="o")
    every = sorted(set(train_of.values()))  # one dash per training length in every panel
    for length in sorted({train_of[label] for label in panel}):
        ax.axvline(length, color="gray", linestyle=DASHES[every.index(length) % len(DASHES)],
                   label=f"train length {length}")
    ax.set_xscale("log", base=2)
    if not log_y:
        ax.set_ylim(-0.02, 1.02)
    plain_length_axes(ax, lengths + [train_of[label] for label in panel], log_y)
    ax.grid(True, which="major", alpha=0.3)


def colours_of(labels: List[str]) -> Dict[str, tuple]:
    """One colour per group, the same in every panel."""
    palette = pyplot().get_cmap("tab10" if len(labels) <= 10 else "tab20").colors
    return {label: palette[i % len(palette)] for i, label in enumerate(labels)}


# ---- RULER -------------------------------------------------------------------------------------

def ruler_score(records: List[dict]) -> str:
    """RULER's own score, recall, where every point of every record holds it; else exact match
    (records saved before recall existed), so that the groups compare on one score."""
    points = [p for r in records for t in r["tasks"].values() for p in t["by_length"]
              if "exact_match" in p]
    return "recall" if all("recall" in p for p in points) else "exact_match"


def ruler_panels(groups: Dict[str, List[dict]]) -> Tuple[Dict[str, Dict[str, Seeds]], str]:
    """panel (the average, then each task in the order the runs hold them) -> group -> each
    seed's score by length, and the score (ruler_score); every group has a run scored on RULER
    (scored_with)."""
    results = {label: [r["eval"]["ruler"] for r in members if r["eval"].get("ruler")]
               for label, members in groups.items()}
    score = ruler_score([r for records in results.values() for r in records])
    tasks = dict.fromkeys(name for records in results.values() for r in records
                          for name in r["tasks"])
    panels = {}
    for name in [AVERAGE, *tasks]:
        def points(record, name=name):
            return record["by_length"] if name == AVERAGE else \
                record["tasks"].get(name, {}).get("by_length", [])
        panels[name] = {label: values for label, records in results.items()
                        if (values := seed_values(records, points, score))}
    return panels, score


def instance_formats(groups: Dict[str, List[dict]]) -> Dict[int, List[str]]:
    """RULER's instance format -> the groups with a run scored on it."""
    formats = defaultdict(list)
    for label, members in groups.items():
        for f in sorted({r["eval"]["ruler"].get("format", 1) for r in members
                         if r["eval"].get("ruler")}):
            formats[f].append(label)
    return dict(sorted(formats.items()))


def scored_with(groups: Dict[str, List[dict]], section: str) -> Dict[str, List[dict]]:
    """The groups with a run scored on eval.<section>."""
    return {label: members for label, members in groups.items()
            if any(r["eval"].get(section) for r in members)}


def ruler(root: Path, groups: Dict[str, List[dict]]) -> Tuple[List[str], bool]:
    """summary.md's RULER tables across groups, and whether ruler_by_group.png was written:
    nothing when no run scored RULER."""
    if not (groups := scored_with(groups, "ruler")):
        return [], False
    groups, shared = without_shared_changes(groups)
    train_of = train_lengths(groups)
    panels, score = ruler_panels(groups)
    what, why = SCORE_NAMES[score]
    lines = ["", f"RULER across groups ({RULER_PLOT}): {what} ({why}) by length, each run's "
             f"mean over depths, then the mean ± {BAND}; (k of n seeds): the others ran out of "
             "memory there" + (f"; {shared}" if shared else "") + "."]
    formats = instance_formats(groups)
    if len(formats) > 1:  # other sequences: scores that do not compare
        lines.append("Runs scored instances of different formats (guide, \"RULER's synthetic "
                     "tasks\"), so only the groups of one format compare: " + "; ".join(
                         f"format {f}: {', '.join(labels)}" for f, labels in formats.items()) + ".")
    for name, panel in panels.items():
        lines += ["", f"{name} ({'mean over the tasks' if name == AVERAGE else what}):", ""]
        lines += table({label: {n: cell(xs, scored, 2) for n, (xs, scored) in values.items()}
                        for label, values in panel.items()}, train_of)
    plot_ruler(panels, what, train_of, root / RULER_PLOT)
    return lines, True


def plot_ruler(panels: Dict[str, Dict[str, Seeds]], what: str, train_of: Dict[str, int],
               path: Path) -> None:
    """A panel per task and one for their average: the score (`what`) against length on one
    scale."""
    plt = pyplot()
    cols = min(3, len(panels))
    rows = math.ceil(len(panels) / cols)
    fig, axes = plt.subplots(rows, cols, squeeze=False, sharey=True,
                             figsize=(4.2 * cols, 3.2 * rows), layout="constrained")
    colours = colours_of(list(dict.fromkeys(label for panel in panels.values()
                                            for label in panel)))
    for ax, (name, panel) in zip(axes.flat, panels.items()):
        draw_panel(ax, panel, train_of, colours, log_y=False)
        ax.set_title("average over the tasks" if name == AVERAGE else name, fontsize=9)
    for ax in list(axes.flat)[len(panels):]:
        ax.axis("off")
    legend_beside(axes[0][-1], panels=axes.flat)  # a group without the last task's scores too
    fig.supxlabel("evaluation length (tokens)", fontsize=9)
    fig.supylabel(f"{what} (mean over depths)", fontsize=9)
    fig.suptitle(f"RULER {what} by length, mean over seeds; shaded: {BAND}; circles: each seed",
                 fontsize=9)
    save_figure(plt, fig, path)


# ---- LongPPL -----------------------------------------------------------------------------------

def longppl(root: Path, groups: Dict[str, List[dict]]) -> Tuple[List[str], bool]:
    """summary.md's LongPPL table across groups, and whether longppl_by_group.png was written
    (not when no run has a key token): nothing when no run scored LongPPL."""
    if not (groups := scored_with(groups, "longppl")):
        return [], False
    groups, shared = without_shared_changes(groups)
    train_of = train_lengths(groups)
    results = {label: [r["eval"]["longppl"] for r in members if r["eval"].get("longppl")]
               for label, members in groups.items()}
    by_length = lambda record: record["by_length"]
    ppl = {label: seed_values(rs, by_length, "ppl") for label, rs in results.items()}
    key = {label: seed_values(rs, by_length, "longppl") for label, rs in results.items()}
    found = {label: seed_values(rs, by_length, "key_tokens") for label, rs in results.items()}
    chosen = defaultdict(list)
    for label, records in results.items():
        chosen[settings(records[0])].append(label)
    how = (f"key tokens chosen {next(iter(chosen))}" if len(chosen) == 1 else
           "key tokens chosen under other settings by group, so LongPPL compares only the groups "
           "of one setting: " + "; ".join(f"{how} ({', '.join(labels)})"
                                          for how, labels in chosen.items()))
    drawn = any(xs for values in key.values() for xs, _ in values.values())
    lines = ["", "LongPPL across groups" + (f" ({LONGPPL_PLOT}, beside perplexity)" if drawn
                                             else "")
             + f": perplexity on the key tokens only by length, mean ± {BAND}, and in "
             f"parentheses the key tokens' count (mean over seeds); {how}"
             + (f"; {shared}" if shared else "") + ". null: no key token "
             "in any seed; k of n seeds: the others had none there or ran out of memory.", ""]

    def longppl_cell(label: str, n: int) -> str:
        xs, scored = key[label][n]
        counts = found[label].get(n, ([], 0))[0]
        if not counts:
            return "—"
        keys = f"{sum(counts) / len(counts):.0f}"
        return cell(xs, scored, 3, note=keys) if xs else f"null ({keys})"

    lines += table({label: {n: longppl_cell(label, n) for n in values}
                    for label, values in key.items()}, train_of)
    if drawn:
        plot_longppl(ppl, key, train_of, root / LONGPPL_PLOT)
    return lines, drawn


def plot_longppl(ppl: Dict[str, Seeds], key: Dict[str, Seeds], train_of: Dict[str, int],
                 path: Path) -> None:
    """Perplexity (left) and LongPPL (right) against length, on the same windows and log axes."""
    plt = pyplot()
    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4.5), sharex=True, layout="constrained")
    colours = colours_of(list(ppl))
    draw_panel(left, ppl, train_of, colours, log_y=True)
    draw_panel(right, {label: values for label, values in key.items()
                       if any(xs for xs, _ in values.values())}, train_of, colours, log_y=True)
    left.set_title("perplexity: every scored token", fontsize=9)
    right.set_title("LongPPL: the key tokens only", fontsize=9)
    for ax in (left, right):
        ax.set_xlabel("evaluation length (tokens)")
    left.set_ylabel("perplexity")
    legend_beside(right)
    fig.suptitle(f"perplexity and LongPPL by length, mean over seeds; shaded: {BAND}; circles: "
                 "each seed", fontsize=9)
    save_figure(plt, fig, path)


def write(root: Path, groups: Dict[str, List[dict]]) -> Tuple[List[str], List[str]]:
    """summary.md's lines on RULER and LongPPL across `groups` (label -> its records), and the
    figures written in `root`."""
    (ruler_lines, ruler_drawn), (longppl_lines, longppl_drawn) = (
        ruler(root, groups), longppl(root, groups))
    return ruler_lines + longppl_lines, [RULER_PLOT] * ruler_drawn + [LONGPPL_PLOT] * longppl_drawn
