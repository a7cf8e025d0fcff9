"""`posbench <verb>`: a thin dispatcher. `train` and `eval` are real Hydra apps (overrides, -m,
--cfg job, --help, hydra.run.dir); `report` and `list` are plain commands."""
from __future__ import annotations

import dataclasses
import os
import re
import select
import shlex
import signal
import sys
import tempfile
import threading
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Callable, List, Optional, Tuple

import hydra
import yaml
from hydra.core.hydra_config import HydraConfig
from hydra.plugins.sweeper import Sweeper
from hydra.types import RunMode
from omegaconf import DictConfig, OmegaConf

import posbench
from posbench.runs import distributed
from posbench.runs.checkpoint import CHECKPOINT
from posbench.config import check, to_container
from posbench import config as config_module
from posbench.core.errors import ConfigError, PosbenchError, did_you_mean, one_line
from posbench.core.io import write_json, write_text
from posbench.core.resolvers import SWEPT, override_key
from posbench.runs.results import REFUSED, RESULTS, load_results

USAGE = """usage: posbench <verb> [args]

  train [overrides]          train short, evaluate long; a Hydra app: -m for sweeps, --cfg job,
                             --help, hydra.run.dir=...   e.g. posbench train encoding=alibi;
                             --dry-run lists the jobs with their estimated cost, runs nothing
  eval DIR [overrides]       re-score a run's checkpoint, or every finished run below DIR, without
                             retraining; -m sweeps eval keys, e.g.
                             posbench eval SWEEP_DIR -m eval.rope_scaling=none,pi,ntk,yarn
  extend RUN_DIR [overrides]  continue a finished run at a longer length (train.seq_len, default 4x)
                             with train.rope_scaling=none|pi|ntk|yarn|llama3, or longrope with
                             train.longrope_factors, or train.pose_span (PoSE), its metric by
                             step in eval_vs_step.csv; -m sweeps, e.g.
                             posbench extend RUN_DIR -m train.rope_scaling=pi,yarn
  longrope RUN_DIR --length N [--seed S] [--scale X]
                             LongRoPE's evolutionary search for per-pair RoPE factors at length N
                             (> the training length) into RUN_DIR/longrope-N-seedS.json, for
                             posbench eval RUN_DIR eval.rope_scaling=longrope
                             eval.longrope_factors=...; --scale: the reference's sizes times X
  inspect RUN_DIR [--lengths L1,L2]
                             plots that explain a run (learned positions' PCA, attention mass by
                             lag per head) into RUN_DIR; lengths default to train length and 4x
  report DIR [--protocol NAME]
                             table, ppl_vs_length.png, report.html over every run below DIR
                             (--protocol: only the results scored with that eval.protocol)
  reproduce --list | NAME [overrides] [--dry-run] | NAME --report DIR
                             a published result re-run as a sweep (outputs/reproduce/NAME) and
                             judged claim by claim beside the paper's numbers (docs/reproduce.md)
  list                       encodings, datasets and model presets, one line each
  --version                  posbench's version
"""


def fail(err: Exception) -> None:
    print(f"posbench: error: {err}", file=sys.stderr)
    sys.exit(2)


def _save_hydra_files(run_dir: Path, cfg: DictConfig) -> None:
    """Hydra's .hydra/ files, written by us only after the config was accepted (our config sets
    hydra.output_subdir=null, so a rejected command never touches an existing run dir)."""
    hc = HydraConfig.get()
    write_text(run_dir / ".hydra" / "config.yaml", OmegaConf.to_yaml(cfg))
    write_text(run_dir / ".hydra" / "hydra.yaml", OmegaConf.to_yaml({"hydra": hc}))
    write_text(run_dir / ".hydra" / "overrides.yaml", OmegaConf.to_yaml(list(hc.overrides.task)))


def _remove_if_empty(run_dir: Path) -> None:
    """A refused run's dir when it holds nothing, and with it the folders Hydra made above it in
    the default outputs/ (outputs/<date>/) when they are left empty; no folder above the run
    dir outside outputs/ is touched."""
    outputs = (Path.cwd() / "outputs").resolve()
    for folder in [run_dir.resolve(), *run_dir.resolve().parents]:
        if folder != run_dir.resolve() and outputs not in (folder, *folder.parents):
            return
        if not folder.is_dir() or any(folder.iterdir()):
            return
        folder.rmdir()


# keys that `posbench eval` adds to Hydra's config of each run it scores
EVAL_RUN, EVAL_FOLDER = "posbench_eval_run", "posbench_eval_folder"
# what `posbench eval` over a folder did, for its summary: (run dir, record) of each re-score
# written, and the run dirs skipped
_rescored: list = []
_skipped: list = []


def _refused(run_dir: Path, err: PosbenchError, multirun: bool) -> None:
    """A job refused at its start: a sweep's job dir keeps the reason when it holds nothing
    else, so that the sweep's report lists it; a single run's empty dir is removed."""
    if not multirun:
        _remove_if_empty(run_dir)
    elif run_dir.is_dir() and all(p.name == REFUSED for p in run_dir.iterdir()):
        write_json(run_dir / REFUSED, {"status": "refused", "error": str(err),
                                       "overrides": list(HydraConfig.get().overrides.task),
                                       "refused_at": time.strftime("%Y-%m-%dT%H:%M:%S%z")})
    _job_error(err, 2)


# exit codes of this process's jobs that did not finish: a sweep goes on past them, and main()
# exits with the worst at the end (2: refused, 1: failed)
_job_errors: list = []
# set by `posbench train --dry-run`: the jobs' totals, while the jobs only print their estimates
_dry_run: Optional[dict] = None


def _job_error(err: object, code: int) -> None:
    print(f"posbench: error: {err}", file=sys.stderr)
    _job_errors.append(code)


def _dry_run_job(cfg: DictConfig, name: str) -> None:
    """A job of `posbench train --dry-run`: its estimate, and its wall time extrapolated from
    steps timed on this machine under the threads the job would get."""
    import torch

    from posbench.core.device import job_threads, resolve_device, usable_cores
    from posbench.runs.budget import plan
    from posbench.runs.estimate import available_memory, describe, estimate, refusal, wall_time

    est = estimate(cfg, distributed.world_size(), plan(cfg).steps)
    try:
        device = resolve_device(cfg.device)
    except ConfigError:  # a GPU job planned on a machine without one: its estimate still holds
        device = None
    room, source = available_memory(device) if device else (None, "")
    refused = refusal(cfg, est, room, source)
    seconds = None
    if device is None:
        timing = "not measured: no CUDA device is visible on this machine"
    elif refused:
        timing = "not measured: it would be refused"
    else:
        threads = job_threads(usable_cores(), _dry_run["n_jobs"]) or torch.get_num_threads()
        try:
            seconds, timing = wall_time(cfg, est, device, threads, distributed.world_size())
        except (RuntimeError, MemoryError) as err:  # e.g. a GPU that others fill
            timing = f"not measured: {one_line(err)}"
    print(f"  {name}: {describe(est)}" + (f"\n    refused: {refused}" if refused else "")
          + f"\n    time: {timing}", flush=True)
    if room:
        _dry_run["memory"] = room, source
    _dry_run["jobs"] += 1
    _dry_run["tokens"] += est.tokens
    _dry_run["flops"] += est.train_flops + est.eval_flops
    _dry_run["refused"] += bool(refused)
    if seconds is not None:
        _dry_run["seconds"] += seconds
        _dry_run["timed"] += 1


def _finished_run(cfg: DictConfig, run_dir: Path, record: dict) -> None:
    """A finished run asked for again (`record`: its results.json): nothing to do, or the eval
    settings it was not scored with, scored from its checkpoint as `posbench eval` does."""
    from posbench.runs.rescore import change_label, eval_changes, reevaluate

    changes = eval_changes(record["config"], to_container(cfg))
    if not changes:
        print(f"posbench: skipped {run_dir}: it holds this run, finished (results.json, "
              "status ok)")
        return
    print(f"posbench: {run_dir} holds this run, finished; scoring its checkpoint with the new "
          f"eval settings ({change_label(changes)}), as `posbench eval {run_dir}` does")
    if distributed.is_main():
        reevaluate(cfg, run_dir, record)


# the command line as the user typed it (posbench's arguments), which resume_command repeats
_command: List[str] = []


def resume_command(run_dir: Path, multirun: bool) -> str:
    """This command with its run dir named (a sweep's dir, for a job of one): run again as it
    was, it would train in a new timestamped dir from step 0."""
    key, folder = ("hydra.sweep.dir", run_dir.parent) if multirun else ("hydra.run.dir", run_dir)
    value = str(folder) if re.fullmatch(r"[\w./:+-]+", str(folder)) else hydra_quoted(str(folder))
    args = [arg for arg in _command if not arg.startswith(f"{key}=")]
    return shlex.join(["posbench", *args, f"{key}={value}"])


@hydra.main(version_base=None, config_path="pkg://posbench.conf", config_name="config")
def train_app(cfg: DictConfig) -> None:
    """One run: skipped when its run dir holds its results (or re-scored, for new eval settings),
    resumed from its checkpoint, else trained from step 0. Failures are reported, never raised,
    so that a sweep goes on."""
    hc = HydraConfig.get()
    run_job(cfg, Path(hc.runtime.output_dir), hc.mode == RunMode.MULTIRUN)


def fit(cfg: DictConfig):
    """The job's estimate, the memory it may use and where that number comes from, and why its
    training cannot fit there (None when it can)."""
    from posbench.core.device import resolve_device
    from posbench.runs.budget import plan
    from posbench.runs.estimate import available_memory, estimate, refusal

    est = estimate(cfg, distributed.world_size(), plan(cfg).steps)
    room, source = available_memory(resolve_device(cfg.device))
    return est, room, source, refusal(cfg, est, room, source)


def refusing_what_cannot_fit(compose: Callable, argv: list) -> Callable:
    """`compose` for precheck, refusing too, as run_job would, a single run whose training
    cannot fit: Hydra creates its run dir (outputs/<date>/...) before the job starts, and a
    refusal must leave no folder behind. A sweep's jobs are refused one by one (each job dir
    keeps its refused.json for the report), and a run dir that exists already (a finished run
    asked again is skipped or re-scored, never trained) is left to its job."""
    run_dirs = [arg.split("=", 1)[1] for arg in argv if arg.startswith("hydra.run.dir=")]
    if {"-m", "--multirun"} & set(argv) or run_dirs and Path(run_dirs[-1]).exists():
        return compose

    def composed(overrides: list) -> DictConfig:
        cfg = compose(overrides)
        refused = fit(cfg)[3]
        if refused:
            raise ConfigError(refused)
        return cfg

    return composed


def run_job(cfg: DictConfig, run_dir: Path, multirun: bool) -> None:
    """train_app's job, and `posbench extend`'s with the extension's config."""
    from posbench.runs.estimate import describe, eval_warning, gib
    from posbench.runs.loggers import wandb_group
    from posbench.core.device import set_threads
    from posbench.runs.run import RunDir, RunFailed, train

    main_rank = distributed.is_main()
    try:
        check(cfg)
        if _dry_run is not None:
            return _dry_run_job(cfg, run_dir.name if multirun else "run")
        est, room, source, refused = fit(cfg)
        run = RunDir(cfg, run_dir)
        if run.finished:
            return _finished_run(cfg, run_dir, run.finished)
        if refused:
            raise ConfigError(refused)
        if main_rank:
            print(f"posbench: run dir {run_dir}")
            print(f"posbench: estimate: {describe(est)}; "
                  + (f"{gib(room)} available ({source})" if room else f"memory unknown: {source}"))
            for warning in (eval_warning(est, room), config_module.eval_lengths_warning(cfg)):
                if warning:
                    print(f"posbench: warning: {warning}")
        set_threads(parallel_jobs())
        start = run.plan()
    except PosbenchError as err:
        return _refused(run_dir, err, multirun)
    except OSError as err:  # e.g. the data could not be read
        return _job_error(f"run {str(run_dir)!r} could not start: {one_line(err)}", 1)
    if main_rank:
        (run_dir / REFUSED).unlink(missing_ok=True)  # an earlier start's refusal no longer holds
        if start.checkpoint:
            steps = start.budget.steps  # None: trained until train.budget_seconds are spent
            print(f"posbench: resuming from step {start.checkpoint.step}"
                  + (f" of {steps}" if steps else f" after {start.checkpoint.seconds:.1f} s")
                  + f" ({CHECKPOINT})")
    try:
        _save_hydra_files(run_dir, cfg)
    except OSError as err:  # e.g. a full disk
        start.release()
        return _job_error(f"run {str(run_dir)!r} could not start: {one_line(err)}", 1)
    try:
        # wandb: the runs of a sweep share its group; each run is named like its dir
        train(cfg, run_dir, group=wandb_group(run_dir.parent if multirun else run_dir),
              name=run_dir.name, start=start, again=f"`{resume_command(run_dir, multirun)}`")
    except PosbenchError as err:
        _job_error(err, 2)
    except RunFailed as err:
        _job_error(err, 1)
    else:
        if main_rank:
            print(f"posbench: run dir {run_dir} holds its results")


def parallel_jobs() -> int:
    """How many jobs of this command run at once: a sweep's hydra.launcher.n_jobs (joblib), else
    one (the basic launcher runs them in turn; a SLURM job has cores of its own)."""
    hc = HydraConfig.get()
    return hc.launcher.get("n_jobs", 1) if hc.mode == RunMode.MULTIRUN else 1


@hydra.main(version_base=None, config_path=None, config_name=None)
def eval_app(cfg: DictConfig) -> None:
    """One re-score of one run (the run dir is in Hydra's config, EVAL_RUN): refusals are
    reported, never raised, so that the other runs and values go on."""
    from posbench.core.device import set_threads
    from posbench.encodings.base import encoding_class
    from posbench.runs.rescore import reevaluate

    hc = HydraConfig.get()
    run_dir = Path(hc[EVAL_RUN])
    try:
        cls = encoding_class(cfg.encoding)
        remap = cfg.eval.rope_scaling in config_module.ROPE_REMAPS
        if (hc[EVAL_FOLDER] and cfg.eval.rope_scaling != "none"
                and not (cls.rope_remaps if remap else cls.rotary)):
            print(f"posbench: skipped {run_dir}: eval.rope_scaling={cfg.eval.rope_scaling} "
                  f"applies to {'RoPE-rotated' if remap else 'rotary'} encodings, not to "
                  f"encoding={cfg.encoding.name}")
            _skipped.append(run_dir)
            return
        check(cfg)
        set_threads(parallel_jobs())
        record = reevaluate(cfg, run_dir, quiet=hc[EVAL_FOLDER])
        if record is None:
            _skipped.append(run_dir)
        else:
            _rescored.append((run_dir, record))
    except PosbenchError as err:
        _job_error(err, 2)


def list_components() -> None:
    from posbench import data, evaluations
    from posbench.encodings import registry

    conf = Path(posbench.__file__).parent / "conf"
    print("encodings (encoding=NAME):")
    for name, entry in registry().items():
        print(f"  {name:<18} {entry.cls.family:<10} {entry.description}")
    print("datasets (dataset=NAME):")
    for name, entry in data.registry().items():
        print(f"  {name:<18} {entry.description}")
    listed = evaluations.registry().items()
    print("perplexity protocols (eval.protocol=NAME):")
    for name, entry in listed:
        if issubclass(entry.cls, evaluations.Protocol):
            print(f"  {name:<18} {entry.description}")
    print("evaluations beside perplexity (eval.NAME.enabled=true):")
    for name, entry in listed:
        if issubclass(entry.cls, evaluations.Section):
            print(f"  {name:<18} {entry.description}")
    print("models (model=NAME):")
    for path in sorted((conf / "model").glob("*.yaml")):
        print(f"  {path.stem:<18} {_first_comment(path)}")


def _first_comment(path: Path) -> str:
    first = path.read_text().splitlines()[0]
    return first.lstrip("# ") if first.startswith("#") else ""


def _composition_error(err: Exception) -> ConfigError:
    """Hydra's composition errors span many lines; say the same in one."""
    msg = "\n".join(str(e) for e in (err, err.__cause__) if e is not None)
    missing = re.search(r"Could not find '([^']+)/([^']+)'", msg)
    if missing:
        options = re.findall(r"^\t(\S+)$", msg, flags=re.M)
        return ConfigError(f"{missing[1]}={missing[2]!r} is not accepted"
                           f"{did_you_mean(missing[2], options)}; expected one of: "
                           + ", ".join(options))
    unknown = re.search(r"Key '([^']+)' not in '(\w+)'.*?full_key: (\S+)", msg, flags=re.S)
    if unknown:
        schema = config_module.schema_class(unknown[2])
        known = [f.name for f in dataclasses.fields(schema)] if dataclasses.is_dataclass(schema) else []
        return ConfigError(f"{unknown[3]} is not a config key; {unknown[1]!r} is not in "
                           f"{unknown[2]}{did_you_mean(unknown[1], known)} (see `posbench train "
                           "--cfg job` for the keys)")
    absent = re.search(r"Could not override '([^']+)'", msg)  # a key of a saved run's config
    if absent:
        prefix, _, key = absent[1].rpartition(".")
        known = config_module.schema_keys(prefix)
        return ConfigError(f"{absent[1]} is not a config key{did_you_mean(key, known)}"
                           + (f"; expected one of: {', '.join(known)}" if known else ""))
    lines = [line.strip() for line in msg.splitlines() if line.strip()]
    why = next((line for line in lines[1:] if not line.startswith(("full_key", "reference_type",
                                                                     "object_type"))), "")
    return ConfigError(f"{lines[0]}: {why}" if why else lines[0])


def precheck(argv: list, compose: Callable = posbench.compose) -> list:
    """Compose (and, with posbench.compose, check) the config of every value of every swept key
    before Hydra creates any run dir, so a bad command costs seconds and writes nothing. Returns
    the swept keys."""
    from hydra._internal.utils import get_args_parser
    from hydra.core.override_parser.overrides_parser import OverridesParser

    args = get_args_parser().parse_args(argv)
    if args.help or args.hydra_help or args.cfg or args.shell_completion or args.info:
        return []
    fixed, sweeps, swept = [], [], []
    for override in OverridesParser.create().parse_overrides(args.overrides):
        key = override.get_key_element().lstrip("+~")
        if key.startswith("hydra") and key != "hydra.searchpath":  # searchpath finds user configs
            continue
        if override.is_sweep_override():
            values = list(override.sweep_string_iterator())
            sweeps.append([f"{override.get_key_element()}={v}" for v in values])
            swept.append(key)
        else:
            fixed.append(override.input_line)
    variants = [fixed + [values[0] for values in sweeps]]
    for i, values in enumerate(sweeps):
        for value in values[1:]:
            variants.append(fixed + [v[0] for v in sweeps[:i]] + [value]
                            + [v[0] for v in sweeps[i + 1:]])
    for overrides in variants:
        try:
            compose(overrides)
        except ConfigError:
            raise
        except Exception as err:  # noqa: BLE001 - Hydra/OmegaConf composition errors
            raise _composition_error(err) from None
    return swept


def saved_config_dir(run_dir: Path, scratch: str) -> Path:
    """A config dir in `scratch` holding run_dir's saved config as the current schema reads it
    (config.with_defaults), so that overrides of keys added since the run was saved apply."""
    folder = Path(tempfile.mkdtemp(dir=scratch))
    saved = OmegaConf.load(run_dir / ".hydra" / "config.yaml")
    write_text(folder / "config.yaml", OmegaConf.to_yaml(config_module.with_defaults(saved)))
    return folder


def compose_run(run_dir: Path) -> Callable:
    """A compose function for precheck: run_dir's saved config with overrides, as `posbench
    eval` composes it (unchecked: some values apply to some runs only)."""
    from hydra import compose, initialize_config_dir
    from hydra.core.global_hydra import GlobalHydra

    def composed(overrides: list) -> DictConfig:
        GlobalHydra.instance().clear()
        with tempfile.TemporaryDirectory(prefix="posbench-compose-") as scratch:
            config_dir = saved_config_dir(run_dir, scratch)
            with initialize_config_dir(config_dir=str(config_dir), version_base=None):
                return compose(config_name="config", overrides=overrides)

    return composed


def compose_extension(parent: Path, trained: dict) -> Callable:
    """A compose function for precheck: the config of an extension of `parent` (trained with
    config `trained`; posbench/runs/extend.py) from its saved config and the overrides, checked
    as its job checks it, so that a refused extension is refused before Hydra creates its run
    dir."""
    from posbench.runs.extend import extension_config

    composed = compose_run(parent)

    def extension(overrides: list) -> DictConfig:
        given = [override_key(override) for override in overrides]
        cfg = extension_config(composed(overrides), parent, trained, given)
        check(cfg)
        return cfg

    return extension


def hydra_argv(args: list, added: list) -> list:
    """`args` with the overrides `added` beside its own: Hydra's parser takes overrides as one
    run of arguments, which flags (-m, --cfg job) may precede or follow."""
    at = next((i for i, arg in enumerate(args) if "=" in arg and not arg.startswith("-")),
              len(args))
    return args[:at] + added + args[at:]


def hydra_quoted(text: str) -> str:
    """`text` as a quoted Hydra override value that reads back as exactly `text`: no character
    (`=`, `,`, `[`, a space, a quote) is taken for syntax."""
    text = re.sub(r"(\\*)('|\Z)", lambda m: m[1] * 2 + ("\\'" if m[2] else ""), text)
    return f"'{text}'"


def run_dir_arg(verb: str, rest: list, usage: str) -> Path:
    """The finished run dir that `eval` and `inspect` take first: absolute, relative or `.`. An
    existing folder is taken whatever its name holds (older sweeps named job dirs
    `0_encoding=rope,train.steps=100`)."""
    if not rest or not Path(rest[0]).is_dir() and (rest[0].startswith("-") or "=" in rest[0]):
        raise ConfigError(f"posbench {verb} needs RUN_DIR first; expected `{usage}`")
    run_dir = Path(rest[0]).resolve()
    if not is_run_dir(run_dir):
        raise ConfigError(f"RUN_DIR={rest[0]!r} is not accepted; expected a finished "
                          "run dir with .hydra/config.yaml and checkpoint.pt")
    return run_dir


def is_run_dir(path: Path) -> bool:
    return (path / ".hydra" / "config.yaml").is_file() and (path / CHECKPOINT).is_file()


def eval_targets(rest: list) -> Tuple[List[Path], List[str]]:
    """The run dirs `posbench eval` scores: the run dir given, or every finished run below a
    folder; and a line for each run below it that did not finish."""
    usage = "posbench eval RUN_DIR|DIR [overrides]"
    if rest and Path(rest[0]).is_dir() and not is_run_dir(Path(rest[0])):
        folder, runs, unfinished = Path(rest[0]).resolve(), [], []
        for path in sorted(folder.rglob(RESULTS)):
            try:
                status = load_results(path).get("status")
            except (OSError, ValueError):
                status = "unreadable"
            if status == "ok" and is_run_dir(path.parent):
                runs.append(path.parent)
            else:
                unfinished.append(f"posbench: skipped {path.parent}: not a finished run "
                                  f"(status {status})")
        if not runs:
            raise ConfigError(f"RUN_DIR={rest[0]!r} is not accepted: it holds no finished run; "
                              f"expected a run dir, or a folder of runs (`{usage}`)")
    else:
        runs, unfinished = [run_dir_arg("eval", rest, usage)], []
    for run_dir in runs:
        if "${" in str(run_dir):  # Hydra resolves its config path and run dir
            raise ConfigError(f"RUN_DIR={str(run_dir)!r} is not accepted by posbench eval; "
                              "expected a path without '${' (Hydra reads it as an "
                              "interpolation)")
    return runs, unfinished


def eval_overrides(args: list, verb: str = "eval", keys: Tuple[str, ...] = ("eval.",)) -> list:
    """eval's arguments (and extend's, with keys train. and eval.), refused unless they set
    those keys, device or logger keys; `logger=NAME` becomes the keys of its option (a run's
    saved config has no config groups to choose from)."""
    options = Path(posbench.__file__).parent / "conf" / "logger"
    out = []
    for arg in args:
        key, eq, value = arg.partition("=")
        key = key.lstrip("+~")
        if (arg.startswith("-") or not eq or key.startswith((*keys, "logger.", "hydra"))
                or key == "device"):
            out.append(arg)
        elif key == "logger":
            names = sorted(path.stem for path in options.glob("*.yaml"))
            if value not in names:
                raise ConfigError(f"logger={value!r} is not accepted; expected one of: "
                                  + ", ".join(names))
            out += [f"logger.{k}={v}" for k, v in
                    yaml.safe_load((options / f"{value}.yaml").read_text()).items()]
        else:
            raise ConfigError(f"{arg} is not accepted by posbench {verb}; expected "
                              + ", ".join(f"{k}*" for k in keys) + ", device= or logger keys "
                              "(the model is the trained one: `posbench train` trains another)")
    return out


def evaluate_runs(rest: list) -> None:
    """`posbench eval DIR [overrides]`: eval_app once per run, each a Hydra app over its own
    saved config, so that -m sweeps eval keys. Hydra's output dirs go to a scratch folder: a
    re-score writes only its results files into the run dir."""
    overrides = eval_overrides(rest[1:])
    runs, unfinished = eval_targets(rest)
    precheck(overrides, compose_run(runs[0]))
    folder = len(runs) > 1 or runs[0] != Path(rest[0]).resolve()
    added = ["hydra.output_subdir=null", "hydra/job_logging=stdout", "hydra.job.name=eval",
             f"+hydra.{EVAL_FOLDER}={str(folder).lower()}"]
    if folder and not any(arg.startswith("hydra/hydra_logging=") for arg in overrides):
        added.append("hydra/hydra_logging=disabled")  # its launch lines repeat ours, per run
    _job_errors.clear()
    _rescored.clear()
    _skipped.clear()
    with tempfile.TemporaryDirectory(prefix="posbench-eval-") as scratch:
        for run_dir in runs:
            sys.argv = ["posbench eval", f"--config-path={saved_config_dir(run_dir, scratch)}",
                        "--config-name=config", *hydra_argv(overrides, [
                            f"hydra.run.dir={hydra_quoted(scratch)}",
                            f"hydra.sweep.dir={hydra_quoted(scratch)}", *added,
                            f"+hydra.{EVAL_RUN}={hydra_quoted(str(run_dir))}"])]
            eval_app()
    for line in unfinished:
        print(line)
    if folder:
        from posbench.runs.rescore import summary_lines

        print("\n".join(summary_lines(_rescored, len(_skipped), len(_job_errors),
                                      Path(rest[0]).resolve())))
        print(f"posbench: compare them with `posbench report {rest[0]}`")
    if _job_errors:
        sys.exit(max(_job_errors))


# the key that `posbench extend` adds to Hydra's config: the run dir it extends
EXTEND_PARENT = "posbench_extend_parent"


@hydra.main(version_base=None, config_path=None, config_name=None)
def extend_app(cfg: DictConfig) -> None:
    """One extension of the run in Hydra's config (EXTEND_PARENT), a run of its own whose config
    posbench/runs/extend.py makes from the parent's and the overrides; refusals are reported, never
    raised, so that a sweep goes on."""
    from posbench.runs.extend import extension_config
    from posbench.runs.run import finished_results

    hc = HydraConfig.get()
    run_dir, multirun = Path(hc.runtime.output_dir).resolve(), hc.mode == RunMode.MULTIRUN
    parent = Path(hc[EXTEND_PARENT])
    given = [override_key(override) for override in hc.overrides.task]
    try:
        if run_dir == parent:
            raise ConfigError(f"hydra.run.dir={str(run_dir)!r} is not accepted: it is the run "
                              "being extended; expected a run dir of the extension's own")
        cfg = extension_config(cfg, parent, finished_results(parent)["config"], given)
    except PosbenchError as err:
        return _refused(run_dir, err, multirun)
    run_job(cfg, run_dir, multirun)


def extend_runs(rest: list) -> None:
    """`posbench extend RUN_DIR [overrides]`: extend_app over the run's saved config, so that -m
    sweeps methods, lengths and factors; each extension lands in a run dir of its own
    (outputs/<date>/<time>_<encoding>_extend, or a sweep's job dir), never the parent's."""
    from posbench.runs.run import finished_results

    parent = run_dir_arg("extend", rest, "posbench extend RUN_DIR [overrides]")
    record = finished_results(parent)
    encoding = record["encoding"]
    overrides = eval_overrides(rest[1:], "extend", ("train.", "eval."))
    swept = precheck(overrides, refusing_what_cannot_fit(
        compose_extension(parent, record["config"]), overrides))
    given = {override_key(arg) for arg in overrides}
    defaults = {"hydra.run.dir": f"outputs/${{now:%Y-%m-%d}}/${{now:%H-%M-%S}}_{encoding}_extend",
                "hydra.sweep.dir": "outputs/multirun/${now:%Y-%m-%d}/${now:%H-%M-%S}",
                "hydra.sweep.subdir": "${posbench.job_dir:}"}
    added = [f"{key}={value}" for key, value in defaults.items() if key not in given]
    added += ["hydra.output_subdir=null", "hydra/job_logging=stdout", "hydra.job.name=extend",
              "+hydra.callbacks.sweep_report._target_=posbench.reports.report.SweepReport",
              f"+hydra.{EXTEND_PARENT}={hydra_quoted(str(parent))}"]
    if swept:  # the keys it sweeps, which name the job dirs (posbench/core/resolvers.py)
        added.append(f"+hydra.{SWEPT}=[{','.join(map(hydra_quoted, swept))}]")
    _job_errors.clear()
    with tempfile.TemporaryDirectory(prefix="posbench-extend-") as scratch:
        sys.argv = ["posbench extend", f"--config-path={saved_config_dir(parent, scratch)}",
                    "--config-name=config", *hydra_argv(overrides, added)]
        extend_app()
    if _job_errors:
        sys.exit(max(_job_errors))


def launcher_jobs(args: list) -> int:
    """The jobs a command's launcher runs at once: joblib's hydra.launcher.n_jobs (its default
    -1: one per core; see job_threads), else one."""
    if "hydra/launcher=joblib" not in args:
        return 1
    given = [arg.split("=", 1)[1] for arg in args if arg.startswith("hydra.launcher.n_jobs=")]
    return int(given[-1]) if given and given[-1].lstrip("-").isdigit() else -1


def dry_run(rest: list, named: list) -> None:
    """`posbench train [-m] ... --dry-run`: Hydra composes every job as it would run it, and each
    prints its estimate and its time; Hydra's dirs go to a scratch folder, and an in-process
    launcher replaces any other (a cluster launcher would submit the jobs)."""
    from posbench.core.device import usable_cores
    from posbench.runs.estimate import count, gib, span

    global _dry_run
    # the user's run and sweep dirs too: Hydra would create them (and write multirun.yaml there)
    kept = [arg for arg in rest if not arg.startswith(("hydra/launcher=", "hydra.launcher.",
                                                       "hydra.run.dir=", "hydra.sweep.dir="))]
    print("posbench train --dry-run: each job and its estimate (docs/design.md, Estimates); "
          "nothing is trained or written, a job's time extrapolates a few steps timed here")
    n_jobs = launcher_jobs(rest) if {"-m", "--multirun"} & set(rest) else 1
    _dry_run = {"jobs": 0, "tokens": 0, "flops": 0.0, "refused": 0, "memory": (None, ""),
                "n_jobs": n_jobs, "seconds": 0.0, "timed": 0}
    # the launch composes every job as it reaches it, so Hydra's composing of the whole batch
    # beforehand is the same work twice (a third of a 90-job dry run's time)
    validate = Sweeper.validate_batch_is_legal
    Sweeper.validate_batch_is_legal = lambda self, batch: None
    try:
        with tempfile.TemporaryDirectory(prefix="posbench-dry-run-") as scratch:
            sys.argv = ["posbench", *hydra_argv(kept, [
                f"hydra.run.dir={hydra_quoted(scratch)}", f"hydra.sweep.dir={hydra_quoted(scratch)}",
                "hydra/launcher=basic", *named])]
            train_app()
        totals = _dry_run
    finally:
        _dry_run = None
        Sweeper.validate_batch_is_legal = validate
    room, source = totals["memory"]
    timed = totals["timed"]
    # parallel jobs share the cores, and each was timed on its share of them
    at_once = min(timed, n_jobs if n_jobs > 0 else max(1, usable_cores() + 1 + n_jobs))
    jobs = totals["jobs"]
    print(f"{jobs} job{'s' * (jobs != 1)}: {count(totals['tokens'])} training tokens, "
          f"{totals['flops']:.2g} FLOPs".replace("e+", "e")
          + (f", about {span(totals['seconds'] / at_once)} on this machine ({timed} "
             f"job{'s' * (timed > 1)} timed" + (f", {at_once} at a time" if at_once > 1 else "")
             + ")" if timed else "")
          + (f"; {totals['refused']} would be refused" if totals["refused"] else "")
          + (f"; memory available: {gib(room)} ({source})" if room else ""))


@contextmanager
def honour_ctrl_c(grace: float = 10.0):
    """Ctrl-C reaches Python only between bytecodes, so one long torch operation (a step at a
    huge length) can hold it off for minutes. The C-level handler also writes the signal to a
    wakeup fd, which a thread watches: when the process still runs `grace` seconds after a
    Ctrl-C, or at a second one, it says so in one line and exits with status 130. Checkpoints and
    results are written atomically, so the files on disk stay whole. SIGTERM (kill, docker stop,
    SLURM preemption) stops the process as Ctrl-C does: a started run records that it was
    interrupted and releases its lock, where Python's default would end it on the spot."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    read, write = os.pipe()
    os.set_blocking(write, False)
    previous = signal.set_wakeup_fd(write, warn_on_full_buffer=False)

    def terminated(signum, frame):
        raise KeyboardInterrupt("SIGTERM")

    previous_term = signal.signal(signal.SIGTERM, terminated)

    def watch() -> None:
        deadline = None
        while True:
            wait = None if deadline is None else max(0.0, deadline - time.monotonic())
            if not select.select([read], [], [], wait)[0]:
                break  # the grace period passed
            received = os.read(read, 64)
            if 0 in received:  # the block below ended
                return
            if signal.SIGINT in received or signal.SIGTERM in received:
                if deadline is not None:
                    break
                deadline = time.monotonic() + grace
        print("posbench: interrupted: a long operation held off Ctrl-C, stopping now (files on "
              "disk are whole: each is written atomically)", file=sys.stderr, flush=True)
        os._exit(130)

    watcher = threading.Thread(target=watch, name="posbench-ctrl-c", daemon=True)
    watcher.start()
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous_term)
        signal.set_wakeup_fd(previous)
        os.write(write, b"\0")
        watcher.join()
        os.close(read)
        os.close(write)


def lengths_option(args: list):
    """`--lengths 128,512` or `--lengths=128,512` -> [128, 512]; None when absent."""
    if not args:
        return None
    text = ""
    if len(args) == 2 and args[0] == "--lengths":
        text = args[1]
    elif len(args) == 1 and args[0].startswith("--lengths="):
        text = args[0].removeprefix("--lengths=")
    if not re.fullmatch(r"[1-9]\d*(,[1-9]\d*)*", text):
        raise ConfigError(f"{' '.join(args)!r} is not accepted; expected --lengths L1,L2 of "
                          "positive integers")
    return [int(n) for n in text.split(",")]


LONGROPE_USAGE = "posbench longrope RUN_DIR --length N [--seed S] [--scale X]"


def longrope_args(rest: list) -> Tuple[Path, int, int, float]:
    """`RUN_DIR --length N [--seed S] [--scale X]` (or --key=value) -> (RUN_DIR, N, S, X); S is
    0 and X the CPU's scale (posbench/runs/longrope_search.py) unless given."""
    from posbench.runs.longrope_search import CPU_SCALE

    run_dir = run_dir_arg("longrope", rest, LONGROPE_USAGE)
    args = [part for arg in rest[1:] for part in arg.split("=", 1)]
    given = dict(zip(args[::2], args[1::2]))
    numbers = {"--length": r"[1-9]\d*", "--seed": r"\d+", "--scale": r"\d+(\.\d*)?|\.\d+"}
    if (len(args) % 2 or len(given) != len(args) // 2 or "--length" not in given
            or any(k not in numbers or not re.fullmatch(numbers[k], v) for k, v in given.items())):
        raise ConfigError(f"{shlex.join(rest[1:])!r} is not accepted; expected `{LONGROPE_USAGE}` "
                          "with a positive integer N, an integer S >= 0 and a number X")
    return (run_dir, int(given["--length"]), int(given.get("--seed", 0)),
            float(given.get("--scale", CPU_SCALE)))


def report_args(rest: list) -> Tuple[Path, Optional[str]]:
    """`DIR [--protocol NAME]` (or --protocol=NAME) -> (DIR, NAME or None)."""
    args = list(rest)
    if len(args) == 2 and args[1].startswith("--protocol="):
        args[1:] = ["--protocol", args[1].removeprefix("--protocol=")]
    if len(args) == 1 or len(args) == 3 and args[1] == "--protocol" and args[2]:
        return Path(args[0]), args[2] if len(args) == 3 else None
    raise ConfigError("posbench report needs one folder" + (f", not {shlex.join(rest)!r}"
                                                             if rest else "")
                      + "; expected `posbench report DIR [--protocol NAME]`")


def verb_usage(verb: str) -> str:
    """`verb`'s entry of USAGE, its continuation lines with it."""
    entries = re.split(r"\n(?=  \S)", USAGE.split("\n\n", 1)[1])
    return "usage: posbench " + next(e for e in entries if e.startswith(f"  {verb} "))[2:]


def main() -> None:
    argv = sys.argv[1:]
    _command[:] = argv
    if not argv or argv[0] in ("-h", "--help", "help"):
        print(USAGE)
        sys.exit(0 if argv else 2)
    if argv[0] == "--version":
        print(f"posbench {posbench.__version__}")
        return
    verb, rest = argv[0], argv[1:]
    if verb in ("report", "inspect", "extend", "longrope") and rest and rest[0] in ("-h",
                                                                                    "--help"):
        # these verbs take a path first: their usage, not a run dir called --help
        print(verb_usage(verb))
        return
    if verb in ("-sc", "--shell-completion"):  # Hydra's completion script calls `posbench -sc`
        words = os.environ.get("COMP_LINE", "").split(" ")
        if words[1:2] == ["train"]:  # Hydra completes the overrides that follow the app name
            os.environ["COMP_LINE"] = " ".join(words[:1] + words[2:])
        verb, rest = "train", argv
    try:
        with honour_ctrl_c():
            run_verb(verb, rest)
    except PosbenchError as err:
        fail(err)
    except KeyboardInterrupt as err:  # Ctrl-C: one line (a started run says what it kept)
        print(f"posbench: interrupted{': ' + str(err) if str(err) else ''}", file=sys.stderr)
        sys.exit(130)


def run_verb(verb: str, rest: list) -> None:
    if verb == "train":
        dry = "--dry-run" in rest
        rest = [arg for arg in rest if arg != "--dry-run"]
        # a dry run lists the jobs that would be refused rather than refusing them
        swept = precheck(rest, posbench.compose if dry else
                         refusing_what_cannot_fit(posbench.compose, rest))
        # the keys it sweeps, which name the job dirs (posbench/core/resolvers.py)
        named = [f"+hydra.{SWEPT}=[{','.join(map(hydra_quoted, swept))}]"] if swept else []
        _job_errors.clear()
        if dry:
            dry_run(rest, named)
        else:
            sys.argv = ["posbench", *hydra_argv(rest, named)]
            train_app()
        if _job_errors:
            sys.exit(max(_job_errors))
    elif verb == "eval":
        if "--help" in rest or "-h" in rest:  # posbench's eval help needs no RUN_DIR
            sys.argv = ["posbench eval", "--config-path=pkg://posbench.conf",
                        "--config-name=config", "--help", "hydra/help=eval"]
            eval_app()
            return
        evaluate_runs(rest)
    elif verb == "extend":
        extend_runs(rest)
    elif verb == "longrope":
        from posbench.runs.longrope_search import run_search

        run_search(*longrope_args(rest))
    elif verb == "inspect":
        run_dir = run_dir_arg(verb, rest, "posbench inspect RUN_DIR [--lengths L1,L2]")
        from posbench.reports.inspect import inspect_run

        inspect_run(run_dir, lengths_option(rest[1:]))
    elif verb == "report":
        from posbench.reports.report import write_report

        write_report(*report_args(rest))
    elif verb == "reproduce":
        from posbench.reproduce.command import reproduce

        reproduce(rest)
    elif verb == "list":
        list_components()
    else:
        raise ConfigError(f"verb {verb!r} is not accepted; expected one of train, eval, "
                          "extend, longrope, inspect, report, reproduce, list")
