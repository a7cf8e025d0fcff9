"""`posbench <verb>`: a thin dispatcher. `train` and `eval` are real Hydra apps (overrides, -m,
--cfg job, --help, hydra.run.dir); `report` and `list` are plain commands."""
from __future__ import annotations

import os
import re
import sys
from pathlib import Path

import hydra
from hydra.core.hydra_config import HydraConfig
from hydra.types import RunMode
from omegaconf import DictConfig, OmegaConf

import posbench
from posbench.config import ConfigError, check
from posbench.io import write_text
from posbench.resolvers import SWEPT

USAGE = """usage: posbench <verb> [args]

  train [overrides]          train short, evaluate long; a Hydra app: -m for sweeps, --cfg job,
                             --help, hydra.run.dir=...   e.g. posbench train encoding=alibi
  eval RUN_DIR [overrides]   re-evaluate a run's checkpoint without retraining, e.g.
                             posbench eval RUN_DIR eval.rope_scaling=yarn eval.lengths=[512,4096]
  inspect RUN_DIR [--lengths L1,L2]
                             plots that explain a run (learned positions' PCA, attention mass by
                             lag per head) into RUN_DIR; lengths default to train length and 4x
  report DIR                 table + ppl_vs_length.png over every run below DIR
  list                       encodings, datasets and model presets, one line each
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
    if run_dir.is_dir() and not any(run_dir.iterdir()):
        run_dir.rmdir()


# exit codes of this process's jobs that did not finish: a sweep goes on past them, and main()
# exits with the worst at the end (2: refused, 1: failed)
_job_errors: list = []


def _job_error(err: object, code: int) -> None:
    print(f"posbench: error: {err}", file=sys.stderr)
    _job_errors.append(code)


@hydra.main(version_base=None, config_path="pkg://posbench.conf", config_name="config")
def train_app(cfg: DictConfig) -> None:
    """One run: skipped when its run dir holds its results, resumed from its checkpoint, else
    trained from step 0. Failures are reported, never raised, so that a sweep goes on."""
    from posbench.train import RunFailed, finished, one_line, plan_run, train

    hc = HydraConfig.get()
    run_dir = Path(hc.runtime.output_dir)
    try:
        check(cfg)
        if finished(cfg, run_dir):
            print(f"posbench: skipped {run_dir}: it already holds results.json (status ok) of "
                  "this config")
            return
        start = plan_run(cfg, run_dir)
    except ConfigError as err:
        _remove_if_empty(run_dir)
        return _job_error(err, 2)
    except OSError as err:  # e.g. the data could not be read
        return _job_error(f"run {str(run_dir)!r} could not start: {one_line(err)}", 1)
    # wandb: the runs of a sweep share its group; each run is named like its dir
    group = Path(hc.sweep.dir).name if hc.mode == RunMode.MULTIRUN else run_dir.name
    try:
        _save_hydra_files(run_dir, cfg)
        train(cfg, run_dir, group=group, name=run_dir.name, start=start)
    except ConfigError as err:
        _job_error(err, 2)
    except RunFailed as err:
        _job_error(err, 1)
    except OSError as err:  # .hydra/ could not be written, e.g. a full disk
        _job_error(f"run {str(run_dir)!r} could not start: {one_line(err)}", 1)


@hydra.main(version_base=None, config_path=None, config_name=None)
def eval_app(cfg: DictConfig) -> None:
    from posbench.reeval import reevaluate

    try:
        check(cfg)
        reevaluate(cfg, Path(HydraConfig.get().runtime.output_dir),
                   list(HydraConfig.get().overrides.task))
    except ConfigError as err:
        fail(err)


def list_components() -> None:
    from posbench.data.corpora import CORPORA
    from posbench.encodings import registry

    conf = Path(posbench.__file__).parent / "conf"
    print("encodings (encoding=NAME):")
    for name, entry in registry().items():
        print(f"  {name:<18} {entry.cls.family:<10} {entry.description}")
    print("datasets (dataset=NAME):")
    for path in sorted((conf / "dataset").glob("*.yaml")):
        print(f"  {path.stem:<18} {_first_comment(path)}")
    assert set(CORPORA) >= {p.stem for p in (conf / "dataset").glob("*.yaml")}
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
        return ConfigError(f"{missing[1]}={missing[2]!r} is not accepted; expected one of: "
                           + ", ".join(options))
    unknown = re.search(r"Key '([^']+)' not in '(\w+)'.*?full_key: (\S+)", msg, flags=re.S)
    if unknown:
        return ConfigError(f"{unknown[3]} is not a config key; {unknown[1]!r} is not in "
                           f"{unknown[2]} (see `posbench train --cfg job` for the keys)")
    lines = [line.strip() for line in msg.splitlines() if line.strip()]
    why = next((line for line in lines[1:] if not line.startswith(("full_key", "reference_type",
                                                                     "object_type"))), "")
    return ConfigError(f"{lines[0]}: {why}" if why else lines[0])


def precheck(argv: list) -> list:
    """Compose and check the config of every value of every swept key before Hydra creates any
    run dir, so a bad command costs seconds and writes nothing. Returns the swept keys."""
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
            posbench.compose(overrides)
        except ConfigError:
            raise
        except Exception as err:  # noqa: BLE001 - Hydra/OmegaConf composition errors
            raise _composition_error(err) from None
    return swept


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
    if not (run_dir / ".hydra" / "config.yaml").is_file() or not (
            run_dir / "checkpoint.pt").is_file():
        raise ConfigError(f"RUN_DIR={rest[0]!r} is not accepted; expected a finished "
                          "run dir with .hydra/config.yaml and checkpoint.pt")
    return run_dir


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


def main() -> None:
    argv = sys.argv[1:]
    if not argv or argv[0] in ("-h", "--help", "help"):
        print(USAGE)
        sys.exit(0 if argv else 2)
    verb, rest = argv[0], argv[1:]
    if verb in ("-sc", "--shell-completion"):  # Hydra's completion script calls `posbench -sc`
        words = os.environ.get("COMP_LINE", "").split(" ")
        if words[1:2] == ["train"]:  # Hydra completes the overrides that follow the app name
            os.environ["COMP_LINE"] = " ".join(words[:1] + words[2:])
        verb, rest = "train", argv
    try:
        if verb == "train":
            swept = precheck(rest)
            # the keys it sweeps, which name the job dirs (posbench/resolvers.py)
            named = [f"+hydra.{SWEPT}=[{','.join(map(hydra_quoted, swept))}]"] if swept else []
            sys.argv = ["posbench", *rest, *named]
            _job_errors.clear()
            train_app()
            if _job_errors:
                sys.exit(max(_job_errors))
        elif verb == "eval":
            if "--help" in rest or "-h" in rest:  # posbench's eval help needs no RUN_DIR
                sys.argv = ["posbench eval", "--config-path=pkg://posbench.conf",
                            "--config-name=config", "--help", "hydra/help=eval"]
                eval_app()
                return
            run_dir = run_dir_arg(verb, rest, "posbench eval RUN_DIR [overrides]")
            if "${" in str(run_dir):  # Hydra resolves its output dir, which is this one
                raise ConfigError(f"RUN_DIR={rest[0]!r} is not accepted by posbench eval; "
                                  "expected a path without '${' (Hydra reads it as an "
                                  "interpolation)")
            sys.argv = ["posbench eval", f"--config-path={run_dir / '.hydra'}",
                        "--config-name=config", f"hydra.run.dir={hydra_quoted(str(run_dir))}",
                        "hydra.output_subdir=null", "hydra/job_logging=stdout",
                        "hydra.job.name=eval", *rest[1:]]
            eval_app()
        elif verb == "inspect":
            run_dir = run_dir_arg(verb, rest, "posbench inspect RUN_DIR [--lengths L1,L2]")
            from posbench.inspect import inspect_run

            inspect_run(run_dir, lengths_option(rest[1:]))
        elif verb == "report":
            if len(rest) != 1:
                raise ConfigError("posbench report needs one folder; expected `posbench report DIR`")
            from posbench.report import write_report

            write_report(Path(rest[0]))
        elif verb == "list":
            list_components()
        else:
            raise ConfigError(f"verb {verb!r} is not accepted; expected one of train, eval, "
                              "inspect, report, list")
    except ConfigError as err:
        fail(err)
    except KeyboardInterrupt as err:  # Ctrl-C: one line (a started run says what it kept)
        print(f"posbench: interrupted{': ' + str(err) if str(err) else ''}", file=sys.stderr)
        sys.exit(130)
