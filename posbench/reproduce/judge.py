"""Judge a reproduction's finished runs: the paper's numbers beside posbench's, each claim with
its verdict, into reproduction.md and reproduction.json in the sweep dir, and for an entry over
tasks reproduction.png, a panel per task (each written atomically); the same table printed. The
runs are read as `posbench report` reads them (posbench/reports/report.py: find_runs,
aggregate), with an entry's declared re-scores as the runs of its re-scored rows
(posbench/reproduce/rescores.py); reproduction.json also marks the folder as the entry's, so that
another entry's --report refuses it."""
from __future__ import annotations

import json
import time
from collections import Counter
from pathlib import Path
from typing import Dict, List, Optional, Tuple

import yaml
from omegaconf import DictConfig, ListConfig, OmegaConf

from posbench.core.composing import composer
from posbench.core.errors import ConfigError
from posbench.core.plots import plot_panels
from posbench.core.io import write_json, write_text
from posbench.reports.report import find_runs
from posbench.reports.by_size import size_label
from posbench.reproduce.claims import VERDICTS, Claim, Measured, task_group, x_text
from posbench.core.resolvers import override_key
from posbench.reproduce.rescores import judged, notes, swept_keys
from posbench.runs.results import RESULTS
from posbench.core.version import __version__

REPORT_MD, REPORT_JSON, FIGURE = "reproduction.md", "reproduction.json", "reproduction.png"


def finished_records(folder: Path) -> List[dict]:
    """The finished runs' own results (not re-scores) below `folder`."""
    runs, _ = find_runs(folder)
    return [r for r in runs if r["_file"] == RESULTS]


def marked_entry(folder: Path) -> Optional[str]:
    """The entry whose judgement reproduction.json holds, if any."""
    try:
        return json.loads((Path(folder) / REPORT_JSON).read_text()).get("entry")
    except (OSError, ValueError, AttributeError):
        return None


def check_owner(entry, folder: Path, records: List[dict], flag: str) -> None:
    """ConfigError unless the runs in `folder` are `entry`'s: by the entry its reproduction.json
    names, else by the encodings the runs trained."""
    marked = marked_entry(folder)
    if marked and marked != entry.name:
        raise ConfigError(f"{flag}={str(folder)!r} is not accepted: it holds runs of reproduce "
                          f"entry {marked!r}, not {entry.name!r}; expected `posbench reproduce "
                          f"{marked} --report {folder}` or another folder")
    others = entry.owns(records)
    if others:
        raise ConfigError(f"{flag}={str(folder)!r} is not accepted: it holds runs of "
                          f"{', '.join(others)}, which reproduce entry {entry.name!r} does not "
                          f"compare ({', '.join(entry.groups)}); expected a folder of "
                          f"`posbench reproduce {entry.name}`")


def _key(x: float) -> str:
    """A measured x as a JSON key: a length ratio `8` or `0.5`, a parameter count in full."""
    return str(int(x)) if float(x).is_integer() else f"{x:g}"


def _cell(value: Optional[float]) -> str:
    return "—" if value is None else f"{value:.3f}" if value < 100 else f"{value:.1f}"


def columns(entry, measured: Measured, train_len: int) -> List[Tuple[str, str, object]]:
    """(header, source, key) per column: each published column, then the posbench column it is
    compared with, then posbench's columns that compare with none."""
    def measured_head(x: float) -> str:
        return (f"posbench {round(x * train_len)} ({x_text(x)})" if entry.axis == "length"
                else f"posbench {size_label(x)}")

    pairs = entry.pairs(measured)
    out = []
    for col, x in pairs.items():
        head = (f"paper {col} ({x_text(entry.x_of(col))})" if entry.axis == "length"
                else f"paper {col}")
        out.append((head, "paper", col))
        if x is not None:
            out.append((measured_head(x), "posbench", x))
    used = {x for x in pairs.values() if x is not None}
    xs = sorted({x for row in measured.values.values() for x in row} - used)
    out += [(measured_head(x), "posbench", x) for x in xs]
    return out


def table(entry, measured: Measured, train_len: int, ratio: bool = False) -> List[str]:
    """Markdown rows: perplexity, or (ratio) perplexity over its value at L."""
    cols = columns(entry, measured, train_len)
    lines = ["| group | " + " | ".join(head for head, _, _ in cols) + " |",
             "|---|" + "---:|" * len(cols)]
    for group in entry.groups:
        paper_row = entry.published.get(group, {})
        ours = measured.values.get(group, {})
        first = next(iter(paper_row.values()), None)
        cells = []
        for _, source, key in cols:
            if source == "paper":
                value = paper_row.get(key)
                if value is None and key in paper_row:
                    cells.append("OOM")
                    continue
                if ratio and value is not None:
                    value = value / first if first else None
            else:
                value = ours.get(key)
                if ratio and value is not None:
                    value = value / ours[1.0] if 1.0 in ours else None
            cells.append(_cell(value))
        lines.append(f"| {group} | " + " | ".join(cells) + " |")
    return lines


def task_tables(measured: Measured, tasks, rows, what: str, head: str = "encoding",
                seeds: Optional[Dict[int, Measured]] = None) -> List[str]:
    """Per task that was measured, a table of each row's score (`what`, e.g. "exact match by
    instance size") at each x over L: the entries over tasks (`<task>/<row>` groups). With
    `seeds` (seed -> that seed's Measured) a cell whose group ran in more than one seed shows
    its lowest and highest seed beside the mean: length generalization is seed-fragile, and the
    highest is what papers that report the best seed quote."""
    lines = []
    for task in tasks:
        by_row = {r: measured.values.get(task_group(task, r), {}) for r in rows}
        xs = sorted({x for row in by_row.values() for x in row})
        if not xs:
            continue
        per_seed = {(r, x): seed_values(seeds, task_group(task, r), x)
                    for r in rows for x in xs} if seeds else {}
        lines += ["", f"## {task}: {what} over L", ""]
        if any(len(values) > 1 for values in per_seed.values()):
            lines += ["Each cell: the mean over seeds (its lowest – highest seed).", ""]
        lines += [f"| {head} | " + " | ".join(f"{x:g}L" for x in xs) + " |",
                  "|---|" + "---:|" * len(xs)]
        for r, row in by_row.items():
            cells = []
            for x in xs:
                per = per_seed.get((r, x), [])
                cell = f"{row[x]:.3f}" if x in row else "—"
                cells.append(cell + (f" ({min(per):.2f}–{max(per):.2f})" if len(per) > 1 else ""))
            lines.append(f"| {r} | " + " | ".join(cells) + " |")
    return lines


def seed_values(seeds: Dict[int, Measured], group: str, x: float) -> List[float]:
    """Each seed's value of `group` at x, for the seeds that measured it."""
    return [m.values[group][x] for m in seeds.values() if x in m.values.get(group, {})]


def task_panels(entry, measured: Measured,
                seeds: Dict[int, Measured]) -> Dict[str, Dict[str, tuple]]:
    """The figure of an entry over tasks (axis "score", `<task>/<row>` groups): task -> row ->
    ((x, mean, 95% band) points, each seed's (x, value)), in the order of the entry's groups;
    `seeds` is entry.per_seed(measured), and bands and seeds' points come only where more than
    one seed ran. {} for the other axes."""
    if entry.axis != "score":
        return {}
    several = len(seeds) > 1
    panels: Dict[str, Dict[str, tuple]] = {}
    for group in entry.groups:
        row = measured.values.get(group)
        if not row:
            continue
        task, _, name = group.rpartition("/")
        band = measured.spread.get(group, {})
        points = [(x, v, band.get(x) if several else None) for x, v in sorted(row.items())]
        each = [(x, v) for m in seeds.values() for x, v in m.values.get(group, {}).items()]
        panels.setdefault(task, {})[name] = (points, each if several else None)
    return panels


def draw_tasks(entry, measured: Measured, path: Path) -> bool:
    """task_panels drawn as small multiples at `path`; False where there is nothing to draw."""
    seeds = entry.per_seed(measured)
    panels = task_panels(entry, measured, seeds)
    if not panels:
        return False
    title = (f"posbench reproduce {entry.name}: {measured.score} by {entry.x_name} over L"
             + (f"\nline: mean of {len(seeds)} seeds; shaded: its 95% interval (Student t); "
                "circles: each seed" if len(seeds) > 1 else ""))
    plot_panels(panels, path, title, f"{entry.x_name} / L", measured.score)
    return True


def paired_tables(entry, measured: Measured, train_len: int) -> List[str]:
    """The published numbers beside posbench's, by length (and as ratios to L) or by size."""
    what = "at the training length by model size" if entry.axis == "size" else "by length"
    lines = ["", f"## Perplexity {what}: the paper's and posbench's", ""]
    if entry.axis == "length":
        lines += [f"Each published length is set beside the posbench length of the nearest "
                  f"ratio to the training length (the paper's L = {entry.paper_train_length}, "
                  f"posbench's L = {train_len}). Absolute perplexities "
                  + ("are of different models and corpora: compare the ratios below."
                     if not entry.at_paper_scale() else "differ with the model and budget; "
                     "the claims read ratios and orderings."), ""]
    else:
        lines += ["The ends of posbench's ladder of sizes are set beside the ends of the "
                  "paper's; absolute perplexities are of different models and corpora.", ""]
    lines += table(entry, measured, train_len)
    if entry.axis == "length":
        lines += ["", "## Perplexity over its value at L", ""]
        lines += table(entry, measured, train_len, ratio=True)
    return lines


def departures(entry, records: List[dict]) -> List[str]:
    """The overrides the runs were trained with (each run's .hydra/overrides.yaml) that set a key
    the entry does not sweep to another value than the entry's own: a setting other than the
    entry's, which the report names with how many runs had each."""
    swept, own = swept_keys(entry), set(entry.sweep.overrides)
    runs = [r for r in records if r["_file"] == RESULTS]
    counts: Counter = Counter()
    entry_configs: Dict[tuple, DictConfig] = {}  # by the run's row, composed once
    for run in runs:
        path = Path(run["_dir"]) / ".hydra" / "overrides.yaml"
        given = yaml.safe_load(path.read_text()) if path.is_file() else []
        other = [o for o in given if o not in own and override_key(o) not in swept
                 and not override_key(o).startswith(("hydra", "experiment"))]
        if not other:
            continue
        row = tuple(o for o in given if override_key(o) in swept)
        if row not in entry_configs:
            entry_configs[row] = entry_config(entry, swept, row)
        counts.update(o for o in other if not sets_what_entry_sets(entry_configs[row], o))
    return [f"{o} ({n} of {len(runs)} runs)" for o, n in counts.items()]


def entry_config(entry, swept: set, row: tuple) -> DictConfig:
    """The config the entry gives the run of `row` (its swept overrides)."""
    experiment = [f"+experiment={entry.sweep.experiment}"] if entry.sweep.experiment else []
    fixed = [o for o in entry.sweep.overrides if override_key(o) not in swept]
    with composer() as compose:
        return compose([*experiment, *fixed, *row])


def sets_what_entry_sets(cfg: DictConfig, override: str) -> bool:
    """Whether `key=value` gives a plain key the value the entry's config has (a config group's
    choice, such as model=tiny, is not compared: it stays a departure)."""
    from hydra.core.override_parser.overrides_parser import OverridesParser

    parsed = OverridesParser.create().parse_overrides([override])[0]
    node = OmegaConf.select(cfg, parsed.key_or_group, default=None)
    if node is None or isinstance(node, DictConfig) or parsed.is_sweep_override():
        return False
    value = OmegaConf.to_container(node) if isinstance(node, ListConfig) else node
    return value == parsed.value()


def machine_label(record: dict) -> str:
    """The machine a run was computed on (results.json `machine`), in a few words."""
    m = record.get("machine")
    if m is None:  # written before results.json recorded it
        return "not recorded"
    if "gpu" in m:
        return f"{m['gpu']} (torch {m['torch']})"
    threads = f"{m['threads']} thread" + "s" * (m["threads"] != 1)
    return f"{m['cpu']} (torch {m['torch']}, {m['cpu_capability']}, {threads})"


def machines(records: List[dict]) -> List[str]:
    """Each machine the trained runs were computed on, with how many: the same run repeats bit
    for bit on one machine and only within noise on another."""
    counts = Counter(machine_label(r) for r in records if r["_file"] == RESULTS)
    return [f"{name}: {n} run{'s' * (n != 1)}" for name, n in counts.most_common()]


def render(entry, folder: Path, records: List[dict], measured: Measured,
           verdicts: List[Tuple[Claim, str, str]], train_len: int,
           rescore_notes: List[str], departed: List[str], computed_on: List[str],
           figure: bool = False) -> str:
    trained = sum(r["_file"] == RESULTS for r in records)
    rescored = len(records) - trained
    seeds: Dict[str, int] = {}
    for record in records:
        group = entry.group_of(record)
        seeds[group] = seeds.get(group, 0) + 1
    scale = ("the paper's setting" if entry.at_paper_scale()
             else f"reduced from the paper's: {entry.reduction}")
    lines = [f"# posbench reproduce {entry.name}", "",
             f"{entry.paper}, {entry.where}.", "",
             f"- Setting: {entry.setting}; {scale.rstrip('.')}.",
             f"- Published numbers: {entry.source.rstrip('.')}.",
             f"- Runs: {trained} finished" + (f" and {rescored} re-scores" if rescored else "")
             + f" in {folder} (runs per group: "
             + ", ".join(f"{g} {n}" for g, n in sorted(seeds.items())) + ").", *rescore_notes,
             f"- Computed on: {'; '.join(computed_on)}.",
             *([f"- Departures from the entry's setting, the runs' own overrides: "
                f"{', '.join(departed)}; the verdicts are of that setting."] if departed else []),
             "", "## Verdicts", "",
             "| claim | verdict | measured |", "|---|---|---|"]
    lines += [f"| {claim.name} | {verdict} | {detail} |" for claim, verdict, detail in verdicts]
    lines += ["", "Each claim, its tolerance and why:", ""]
    lines += [f"- **{claim.name}** ({verdict}): {claim.statement}. Tolerance "
              f"{claim.tolerance_text()}: {claim.why}." for claim, verdict, _ in verdicts]
    if figure:
        lines += ["", f"![each task's score by {entry.x_name} over L, one panel per task]"
                      f"({FIGURE})"]
    lines += entry.tables(measured, train_len)
    return "\n".join(lines) + "\n"


def judge(entry, folder: Path, flag: str = "--report") -> dict:
    """Judge the finished runs below `folder` for `entry`; writes reproduction.md and
    reproduction.json there and prints the report. ConfigError (nothing written) for a folder
    that holds no finished run or runs of another entry."""
    folder = Path(folder)
    if not folder.is_dir():
        raise ConfigError(f"{flag}={str(folder)!r} is not accepted; expected a folder of runs "
                          f"of `posbench reproduce {entry.name}`")
    runs, _ = find_runs(folder)
    trained = [r for r in runs if r["_file"] == RESULTS]
    if not trained:
        raise ConfigError(f"{flag}={str(folder)!r} is not accepted: it holds no finished run "
                          f"({RESULTS} with status ok); expected a sweep dir of `posbench "
                          f"reproduce {entry.name}`")
    check_owner(entry, folder, trained, flag)
    records, plan, left_out = judged(entry, runs)
    measured = entry.measure(records)
    train_len = trained[0]["train"]["seq_len"]
    verdicts = [(claim, *claim.judge(measured)) for claim in entry.claims]
    assert all(v in VERDICTS for _, v, _ in verdicts), verdicts
    departed = departures(entry, records)
    drawn = draw_tasks(entry, measured, folder / FIGURE)
    computed_on = machines(records)
    text = render(entry, folder, records, measured, verdicts, train_len,
                  notes(plan, left_out, entry.name), departed, computed_on, drawn)
    record = {
        "entry": entry.name, "paper": entry.paper, "where": entry.where,
        "setting": entry.setting, "at_paper_scale": entry.at_paper_scale(),
        "reduction": entry.reduction, "axis": entry.axis,
        "paper_train_length": entry.paper_train_length, "train_length": train_len,
        "published": {g: {str(x): v for x, v in row.items()} for g, row in entry.published.items()},
        "source": entry.source,
        "measured": {g: {_key(x): v for x, v in row.items()}
                     for g, row in measured.values.items()},
        "pairs": {str(col): None if x is None else _key(x)
                  for col, x in entry.pairs(measured).items()},
        "runs": [r["_dir"] for r in records if r["_file"] == RESULTS],
        "machines": computed_on, "departures": departed, "figure": FIGURE if drawn else None,
        "claims": [{"name": c.name, "statement": c.statement, "tolerance": c.tolerance,
                    "tolerance_text": c.tolerance_text(), "why": c.why, "verdict": verdict,
                    "detail": detail} for c, verdict, detail in verdicts],
        "version": __version__, "judged_at": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
    }
    if entry.rescored:
        record["rescores"] = {"written": [f"{w.run_dir}/{w.found['_file']}" for w in plan
                                          if w.found],
                              "missing": [w.command() for w in plan if not w.found],
                              "left_out": [r["_dir"] for r in left_out]}
    write_text(folder / REPORT_MD, text)
    write_json(folder / REPORT_JSON, record)
    print(text)
    print(f"wrote {folder / REPORT_MD}, {REPORT_JSON}" + (f", {FIGURE}" if drawn else ""))
    return record
