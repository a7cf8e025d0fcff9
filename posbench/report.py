"""Compare runs: a table (markdown + CSV, label by eval length) and one plot of every curve.

Runs are grouped by encoding and by every config key that differs between them (a swept key),
except the seed: seeds of one group are averaged, with a 95% Student-t interval of the mean.
Task datasets add exact-match accuracy. Runs that failed, or left no results.json, are listed.
"""
from __future__ import annotations

import csv
import io
import math
from collections import defaultdict
from pathlib import Path
from typing import Dict, List, Optional, Tuple

from hydra.experimental.callback import Callback

from posbench.config import ConfigError, flatten
from posbench.io import atomic_path, write_text
from posbench import retrieval
from posbench.parity import UNDER_TRAINED, Gap, parity_gaps
from posbench.results import RESULTS, load_results

# keys that differ between runs without being an experimental factor
IGNORED_KEYS = ("seed", "dataset.cache_dir", "logger.")
# two-sided 95% quantiles of Student's t for 1..30 degrees of freedom
T95 = (12.706, 4.303, 3.182, 2.776, 2.571, 2.447, 2.365, 2.306, 2.262, 2.228, 2.201, 2.179,
       2.160, 2.145, 2.131, 2.120, 2.110, 2.101, 2.093, 2.086, 2.080, 2.074, 2.069, 2.064, 2.060,
       2.056, 2.052, 2.048, 2.045, 2.042)
METRICS = {"ppl": ("perplexity", True), "accuracy": ("exact-match accuracy", False)}
BAND = "95% interval of the mean over seeds (Student t)"


def t95(df: int) -> float:
    return T95[df - 1] if df <= len(T95) else 1.96 + 2.4 / df  # within 0.002 beyond 30


def pyplot():
    """matplotlib.pyplot on the file-only Agg backend (no display needed)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _figure():
    plt = pyplot()
    return plt, *plt.subplots(figsize=(7, 4.5))


def save_figure(plt, fig, path: Path) -> None:
    fig.tight_layout()
    with atomic_path(path) as tmp:
        fig.savefig(tmp, dpi=120, format="png")
    plt.close(fig)


def plot_curves(series: Dict[str, List[Tuple[int, float, Optional[float]]]], train_len: int,
                path: Path, title: str = "", band_label: str = "", metric: str = "ppl",
                gaps: Optional[Dict[str, Gap]] = None) -> None:
    """A metric (METRICS) against length, one line per label, optional +-band, the training
    length marked. With `gaps`, each label shows its parity gap and an under-trained curve is
    dashed. Written atomically."""
    ylabel, log_y = METRICS[metric]
    plt, fig, ax = _figure()
    gaps = gaps or {}
    for label, points in series.items():
        if not points:
            continue
        xs, ys, bands = zip(*sorted(points))
        gap = gaps.get(label)
        text = label if gap is None else f"{label} ({gap.cell()} at L)"
        line, = ax.plot(xs, ys, marker="o", label=text,
                        linestyle="--" if gap is not None and gap.under_trained else "-")
        if all(b is not None for b in bands):
            ax.fill_between(xs, [y - b for y, b in zip(ys, bands)],
                            [y + b for y, b in zip(ys, bands)], color=line.get_color(), alpha=0.2)
    ax.axvline(train_len, color="gray", linestyle="--", label=f"train length {train_len}")
    ax.set_xscale("log", base=2)
    if log_y:
        ax.set_yscale("log")
    else:
        ax.set_ylim(-0.02, 1.02)
    ax.set_xlabel("evaluation length (tokens)")
    ax.set_ylabel(ylabel)
    ax.set_title(title + (f"\nshaded: {band_label}" if band_label else ""))
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=8)
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
    ax.set_xlabel("position in the window (tokens of context)")
    ax.set_ylabel("mean loss (nats)")
    ax.set_title(title)
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=8)
    save_figure(plt, fig, path)


def find_runs(root: Path) -> Tuple[List[dict], List[dict]]:
    """Every results.json below `root`, and the run dirs that have none (a job killed before
    it could write one) or an unreadable one, as failed records."""
    runs, failed = [], []
    for path in sorted(Path(root).rglob(RESULTS)):
        try:
            record = load_results(path)
        except (OSError, ValueError) as err:
            record = {"status": "unreadable", "error": f"{RESULTS} unreadable: {err}"}
        record["_dir"] = str(path.parent)
        (runs if record.get("status") == "ok" else failed).append(record)
    for config in sorted(Path(root).rglob(".hydra/config.yaml")):
        run_dir = config.parent.parent
        if not (run_dir / RESULTS).exists():
            failed.append({"_dir": str(run_dir), "status": "incomplete",
                           "error": f"no {RESULTS} (killed, or still running)"})
    return runs, failed


def _differs(key: str, runs: List[dict], flats: List[Dict[str, str]]) -> bool:
    """Whether a key was swept. Encodings have keys of their own, so an encoding's key counts
    only where it differs between runs of that encoding."""
    groups = defaultdict(set)
    for run, flat in zip(runs, flats):
        groups[run["encoding"] if key.startswith("encoding.") else ""].add(flat.get(key))
    return any(len(values) > 1 for values in groups.values())


def group_label(runs: List[dict]) -> Dict[int, str]:
    """Label of each run: its encoding plus every swept key (not the seed) that differs."""
    # repr: values become comparable strings, lists included
    flats = [{k: repr(v) for k, v in flatten(r.get("config", {})).items()} for r in runs]
    keys = sorted({k for f in flats for k in f})
    swept = [k for k in keys if k != "encoding.name" and not k.startswith(IGNORED_KEYS)
             and _differs(k, runs, flats)]
    labels = {}
    for i, (run, flat) in enumerate(zip(runs, flats)):
        extra = ",".join(f"{k}={flat.get(k, '-')}" for k in swept
                         if k in flat or not k.startswith("encoding."))
        labels[i] = run["encoding"] + (f" [{extra}]" if extra else "")
    return labels


def aggregate(runs: List[dict], labels: Dict[int, str],
              metric: str = "ppl") -> Dict[str, Dict[int, dict]]:
    """label -> length -> {mean, sd, sem, ci95, n} of a curve metric over seeds; `labels` from
    group_label."""
    values: Dict[str, Dict[int, List[float]]] = defaultdict(lambda: defaultdict(list))
    for i, run in enumerate(runs):
        for point in run["eval"]["curve"]:
            if metric in point:
                values[labels[i]][point["length"]].append(point[metric])
    table = {}
    for label, by_length in sorted(values.items()):
        table[label] = {}
        for length, xs in sorted(by_length.items()):
            n = len(xs)
            mean = sum(xs) / n
            sd = math.sqrt(sum((x - mean) ** 2 for x in xs) / (n - 1)) if n > 1 else 0.0
            sem = sd / math.sqrt(n)
            ci95 = t95(n - 1) * sem if n > 1 else 0.0
            table[label][length] = {"mean": mean, "sd": sd, "sem": sem, "ci95": ci95, "n": n}
    return table


def train_lengths(runs: List[dict], labels: Dict[int, str]) -> Dict[str, int]:
    """label -> its training length (a swept train.seq_len is part of the label)."""
    return {labels[i]: run["train"]["seq_len"] for i, run in enumerate(runs)}


def extrapolation_ratio(by_length: Dict[int, dict], train_len: int) -> Optional[float]:
    if train_len not in by_length:
        return None
    return by_length[max(by_length)]["mean"] / by_length[train_len]["mean"]


def _markdown_table(table: Dict[str, Dict[int, dict]], digits: int,
                    ratio_of: Optional[Dict[str, int]] = None,
                    gaps: Optional[Dict[str, Gap]] = None) -> List[str]:
    """With `ratio_of` (label -> training length), the extrapolation ratio and, from `gaps`, the
    gap to the best perplexity at the training length."""
    lengths = sorted({length for by_length in table.values() for length in by_length})
    cell = lambda s: f"{s['mean']:.{digits}f}" + (f" ± {s['ci95']:.{digits}f}" if s["n"] > 1
                                                   else "")
    head = "| encoding | " + " | ".join(map(str, lengths)) + " |"
    head += " ppl(longest)/ppl(train) | gap at train length |" if ratio_of else ""
    lines = [head, "|---|" + "---:|" * (len(lengths) + 2 * bool(ratio_of))]
    for label, by_length in table.items():
        cells = [cell(by_length[n]) if n in by_length else "—" for n in lengths]
        if ratio_of:
            ratio = extrapolation_ratio(by_length, ratio_of[label])
            gap = (gaps or {}).get(label)
            cells += [f"{ratio:.2f}" if ratio else "—", gap.cell() if gap else "—"]
        lines.append(f"| {label} | " + " | ".join(cells) + " |")
    return lines


def write_report(root: Path) -> Dict[str, dict]:
    """summary.md, summary.csv and ppl_vs_length.png (accuracy_vs_length.png for tasks) in
    `root` from every run below it. Returns each group's parity at the training length."""
    root = Path(root)
    if not root.is_dir():
        raise ConfigError(f"report dir {str(root)!r} is not accepted; expected a folder of runs")
    ok, failed = find_runs(root)
    if not ok:
        raise ConfigError(f"report dir {str(root)!r} is not accepted: it holds no finished run "
                          f"({RESULTS} with status ok); expected a run or sweep folder")
    labels = group_label(ok)
    tables = {m: aggregate(ok, labels, m) for m in METRICS}
    tables = {m: t for m, t in tables.items() if t}
    train_of = train_lengths(ok, labels)
    train_lens = sorted(set(train_of.values()))
    seeds = max(s["n"] for by_length in tables["ppl"].values() for s in by_length.values())
    protocols = sorted({r["eval"].get("protocol", "?") for r in ok})

    gaps = parity_gaps(tables["ppl"], train_of)

    out = io.StringIO()
    writer = csv.writer(out)
    writer.writerow(["label", "length", "ppl_mean", "ppl_sd", "ppl_ci95", "seeds",
                     "accuracy_mean", "accuracy_ci95", "train_length", "extrapolation_ratio",
                     "train_length_gap", "train_length_gap_ci95", "under_trained"])
    for label, by_length in tables["ppl"].items():
        ratio = extrapolation_ratio(by_length, train_of[label])
        gap = gaps.get(label)
        per_label = [train_of[label], f"{ratio:.6g}" if ratio else "",
                     f"{gap.gap:.6g}" if gap else "", f"{gap.band:.6g}" if gap else "",
                     gap.under_trained if gap else ""]
        for length, s in by_length.items():
            acc = tables.get("accuracy", {}).get(label, {}).get(length)
            writer.writerow([label, length, f"{s['mean']:.6g}", f"{s['sd']:.6g}",
                             f"{s['ci95']:.6g}", s["n"], f"{acc['mean']:.6g}" if acc else "",
                             f"{acc['ci95']:.6g}" if acc else "", *per_label])
    write_text(root / "summary.csv", out.getvalue())

    band = f"; mean ± {BAND}" if seeds > 1 else ""
    lines = [f"# posbench report: {len(ok)} runs", "",
             f"Perplexity by evaluation length (training length {', '.join(map(str, train_lens))}"
             f"; protocol {', '.join(protocols)}){band}.", ""]
    lines += _markdown_table(tables["ppl"], 3, ratio_of=train_of, gaps=gaps)
    lines += ["", "Gap at train length: perplexity at the training length relative to the best "
              "group trained at that length" + (" (± its 95% interval)" if seeds > 1 else "")
              + "."]
    lines += [f"- **{label}** is {UNDER_TRAINED}." for label, gap in gaps.items()
              if gap.under_trained]
    if "accuracy" in tables:
        lines += ["", f"Exact-match accuracy by evaluation length{band}.", ""]
        lines += _markdown_table(tables["accuracy"], 3)
    lines += retrieval.report_lines(ok, labels)
    if failed:
        lines += ["", "Failed runs:", ""] + [f"- {r['_dir']}: {r.get('error', r.get('status'))}"
                                            for r in failed]
    write_text(root / "summary.md", "\n".join(lines) + "\n")

    for metric, table in tables.items():
        series = {label: [(n, s["mean"], s["ci95"] if s["n"] > 1 else None)
                          for n, s in by_length.items()] for label, by_length in table.items()}
        plot_curves(series, train_lens[0], root / f"{metric}_vs_length.png",
                    title=f"{METRICS[metric][0]} vs length ({len(ok)} runs)",
                    band_label=BAND if seeds > 1 else "", metric=metric,
                    gaps=gaps if metric == "ppl" else None)
    grid = retrieval.plot_grid(ok, labels, root / "retrieval_grid.png")
    print("\n".join(lines))
    print(f"\nwrote {root / 'summary.md'}, summary.csv, "
          + ", ".join([f"{m}_vs_length.png" for m in tables] + ["retrieval_grid.png"] * grid))
    return {label: {"train_length": train_of[label],
                    "train_length_ppl": tables["ppl"][label][train_of[label]]["mean"],
                    "gap": gap.gap, "gap_ci95": gap.band, "under_trained": gap.under_trained,
                    "extrapolation_ratio": extrapolation_ratio(tables["ppl"][label],
                                                               train_of[label])}
            for label, gap in gaps.items()}


class SweepReport(Callback):
    """Hydra callback: at the end of a multirun, report over the sweep dir."""

    def on_multirun_end(self, config, **kwargs) -> None:
        sweep_dir = Path(config.hydra.sweep.dir)
        if any(sweep_dir.rglob(RESULTS)):
            try:
                parity = write_report(sweep_dir)
            except ConfigError as err:
                print(f"posbench report: {err}")
                return
            if config.logger.name == "wandb":
                from posbench.loggers import log_sweep_report

                log_sweep_report(config.logger, sweep_dir, parity)
