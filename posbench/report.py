"""Compare runs: a table (markdown + CSV, label by eval length) and one plot of every curve.

Runs are grouped by encoding and by every config key that differs between them (a swept key),
except the seed: seeds of one group are averaged, with the spread shown as a 95% interval.
"""
from __future__ import annotations

import csv
import io
import math
from collections import defaultdict
from pathlib import Path
from typing import Dict, List, Optional, Tuple

from hydra.experimental.callback import Callback

from posbench.config import ConfigError
from posbench.io import atomic_path, write_text
from posbench.results import RESULTS, load_results

# keys that differ between runs without being an experimental factor
IGNORED_KEYS = ("seed", "dataset.cache_dir", "logger.")


def plot_curves(series: Dict[str, List[Tuple[int, float, Optional[float]]]], train_len: int,
                path: Path, title: str = "", band_label: str = "") -> None:
    """Log-scale perplexity against length, one line per label, optional +-band, the training
    length marked. Written atomically."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5))
    for label, points in series.items():
        if not points:
            continue
        xs, ys, bands = zip(*sorted(points))
        line, = ax.plot(xs, ys, marker="o", label=label)
        if all(b is not None for b in bands):
            ax.fill_between(xs, [y - b for y, b in zip(ys, bands)],
                            [y + b for y, b in zip(ys, bands)], color=line.get_color(), alpha=0.2)
    ax.axvline(train_len, color="gray", linestyle="--", label=f"train length {train_len}")
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("evaluation length (tokens)")
    ax.set_ylabel("perplexity")
    ax.set_title(title + (f"\nshaded: {band_label}" if band_label else ""))
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    with atomic_path(path) as tmp:
        fig.savefig(tmp, dpi=120, format="png")
    plt.close(fig)


def find_runs(root: Path) -> List[dict]:
    runs = []
    for path in sorted(Path(root).rglob(RESULTS)):
        record = load_results(path)
        record["_dir"] = str(path.parent)
        runs.append(record)
    return runs


def _flatten(d: dict, prefix: str = "") -> Dict[str, str]:
    flat = {}
    for key, value in d.items():
        if isinstance(value, dict):
            flat.update(_flatten(value, f"{prefix}{key}."))
        else:
            flat[f"{prefix}{key}"] = repr(value)
    return flat


def group_label(runs: List[dict]) -> Dict[int, str]:
    """Label of each run: its encoding plus every swept key (not the seed) that differs."""
    flats = [_flatten(r["config"]) for r in runs]
    keys = sorted({k for f in flats for k in f})
    swept = [k for k in keys if len({f.get(k) for f in flats}) > 1 and k != "encoding.name"
             and not k.startswith(IGNORED_KEYS)]
    labels = {}
    for i, (run, flat) in enumerate(zip(runs, flats)):
        extra = ",".join(f"{k}={flat.get(k, '-')}" for k in swept)
        labels[i] = run["encoding"] + (f" [{extra}]" if extra else "")
    return labels


def aggregate(runs: List[dict]) -> Dict[str, Dict[int, dict]]:
    """label -> length -> {mean, sem, ci95, n} of perplexity over seeds."""
    labels = group_label(runs)
    values: Dict[str, Dict[int, List[float]]] = defaultdict(lambda: defaultdict(list))
    for i, run in enumerate(runs):
        for point in run["eval"]["curve"]:
            if "ppl" in point:
                values[labels[i]][point["length"]].append(point["ppl"])
    table = {}
    for label, by_length in sorted(values.items()):
        table[label] = {}
        for length, ppls in sorted(by_length.items()):
            n = len(ppls)
            mean = sum(ppls) / n
            sd = math.sqrt(sum((p - mean) ** 2 for p in ppls) / (n - 1)) if n > 1 else 0.0
            sem = sd / math.sqrt(n)
            table[label][length] = {"mean": mean, "sd": sd, "sem": sem, "ci95": 1.96 * sem, "n": n}
    return table


def write_report(root: Path) -> Path:
    """summary.md, summary.csv and ppl_vs_length.png in `root` from every run below it."""
    root = Path(root)
    if not root.is_dir():
        raise ConfigError(f"report dir {str(root)!r} is not accepted; expected a folder of runs")
    runs = find_runs(root)
    ok = [r for r in runs if r.get("status") == "ok"]
    failed = [r for r in runs if r.get("status") != "ok"]
    if not ok:
        raise ConfigError(f"report dir {str(root)!r} is not accepted: it holds no finished run "
                          f"({RESULTS} with status ok); expected a run or sweep folder")
    table = aggregate(ok)
    lengths = sorted({length for by_length in table.values() for length in by_length})
    train_lens = sorted({r["train"]["seq_len"] for r in ok})
    seeds = max(s["n"] for by_length in table.values() for s in by_length.values())

    out = io.StringIO()
    writer = csv.writer(out)
    writer.writerow(["label", "length", "ppl_mean", "ppl_sd", "ppl_ci95", "seeds"])
    for label, by_length in table.items():
        for length, s in by_length.items():
            writer.writerow([label, length, f"{s['mean']:.6g}", f"{s['sd']:.6g}",
                             f"{s['ci95']:.6g}", s["n"]])
    write_text(root / "summary.csv", out.getvalue())

    def cell(s):
        return f"{s['mean']:.3f}" + (f" ± {s['ci95']:.3f}" if s["n"] > 1 else "")

    lines = [f"# posbench report: {len(ok)} runs", "",
             f"Perplexity by evaluation length (training length {', '.join(map(str, train_lens))})"
             + ("; mean ± 95% interval over seeds" if seeds > 1 else "") + ".", "",
             "| encoding | " + " | ".join(str(n) for n in lengths) + " | ppl(longest)/ppl(train) |",
             "|---|" + "---:|" * (len(lengths) + 1)]
    for label, by_length in table.items():
        ratio = extrapolation_ratio(by_length, train_lens[0])
        cells = [cell(by_length[n]) if n in by_length else "—" for n in lengths]
        cells.append(f"{ratio:.2f}" if ratio else "—")
        lines.append(f"| {label} | " + " | ".join(cells) + " |")
    if failed:
        lines += ["", "Failed runs:", ""] + [f"- {r['_dir']}: {r.get('error', r.get('status'))}"
                                            for r in failed]
    write_text(root / "summary.md", "\n".join(lines) + "\n")

    series = {label: [(n, s["mean"], s["ci95"] if s["n"] > 1 else None)
                      for n, s in by_length.items()] for label, by_length in table.items()}
    plot_curves(series, train_lens[0], root / "ppl_vs_length.png",
                title=f"perplexity vs length ({len(ok)} runs)",
                band_label="95% interval over seeds (1.96 x standard error)" if seeds > 1 else "")
    print("\n".join(lines))
    print(f"\nwrote {root / 'summary.md'}, summary.csv, ppl_vs_length.png")
    return root


def extrapolation_ratio(by_length: Dict[int, dict], train_len: int) -> Optional[float]:
    if train_len not in by_length:
        return None
    return by_length[max(by_length)]["mean"] / by_length[train_len]["mean"]


class SweepReport(Callback):
    """Hydra callback: at the end of a multirun, report over the sweep dir."""

    def on_multirun_end(self, config, **kwargs) -> None:
        sweep_dir = Path(config.hydra.sweep.dir)
        if any(sweep_dir.rglob(RESULTS)):
            try:
                write_report(sweep_dir)
            except ConfigError as err:
                print(f"posbench report: {err}")
