"""`posbench reproduce`: --list, NAME [overrides] (a `posbench train -m` sweep, then the entry's
re-scores of its finished runs, `posbench eval RUN_DIR overrides`, then its judgement), NAME
--dry-run (the sweep's cost, nothing run), NAME --report DIR (judge finished runs again). Bad
input is one line and exit 2, with nothing written."""
from __future__ import annotations

import importlib.util
import re
import shutil
import subprocess
import sys
from pathlib import Path
from typing import List, Optional, Tuple

from posbench.core.errors import ConfigError, did_you_mean
from posbench.core.resolvers import override_key
from posbench.reproduce.base import registry
from posbench.reports.report import find_runs
from posbench.reproduce.judge import check_owner, finished_records, judge
from posbench.reproduce.rescores import dry_run_line, planned

# the launcher that runs a CPU entry's jobs side by side (the cluster and test extras install it)
JOBLIB = importlib.util.find_spec("hydra_plugins.hydra_joblib_launcher") is not None
USAGE = ("posbench reproduce --list | NAME [overrides] [--dry-run] | NAME --report DIR")
SWEEP_DIR = "hydra.sweep.dir"
DEFAULT_ROOT = "outputs/reproduce"


def list_entries() -> None:
    for name, found in registry().items():
        e = found.cls
        runs = ("runs on a CPU" if e.device == "cpu"
                else f"needs a GPU (CPU: {e.reduced})")
        cite = re.match(r".*?\d{4}", e.paper)
        print(f"{name:<18} {cite[0] if cite else e.paper}, {e.where}; {e.setting}; {runs}")


def entry_named(name: str):
    entries = registry()
    if name not in entries:
        raise ConfigError(f"reproduce entry {name!r} is not accepted{did_you_mean(name, entries)};"
                          f" expected one of: {', '.join(entries)} (`posbench reproduce --list`)")
    return entries[name].cls


def sweep_overrides(entry, given: List[str]) -> List[str]:
    """The entry's sweep with the command line's overrides: one of the same key replaces the
    entry's, and a config group chosen on the command line (hydra/launcher=basic) drops the
    entry's keys of the group it replaces (hydra.launcher.*)."""
    keys = {override_key(o) for o in given}
    groups = tuple(k.replace("/", ".") + "." for k in keys if "/" in k)
    kept = [o for o in entry.sweep.overrides
            if override_key(o) not in keys and not override_key(o).startswith(groups)]
    head = [f"+experiment={entry.sweep.experiment}"] if entry.sweep.experiment else []
    return head + kept + list(given) + one_job_per_core(entry, keys)


def one_job_per_core(entry, keys) -> List[str]:
    """A CPU entry's jobs run one per usable core (joblib's n_jobs=-1; posbench gives each job
    its share of the threads) where the joblib launcher is installed and the command line
    chooses no launcher; without it they run one after another."""
    if entry.device != "cpu" or "hydra/launcher" in keys or not JOBLIB:
        return []
    return ["hydra/launcher=joblib"]


def posbench_command() -> List[str]:
    """The installed `posbench` beside this interpreter, else this interpreter running it."""
    beside = Path(sys.executable).parent / "posbench"
    if beside.is_file():
        return [str(beside)]
    found = shutil.which("posbench")
    return [found] if found else [sys.executable, "-c", "from posbench.cli import main; main()"]


def parse(rest: List[str]) -> Tuple[str, bool, Optional[str], List[str]]:
    """NAME, --dry-run, --report DIR, overrides."""
    if not rest or rest[0].startswith("-"):
        raise ConfigError(f"posbench reproduce needs an entry's name or --list; expected `{USAGE}`")
    name, dry, report, overrides = rest[0], False, None, []
    args = iter(rest[1:])
    for arg in args:
        if arg == "--dry-run":
            dry = True
        elif arg == "--report" or arg.startswith("--report="):
            report = arg.partition("=")[2] if "=" in arg else next(args, None)
            if not report:
                raise ConfigError(f"--report needs a folder; expected `{USAGE}`")
        elif arg.startswith("-") or "=" not in arg:
            raise ConfigError(f"{arg!r} is not accepted by posbench reproduce; expected "
                              f"`{USAGE}` (overrides as key=value)")
        else:
            overrides.append(arg)
    if report is not None and (dry or overrides):
        raise ConfigError(f"--report judges finished runs and takes no overrides or --dry-run; "
                          f"expected `posbench reproduce {name} --report DIR`")
    return name, dry, report, overrides


def rescore(entry, folder: Path) -> int:
    """Each declared re-score of the finished runs in `folder` that is not there yet, one after
    another, as `posbench eval RUN_DIR overrides` writes it; the worst exit status."""
    code = 0
    for wanted in planned(entry, find_runs(folder)[0]):
        if wanted.found:
            print(f"posbench: skipped `{wanted.command()}`: {wanted.found['_file']} holds this "
                  f"re-score ({wanted.row})")
            continue
        print(f"posbench reproduce: {wanted.row}: `{wanted.command()}`", flush=True)
        code = max(code, subprocess.call([*posbench_command(), "eval", wanted.run_dir,
                                          *wanted.overrides]))
    return code


def needs_device(entry) -> None:
    if entry.device == "cuda":
        import torch

        if not torch.cuda.is_available():
            raise ConfigError(f"reproduce entry {entry.name!r} is not accepted here: it runs on "
                              f"a GPU and none is visible; expected `posbench reproduce "
                              f"{entry.reduced}`, its reduced setting for a CPU")


def reproduce(rest: List[str]) -> None:
    if rest == ["--list"]:
        list_entries()
        return
    name, dry, report, overrides = parse(rest)
    entry = entry_named(name)
    if report is not None:
        judge(entry, Path(report))
        return
    needs_device(entry)
    sweep_dir = next((o.partition("=")[2] for o in overrides if override_key(o) == SWEEP_DIR),
                     None)
    if not sweep_dir:
        sweep_dir = f"{DEFAULT_ROOT}/{entry.name}"
        overrides = overrides + [f"{SWEEP_DIR}={sweep_dir}"]
    folder = Path(sweep_dir)
    if folder.is_dir():  # resuming: it must hold this entry's runs, if any
        check_owner(entry, folder, finished_records(folder), SWEEP_DIR)
    sweep = sweep_overrides(entry, overrides)
    argv = [*posbench_command(), "train", "-m", *sweep]
    shown = "posbench train -m " + " ".join(sweep)
    if dry:
        print(f"posbench reproduce {entry.name} --dry-run: `{shown}`")
        code = subprocess.call(argv + ["--dry-run"])
        if entry.rescored and not code:
            print(dry_run_line(entry, sweep))
        print(f"declared wall time: {entry.cost}")
        if code:
            sys.exit(code)
        return
    print(f"posbench reproduce {entry.name}: {entry.paper}, {entry.where}")
    print(f"posbench reproduce: `{shown}` (finished runs in {folder} are skipped)", flush=True)
    code = subprocess.call(argv)
    if entry.rescored and folder.is_dir():
        code = max(code, rescore(entry, folder))
    if folder.is_dir() and finished_records(folder):
        judge(entry, folder, flag=SWEEP_DIR)
    elif not code:
        raise ConfigError(f"the sweep in {folder} left no finished run to judge")
    if code:
        sys.exit(code)
