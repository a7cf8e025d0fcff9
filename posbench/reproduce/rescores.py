"""The rows of an entry that are another row's runs scored again (Reproduction.rescored, base.py):
which re-scores the finished runs of a folder call for and which of them are there, the judge's
records (the declared re-scores, never another results.eval-*.json), and how many re-scores a
sweep leads to, for --dry-run. command.py runs the missing ones as `posbench eval RUN_DIR
overrides`, whose files (posbench/runs/rescore.py) are what is read here."""
from __future__ import annotations

from collections import Counter
from dataclasses import dataclass
from typing import List, Optional, Tuple

import yaml

from posbench.core.composing import composer
from posbench.core.resolvers import override_key
from posbench.runs.results import RESULTS


@dataclass(frozen=True)
class Wanted:
    """One declared re-score of one finished run: its record once written (None: missing)."""
    run_dir: str
    row: str
    overrides: Tuple[str, ...]
    found: Optional[dict]

    def command(self) -> str:
        return f"posbench eval {self.run_dir} {' '.join(self.overrides)}"


def is_rescore(record: dict, overrides: Tuple[str, ...]) -> bool:
    """Whether a re-score record changed exactly the keys `overrides` set, to their values (as
    YAML reads them: a factor 2 is the config's 2.0)."""
    changes = (record.get("rescore") or {}).get("changes")
    wanted = {override_key(o): yaml.safe_load(o.partition("=")[2]) for o in overrides}
    return changes == wanted


def planned(entry, runs: List[dict]) -> List[Wanted]:
    """Each declared re-score of each finished run of its source row among `runs` (find_runs'
    records, re-scores included), in the order of entry.rescored, then of the runs."""
    trained = [r for r in runs if r["_file"] == RESULTS]
    out = []
    for row, rescore in entry.rescored.items():
        for run in trained:
            if entry.group_of(run) != rescore.of:
                continue
            found = next((r for r in runs if r["_dir"] == run["_dir"] and r["_file"] != RESULTS
                          and is_rescore(r, rescore.overrides)), None)
            out.append(Wanted(run["_dir"], row, rescore.overrides, found))
    return out


def judged(entry, runs: List[dict]) -> Tuple[List[dict], List[Wanted], List[dict]]:
    """The records the judge reads: the finished runs of the trained rows, then the declared
    re-scores; the declared re-scores of each source run; and the runs left out, trained as a
    re-scored row (an older sweep of the entry, whose seeds the re-scores would repeat)."""
    trained = [r for r in runs if r["_file"] == RESULTS]
    plan = planned(entry, runs)
    left_out = [r for r in trained if entry.group_of(r) in entry.rescored]
    kept = [r for r in trained if entry.group_of(r) not in entry.rescored]
    return kept + [w.found for w in plan if w.found], plan, left_out


def notes(plan: List[Wanted], left_out: List[dict], name: str) -> List[str]:
    """The report's lines on the re-scores: how many, which are missing, which runs were left
    out."""
    done = sum(w.found is not None for w in plan)
    lines = [f"- Re-scores: {done} of the {len(plan)} that the finished runs call for ("
             + "; ".join(f"{row}: {', '.join(w.overrides)}" for row, w in
                         {w.row: w for w in plan}.items()) + ")."] if plan else []
    missing = [w for w in plan if w.found is None]
    if missing:
        lines.append(f"- Missing re-scores (their rows are judged without them; `posbench "
                     f"reproduce {name}` on this folder runs them): "
                     + "; ".join(f"{w.row} of {w.run_dir}" for w in missing) + ".")
    if left_out:
        lines.append("- Left out: runs trained as a re-scored row, which its re-scores replace: "
                     + ", ".join(r["_dir"] for r in left_out) + ".")
    return lines


def sweeper_params(overrides: List[str]) -> dict:
    """hydra.sweeper.params of the config that `overrides` (none a sweep) compose: what an
    experiment sweeps."""
    with composer() as compose:
        cfg = compose(overrides, hydra=True)
    return dict(cfg.hydra.sweeper.params or {})


def sweep_jobs(sweep: List[str]) -> List[List[str]]:
    """The jobs of `posbench train -m <sweep>` as Hydra's basic sweeper expands them: the
    experiment's hydra.sweeper.params, replaced key by key by the command line's."""
    from hydra._internal.core_plugins.basic_sweeper import BasicSweeper
    from hydra.core.override_parser.overrides_parser import OverridesParser

    parser = OverridesParser.create()
    fixed = [o.input_line for o in parser.parse_overrides(sweep) if not o.is_sweep_override()]
    params = [f"{k}={v}" for k, v in sweeper_params(fixed).items()]
    (jobs,) = BasicSweeper.split_arguments(parser.parse_overrides(params + sweep), None)
    return jobs


def sweep_rows(entry, sweep: List[str]) -> List[str]:
    """The row of each job of `posbench train -m <sweep>` (sweep_jobs), each composed."""
    from posbench.config import to_container

    jobs = sweep_jobs(sweep)
    rows = []
    with composer() as compose:
        for job in jobs:
            cfg = compose([o for o in job if not override_key(o).startswith("hydra")])
            rows.append(entry.group_of({"encoding": cfg.encoding.name,
                                        "config": to_container(cfg)}))
    return rows


def swept_keys(entry) -> set:
    """The keys the entry's sweep varies (its experiment's hydra.sweeper.params and its own sweep
    overrides), seed among them: a run's value of one of them is a row, not another setting."""
    from hydra.core.override_parser.overrides_parser import OverridesParser

    keys = {"seed"} | {override_key(o.input_line) for o in
                       OverridesParser.create().parse_overrides(list(entry.sweep.overrides))
                       if o.is_sweep_override()}
    if entry.sweep.experiment:
        keys |= {override_key(k) for k in
                 sweeper_params([f"+experiment={entry.sweep.experiment}"])}
    return keys


def dry_run_line(entry, sweep: List[str]) -> str:
    """What the sweep's runs call for after it, for --dry-run."""
    jobs = Counter(sweep_rows(entry, sweep))
    total = sum(jobs[r.of] for r in entry.rescored.values())
    return (f"then {total} re-score{'s' * (total != 1)} of the finished runs, each one scoring of "
            "a trained checkpoint (`posbench eval RUN_DIR overrides`): "
            + "; ".join(f"{row}: {jobs[r.of]} run{'s' * (jobs[r.of] != 1)} of {r.of} with "
                        f"{' '.join(r.overrides)}" for row, r in entry.rescored.items()))
