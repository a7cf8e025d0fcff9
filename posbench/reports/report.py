"""Compare runs: a table (markdown + CSV, label by eval length) and one plot of every curve.

Runs are grouped by encoding and by every config key that differs between them (a swept key),
except the seed: seeds of one group are averaged, with a 95% Student-t interval of the mean, and
a second run with a seed its group already has is a repeat, counted once. Each re-score
(results.eval-*.json) is a group of its own, labelled by what it changed and drawn over the
curve it re-scored; one that changed only eval.retrieval.* keys adds retrieval rows alone (its
perplexity copies its original's). Task datasets add exact-match accuracy, drawn a panel per task
when there are several; runs scored on RULER or LongPPL add those by group (long_context.py).
Runs that failed, were interrupted, were refused at their start or left no results.json are
listed.
Perplexities of two eval.protocol values are not comparable (sliding windows give each token more
context): a folder holding several says so in one line, the gap at the training length compares
groups of one protocol, and `--protocol NAME` reports one alone.
docs/design.md, "The report".
"""
from __future__ import annotations

import csv
import hashlib
import io
import math
from collections import Counter, defaultdict
from pathlib import Path
from typing import Any, Dict, List, Optional, Tuple

from hydra.experimental.callback import Callback

from posbench.config import flatten, to_container, with_defaults
from posbench.core.errors import ConfigError
from posbench.core.io import write_text
from posbench import evaluations
from posbench.evaluations import retrieval
from posbench.reports.html import PAGE, write_html
from posbench.reports import (by_size, long_context, paired, position_frequency, self_extend,
                              tuning)
from posbench.reports.stats import BAND, mean_band
from posbench.core.parity import UNDER_TRAINED, Gap, parity_gaps
from posbench.runs.extend import plot_sweep
from posbench.core.plots import METRICS, plot_curves, plot_panels
from posbench.runs.rescore import change_label, eval_changes, override_text
from posbench.runs.results import REFUSED, RESULTS, load_results, rescore_label

# keys that differ between runs without being an experimental factor
IGNORED_KEYS = ("seed", "dataset.cache_dir", "logger.")
RESCORE_PREFIX = "results.eval-"  # the re-scores of posbench eval (posbench/runs/rescore.py)
VALUE_CHARS = 16  # a longer value is cut in a group label


def find_runs(root: Path) -> Tuple[List[dict], List[dict]]:
    """Every finished record below `root` (results.json and the re-scores results.eval-*.json,
    each marked with its `_dir` and `_file`), and what did not finish: records with another
    status or unreadable, run dirs without results.json (a job killed before it could write
    one), and sweep jobs refused at their start (their refused.json)."""
    runs, failed = [], []
    for path in sorted(Path(root).rglob("results*.json")):
        if path.name != RESULTS and not path.name.startswith(RESCORE_PREFIX):
            continue
        try:
            record = load_results(path)
        except (OSError, ValueError) as err:
            record = {"status": "unreadable", "error": f"{path.name} unreadable: {err}"}
        record["_dir"], record["_file"] = str(path.parent), path.name
        (runs if record.get("status") == "ok" else failed).append(record)
    for config in sorted(Path(root).rglob(".hydra/config.yaml")):
        run_dir = config.parent.parent
        if not (run_dir / RESULTS).exists():
            failed.append({"_dir": str(run_dir), "status": "incomplete",
                           "error": f"no {RESULTS} (killed, or still running)"})
    for path in sorted(Path(root).rglob(REFUSED)):
        # a job dir started again since its refusal holds .hydra/ or results
        if not (path.parent / RESULTS).exists() and not (path.parent / ".hydra").exists():
            try:
                error = load_results(path)["error"]
            except (OSError, ValueError, KeyError) as err:
                error = f"{REFUSED} unreadable: {err}"
            failed.append({"_dir": str(path.parent), "status": "refused", "error": error})
    return runs, failed


def _differs(key: str, runs: List[dict], flats: List[Dict[str, str]]) -> bool:
    """Whether a key was swept. Encodings have keys of their own, so an encoding's key counts
    only where it differs between runs of that encoding."""
    groups = defaultdict(set)
    for run, flat in zip(runs, flats):
        groups[run["encoding"] if key.startswith("encoding.") else ""].add(flat.get(key))
    return any(len(values) > 1 for values in groups.values())


def short_keys(keys: List[str]) -> Dict[str, str]:
    """key -> its last component (train.seq_len -> seq_len), or the whole key where two keys
    share the last component."""
    last = defaultdict(list)
    for key in keys:
        last[key.rsplit(".", 1)[-1]].append(key)
    return {key: name if len(same) == 1 else key for name, same in last.items() for key in same}


def short_text(value) -> str:
    """A value as a label shows it: a path's last part, a long value cut."""
    text = override_text(value)
    if "/" in text.strip("/"):
        text = text.rstrip("/").rsplit("/", 1)[-1]
    return text if len(text) <= VALUE_CHARS else text[:VALUE_CHARS - 1] + "…"


def _settings(runs: List[dict], ignore: Tuple[str, ...]):
    """Each run's flat config, its values as comparable strings, and the swept keys: those that
    differ between runs (not the seed, nor a key starting with one of `ignore`)."""
    # a key added since a run was saved reads as its default, which is what that run did: runs
    # of one setting saved by two posbench versions are one group
    flats = [flatten(to_container(with_defaults(r.get("config", {})))) for r in runs]
    # repr: values become comparable strings, lists included
    texts = [{k: repr(v) for k, v in flat.items()} for flat in flats]
    keys = sorted({k for f in texts for k in f})
    swept = [k for k in keys if k != "encoding.name" and not k.startswith(IGNORED_KEYS + ignore)
             and _differs(k, runs, texts)]
    return flats, texts, swept


def _usual(runs: List[dict], texts: List[Dict[str, str]], swept: List[str]) -> Dict[tuple, str]:
    """(key, encoding) -> the value most of the distinct settings share, where one value is the
    most common (an encoding's own key counted over that encoding's settings, other keys over
    all); a grid, where values tie, has none. A label leaves out a key at its usual value, so a
    sweep of knobs reads `rope [attn_sinks=true]` rather than every knob of every row."""
    settings = {(run["encoding"], tuple(text.get(k) for k in swept))
                for run, text in zip(runs, texts)}
    usual = {}
    for i, key in enumerate(swept):
        scopes = sorted({r["encoding"] for r in runs}) if key.startswith("encoding.") else [""]
        for scope in scopes:
            counts = Counter(values[i] for name, values in settings
                             if scope in ("", name)).most_common(2)
            if len(counts) == 1 or counts[0][1] > counts[1][1]:
                usual[key, scope] = counts[0][0]
    return usual


def group_label(runs: List[dict], ignore: Tuple[str, ...] = ()) -> Tuple[Dict[int, str],
                                                                          List[str]]:
    """Label of each run: its encoding plus every swept key whose value is not the usual one
    (`_usual`), in short: `alibi [seq_len=64, lr=0.001]`. Runs with the same label are one group;
    groups whose short labels would coincide get a hash of their full values. Also `key=value`
    of each usual value that some labels leave out (an encoding's own key named with its
    encoding: `t5 num_buckets=32`), for summary.md to name."""
    flats, texts, swept = _settings(runs, ignore)
    usual = _usual(runs, texts, swept)
    names = short_keys(swept)
    full, short = {}, {}
    for i, (run, flat) in enumerate(zip(runs, flats)):
        scope = lambda k: run["encoding"] if k.startswith("encoding.") else ""
        # an encoding's key that this run lacks is usual (None) among its encoding's settings
        shown = [k for k in swept if texts[i].get(k) != usual.get((k, scope(k)), object())]
        full[i] = (run["encoding"], tuple(texts[i].get(k, "-") for k in swept))
        extra = ", ".join(f"{names[k]}={short_text(flat[k]) if k in flat else '-'}"
                          for k in shown)
        short[i] = run["encoding"] + (f" [{extra}]" if extra else "")
    groups_of = defaultdict(set)
    for i in short:
        groups_of[short[i]].add(full[i])
    labels = {i: short[i] if len(groups_of[short[i]]) == 1
              else f"{short[i]} #{hashlib.sha256(repr(full[i]).encode()).hexdigest()[:4]}"
              for i in short}
    left_out = {}
    for (key, scope), text in usual.items():
        in_scope = [(f, t) for r, f, t in zip(runs, flats, texts) if scope in ("", r["encoding"])]
        if any(t.get(key) != text for _, t in in_scope):  # some label shows it
            value = next(f[key] for f, t in in_scope if t.get(key) == text)
            left_out[scope, names[key]] = f"{names[key]}={short_text(value)}"
    return labels, [(f"{scope} " if scope else "") + text
                    for (scope, _), text in sorted(left_out.items())]


def rescore_change(record: dict, original: Optional[dict]) -> str:
    """What a re-score changed from its run's own evaluation, as its file says (or, for files
    written before that was recorded, from the two configs)."""
    label = rescore_label(record)
    if label or original is None:
        return label or record["_file"]
    return change_label(eval_changes(original["config"], record["config"]))


def retrieval_only(record: dict, original: Optional[dict]) -> bool:
    """Whether a re-score changed eval.retrieval.* keys alone: its perplexity then copies its
    original's, and only its retrieval scores are new."""
    changes = record.get("rescore", {}).get("changes")
    if changes is None and original is not None:  # written before changes were recorded
        changes = eval_changes(original["config"], record["config"])
    return bool(changes) and all(key.startswith("eval.retrieval.") for key in changes)


def groups_of(runs: List[dict]) -> Tuple[Dict[str, List[dict]], Dict[str, List[dict]],
                                         Dict[str, str], List[str], List[str]]:
    """label -> its runs (perplexity groups); label -> the re-scores of retrieval alone, which
    are retrieval rows of their original's group; re-score label -> its original's label; a
    line per run left out because it repeats another of its group (the same config and seed:
    not a second seed); and the usual values the labels leave out (group_label)."""
    originals = [r for r in runs if r["_file"] == RESULTS]
    labels, unlabelled = group_label(originals)
    label_of = {r["_dir"]: labels[i] for i, r in enumerate(originals)}
    by_dir = {r["_dir"]: r for r in originals}
    groups: Dict[str, List[dict]] = defaultdict(list)
    retrieval_rows: Dict[str, List[dict]] = defaultdict(list)
    base_of: Dict[str, str] = {}
    repeats = []
    for record in originals + [r for r in runs if r["_file"] != RESULTS]:
        into = groups
        if record["_file"] == RESULTS:
            label = label_of[record["_dir"]]
        else:
            original = by_dir.get(record["_dir"])
            base = label_of.get(record["_dir"], record["encoding"])
            label = f"{base} ({rescore_change(record, original)})"
            if retrieval_only(record, original):
                into = retrieval_rows
            else:
                base_of[label] = base
        same = next((r for r in into[label] if r.get("seed") == record.get("seed")), None)
        if same is None:
            into[label].append(record)
        else:
            repeats.append(f"- {record['_dir']}/{record['_file']} repeats "
                           f"{same['_dir']}/{same['_file']} (same config and seed "
                           f"{record.get('seed')}): counted once")
    return dict(groups), dict(retrieval_rows), base_of, repeats, unlabelled


def by_task(groups: Dict[str, List[dict]], series: Dict[str, list],
            seeds: Dict[str, list], base_of: Dict[str, str]) -> Tuple[Dict[str, dict],
                                                                     Dict[str, int]]:
    """A metric's curves split by task (dataset name) for plots.plot_panels: task -> label
    within it (group_label of its own groups, so the task no longer names each one) -> (points,
    each seed's points), and task -> its training length; ({}, {}) for one task."""
    tasks: Dict[str, List[str]] = defaultdict(list)
    for label in series:
        tasks[groups[label][0]["dataset"]["name"]].append(label)
    if len(tasks) < 2:
        return {}, {}
    panels, lengths = {}, {}
    for task, labels in tasks.items():
        originals = [label for label in labels if label not in base_of]
        short, _ = group_label([groups[label][0] for label in originals])
        name = {label: short[i] for i, label in enumerate(originals)}
        # a re-score: its original's short label and its change, `rope (pi)`
        name.update({label: name.get(base_of[label], base_of[label])
                     + label[len(base_of[label]):] for label in labels if label in base_of})
        panels[task] = {name[label]: (series[label], seeds.get(label)) for label in labels}
        lengths[task] = groups[labels[0]][0]["train"]["seq_len"]
    return panels, lengths


def in_table_order(by_label: Dict[str, Any]) -> Dict[str, Any]:
    """summary.md's one order of groups, used by every one of its tables: that of its perplexity
    table, by label (a re-score, `<label> (<change>)`, right after the group it re-scores)."""
    return {label: by_label[label] for label in sorted(by_label)}


def aggregate(groups: Dict[str, List[dict]], metric: str = "ppl") -> Dict[str, Dict[int, dict]]:
    """label -> length -> {mean, sd, sem, ci95, n} of a curve metric over the group's seeds."""
    table = {}
    for label, members in in_table_order(groups).items():
        by_length: Dict[int, List[float]] = defaultdict(list)
        for run in members:
            for point in run["eval"]["curve"]:
                if metric in point:
                    by_length[point["length"]].append(point[metric])
        if not by_length:
            continue
        table[label] = {length: mean_band(xs) for length, xs in sorted(by_length.items())}
    return table


def extrapolation_ratio(by_length: Dict[int, dict], train_len: int) -> Optional[float]:
    """ppl(longest) / ppl(L)."""
    if train_len not in by_length:
        return None
    return by_length[max(by_length)]["mean"] / by_length[train_len]["mean"]


def log_ppl_growth(by_length: Dict[int, dict], train_len: int) -> Optional[float]:
    """The headline: the mean over evaluated lengths n > L of ln(ppl(n) / ppl(L)), the area
    between the log-ppl curve and its value at L per evaluated length (0: no worse than at L).
    Every length past L counts, so no single length's windows decide it."""
    past = [s["mean"] for n, s in by_length.items() if n > train_len]
    if train_len not in by_length or not past:
        return None
    return sum(math.log(p / by_length[train_len]["mean"]) for p in past) / len(past)


def _mean(values: List[Optional[float]]) -> Optional[float]:
    values = [v for v in values if v is not None]
    return sum(values) / len(values) if values else None


def _markdown_table(table: Dict[str, Dict[int, dict]], digits: int,
                    ratio_of: Optional[Dict[str, int]] = None,
                    gaps: Optional[Dict[str, Gap]] = None) -> List[str]:
    """With `ratio_of` (label -> training length), the headline log-ppl growth, the
    extrapolation ratio and, from `gaps`, the gap to the best perplexity at the training
    length."""
    lengths = sorted({length for by_length in table.values() for length in by_length})
    cell = lambda s: f"{s['mean']:.{digits}f}" + (f" ± {s['ci95']:.{digits}f}" if s["n"] > 1
                                                   else "")
    head = "| group | " + " | ".join(map(str, lengths)) + " |"
    head += (" log-ppl growth past L | ppl(longest)/ppl(L) | gap at train length |"
             if ratio_of else "")
    lines = [head, "|---|" + "---:|" * (len(lengths) + 3 * bool(ratio_of))]
    for label, by_length in table.items():
        cells = [cell(by_length[n]) if n in by_length else "—" for n in lengths]
        if ratio_of:
            growth = log_ppl_growth(by_length, ratio_of[label])
            ratio = extrapolation_ratio(by_length, ratio_of[label])
            gap = (gaps or {}).get(label)
            cells += [f"{growth:+.3f}" if growth is not None else "—",
                      f"{ratio:.2f}" if ratio else "—", gap.cell() if gap else "—"]
        lines.append(f"| {label} | " + " | ".join(cells) + " |")
    return lines


def _minutes(seconds: float) -> str:
    return f"{int(seconds // 60)}:{int(seconds % 60):02d}"


def budget(record: dict) -> str:
    """What a run's training spent (train.budget), as summary.md names it."""
    t = record["train"]
    kind = t.get("budget", "tokens")  # runs saved before train.budget trained by tokens
    if kind == "flops":
        return f"flops: {t['budget_flops']:.3g} ({t['steps_run']} steps)"
    if kind == "wallclock":
        return f"wallclock: {t['budget_seconds']:g} s on {t['device']} ({t['steps_reached']} steps)"
    return "tokens" + (f": {t['steps']} steps" if "steps" in t else "")


def wallclock_devices(records: list) -> list:
    """The devices the wallclock runs among `records` spent their seconds on, sorted."""
    return sorted({r["train"]["device"] for r in records
                   if r["train"].get("budget") == "wallclock"})


def group_budget(runs: list) -> str:
    """budget() of the group's first run, marked when its wallclock runs used several devices."""
    devices = wallclock_devices(runs)
    mixed = f"; MIXED DEVICES: {', '.join(devices)}" if len(devices) > 1 else ""
    return budget(runs[0]) + mixed


def protocol(record: dict) -> str:
    return record["eval"].get("protocol", "?")


def write_report(root: Path, only: Optional[str] = None) -> Dict[str, dict]:
    """summary.md, summary.csv, ppl_vs_length.png (accuracy_vs_length.png for tasks) and
    report.html, the page of them all (posbench/reports/html.py), in `root` from every run and
    re-score below it (`only`: those scored with that eval.protocol). Returns each trained
    group's parity at the training length."""
    root = Path(root)
    if not root.is_dir():
        raise ConfigError(f"report dir {str(root)!r} is not accepted; expected a folder of runs")
    ok, failed = find_runs(root)
    if not any(r["_file"] == RESULTS for r in ok):
        raise ConfigError(f"report dir {str(root)!r} is not accepted: it holds no finished run "
                          f"({RESULTS} with status ok); expected a run or sweep folder")
    present = sorted({protocol(r) for r in ok})
    if only is not None and only not in present:
        raise ConfigError(f"--protocol {only!r} is not accepted; expected one of the protocols "
                          f"of the results in {str(root)!r}: {', '.join(present)}")
    groups, retrieval_rows, base_of, repeats, unlabelled = groups_of(ok)
    left_out = 0
    if only is not None:  # after grouping, so that labels stay those of the whole folder
        groups = {k: v for k, v in groups.items() if protocol(v[0]) == only}
        retrieval_rows = {k: v for k, v in retrieval_rows.items() if protocol(v[0]) == only}
        left_out = len(ok) - sum(protocol(r) == only for r in ok)
        ok = [r for r in ok if protocol(r) == only]
    tables = {m: aggregate(groups, m) for m in METRICS}
    tables = {m: t for m, t in tables.items() if t}
    train_of = {label: members[0]["train"]["seq_len"] for label, members in groups.items()}
    protocol_of = {label: protocol(members[0]) for label, members in groups.items()}
    train_lens = sorted(set(train_of.values()))
    seeds = max(s["n"] for by_length in tables["ppl"].values() for s in by_length.values())
    protocols = sorted(set(protocol_of.values()))
    # parity compares training, so the re-scores, which change only evaluation, stay out; and
    # groups of one protocol and one model size only, as another protocol's perplexities differ
    # by its windows and a larger model is better at L whatever its encoding
    cohort_of = {label: (protocol_of[label], by_size.model_shape(members[0]))
                 for label, members in groups.items()}
    gaps = {}
    for cohort in set(cohort_of.values()):
        gaps.update(parity_gaps({k: v for k, v in tables["ppl"].items()
                                 if k not in base_of and cohort_of[k] == cohort}, train_of))
    throughput = {label: (_mean([r["train"].get("tokens_per_second") for r in members]),
                          _mean([r["train"].get("wall_seconds") for r in members]))
                  for label, members in groups.items() if label not in base_of}

    out = io.StringIO()
    writer = csv.writer(out)
    writer.writerow(["label", "length", "ppl_mean", "ppl_sd", "ppl_ci95", "seeds",
                     "accuracy_mean", "accuracy_ci95", "train_length", "protocol",
                     "log_ppl_growth", "extrapolation_ratio", "train_length_gap",
                     "train_length_gap_ci95", "under_trained", "rescore_of",
                     "tokens_per_second", "wall_seconds"])
    number = lambda x: "" if x is None else f"{x:.6g}"
    for label, by_length in tables["ppl"].items():
        gap = gaps.get(label)
        tps, wall = throughput.get(label, (None, None))
        per_label = [train_of[label], protocol_of[label],
                     number(log_ppl_growth(by_length, train_of[label])),
                     number(extrapolation_ratio(by_length, train_of[label])),
                     number(gap.gap if gap else None), number(gap.band if gap else None),
                     gap.under_trained if gap else "", base_of.get(label, ""),
                     number(tps), number(wall)]
        for length, s in by_length.items():
            acc = tables.get("accuracy", {}).get(label, {}).get(length)
            writer.writerow([label, length, f"{s['mean']:.6g}", f"{s['sd']:.6g}",
                             f"{s['ci95']:.6g}", s["n"], f"{acc['mean']:.6g}" if acc else "",
                             f"{acc['ci95']:.6g}" if acc else "", *per_label])
    write_text(root / "summary.csv", out.getvalue())

    band = f"; mean ± {BAND}" if seeds > 1 else ""
    rescored = len(ok) - sum(r["_file"] == RESULTS for r in ok)
    lines = [f"# posbench report: {len(ok) - rescored} runs"
             + (f", {rescored} re-scores" if rescored else "")
             + (f" (eval.protocol={only} only; {left_out} results of other protocols left out)"
                if only else ""), ""]
    if len(protocols) > 1:
        counts = [sum(p == name for p in protocol_of.values()) for name in protocols]
        lines += [f"These groups were scored under {len(protocols)} protocols ("
                  + ", ".join(f"{name} ({n} group{'s' * (n != 1)})"
                              for name, n in zip(protocols, counts))
                  + "), whose perplexities are not comparable with each other: the gap at train "
                  f"length compares groups of one protocol; `posbench report {root} --protocol "
                  "NAME` reports one alone.", ""]
    kinds = sorted({r["train"].get("budget", "tokens") for r in ok if r["_file"] == RESULTS})
    if len(kinds) > 1:
        lines += [f"These runs trained under {len(kinds)} budgets ({', '.join(kinds)}; "
                  "train.budget): groups of different budgets did not spend alike, each "
                  "group's is in the throughput table.", ""]
    devices = wallclock_devices([r for r in ok if r["_file"] == RESULTS])
    if len(devices) > 1:
        lines += [f"These wallclock runs spent their seconds on {len(devices)} devices "
                  f"({'; '.join(devices)}): the same seconds buy other steps on each, so groups "
                  "on different devices did not spend alike; the throughput table names each "
                  "group's device and marks a group whose seeds used several.", ""]
    lines += [f"Perplexity by evaluation length (training length "
              f"{', '.join(map(str, train_lens))}; protocol {', '.join(protocols)}){band}. A "
              "group with a change in parentheses is a re-score of the group it names "
              "(`posbench eval`)."
              + (" A label leaves out a key where the group has the value most settings of the "
                 f"sweep share: {', '.join(unlabelled)}." if unlabelled else ""), ""]
    lines += _markdown_table(tables["ppl"], 3, ratio_of=train_of, gaps=gaps)
    lines += ["", "Log-ppl growth past L, the headline: the mean over the evaluated lengths n > L "
              "of ln(ppl(n)/ppl(L)); 0 is no worse than at the training length L. "
              + ("Under growing_context every length scores the same tokens, so it measures "
                 "the use of longer context alone. " if "growing_context" in protocols else "")
              + ("With nonoverlapping or sliding windows each length scores other text, which "
                 "moves every curve alike at some lengths; for a headline free of that, re-score "
                 "this folder with the same tokens at every length: `posbench eval DIR "
                 "eval.protocol=growing_context`."
                 if set(protocols) - {"growing_context"} else ""),
              "", "Gap at train length: perplexity at the training length relative to the best "
              "trained group at that length"
              + (" and model size" if len({c[1] for c in cohort_of.values()}) > 1 else "")
              + (" (± its 95% interval)" if seeds > 1 else "")
              + "."]
    lines += [f"- **{label}** is {UNDER_TRAINED}." for label, gap in gaps.items()
              if gap.under_trained]
    trained = {k: v for k, v in groups.items() if k not in base_of}
    lines += paired.report_lines(trained, {label: gap.best for label, gap in gaps.items()})
    ppl_table = tables["ppl"]
    lines += tuning.report_lines(
        trained, growth=lambda g: log_ppl_growth(ppl_table.get(g, {}), train_of[g]),
        ppl_at_train=lambda g: ppl_table.get(g, {}).get(train_of[g], {}).get("mean"))
    lines += self_extend.report_lines(groups, base_of, ppl_table, root / self_extend.CSV)
    originals = list(trained)
    series, _ = group_label([trained[label][0] for label in originals], ignore=("model.",))
    size_lines = by_size.report_lines(
        trained, {label: series[i] for i, label in enumerate(originals)},
        at_train=lambda g: ppl_table.get(g, {}).get(train_of[g]),
        ratio=lambda g: extrapolation_ratio(ppl_table.get(g, {}), train_of[g]),
        gaps=gaps, path=root / "by_size.png")
    lines += size_lines
    if "accuracy" in tables:
        lines += ["", f"Exact-match accuracy by evaluation length{band}.", ""]
        lines += _markdown_table(tables["accuracy"], 3)
    every_group = in_table_order({**groups, **retrieval_rows})
    grouped = [(label, run) for label, members in every_group.items() for run in members]
    members, member_labels = [run for _, run in grouped], dict(enumerate(l for l, _ in grouped))
    for section in evaluations.sections():
        lines += section.report_lines(members, member_labels)
    # RULER and LongPPL by group, the view that compares the encodings
    across_lines, across_plots = long_context.write(root, every_group)
    lines += across_lines
    lines += ["", "Training budget (train.budget, of the group's first run) and throughput "
              "(mean over seeds):", "",
              "| group | budget | tokens/s | wall time (m:s) |", "|---|---|---:|---:|"]
    lines += [f"| {label} | {group_budget(groups[label])} | " + (f"{tps:.0f}" if tps else "—")
              + " | " + (_minutes(wall) if wall else "—") + " |"
              for label, (tps, wall) in in_table_order(throughput).items()]
    if repeats:
        lines += ["", "Runs left out of the means, as repeats rather than seeds:", ""] + repeats
    if failed:
        lines += ["", "Failed, interrupted or refused runs:", ""] + [
            f"- {r['_dir']} ({r.get('status')}): {r.get('error', r.get('status'))}"
            for r in failed]
    # STRING's f(i) of each trained group's training, beside its perplexity curve
    frequency_drawn, left_out = position_frequency.write(
        root, {label: runs[0] for label, runs in groups.items() if label not in base_of},
        {label: {n: s["mean"] for n, s in by_length.items()}
         for label, by_length in tables.get("ppl", {}).items()})
    if left_out:
        lines += ["", f"Position frequency f(i) ({position_frequency.PLOT}) not drawn for:", "",
                  *left_out]
    write_text(root / "summary.md", "\n".join(lines) + "\n")

    for metric, table in tables.items():
        series = {label: [(n, s["mean"], s["ci95"] if s["n"] > 1 else None)
                          for n, s in by_length.items()] for label, by_length in table.items()}
        # each re-score right after the curve it re-scores, in the same colour
        order = [label for label in series if label not in base_of]
        order = [x for label in order for x in
                 [label, *(r for r in series if base_of.get(r) == label)]]
        order += [label for label in series if label not in order]
        each_seed = {label: [(p["length"], p[metric]) for run in groups[label]
                             for p in run["eval"]["curve"] if metric in p]
                     for label in series if len(groups[label]) > 1}
        title = (f"{METRICS[metric][0]} vs length ({len(ok) - rescored} runs"
                 + (f", {rescored} re-scores" if rescored else "") + ")")
        band_label = f"{BAND}; circles: each seed" if seeds > 1 else ""
        panels, lengths = by_task(groups, {label: series[label] for label in order}, each_seed,
                                  base_of) if metric == "accuracy" else ({}, {})
        if panels:  # a panel per task: their lengths and curves would crowd one axis
            plot_panels(panels, root / f"{metric}_vs_length.png",
                        title + (f"\nshaded: {band_label}" if band_label else ""),
                        "evaluation length (tokens)", METRICS[metric][0], lengths)
            continue
        plot_curves({label: series[label] for label in order}, train_lens[0],
                    root / f"{metric}_vs_length.png", title=title, band_label=band_label,
                    metric=metric, gaps=gaps if metric == "ppl" else None, base_of=base_of,
                    seeds=each_seed)
    plots = [f"{m}_vs_length.png" for m in tables] + ["by_size.png"] * bool(size_lines)
    if frequency_drawn:
        plots.append(position_frequency.PLOT)
    if retrieval.plot_grid(members, member_labels, root / "retrieval_grid.png"):
        plots.append("retrieval_grid.png")
    plots += across_plots
    if plot_sweep(members, member_labels, root / "eval_vs_step.png"):
        plots.append("eval_vs_step.png")
    write_html(root, lines, plots, every_group, ok + failed)
    print("\n".join(lines))
    print(f"\nwrote {root / 'summary.md'}, summary.csv, {PAGE}, " + ", ".join(plots))
    return {label: {"train_length": train_of[label],
                    "train_length_ppl": tables["ppl"][label][train_of[label]]["mean"],
                    "gap": gap.gap, "gap_ci95": gap.band, "under_trained": gap.under_trained,
                    "log_ppl_growth": log_ppl_growth(tables["ppl"][label], train_of[label]),
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
                from posbench.runs.loggers import log_sweep_report

                log_sweep_report(config.logger, sweep_dir, parity)
