"""`posbench <verb>`: a thin dispatcher. `train` and `eval` are real Hydra apps (overrides, -m,
--cfg job, --help, hydra.run.dir); `report` and `list` are plain commands."""
from __future__ import annotations

import shutil
import sys
from pathlib import Path

import hydra
from hydra.core.hydra_config import HydraConfig
from hydra.types import RunMode
from omegaconf import DictConfig, OmegaConf

import posbench
from posbench.config import ConfigError, check
from posbench.io import write_text

USAGE = """usage: posbench <verb> [args]

  train [overrides]          train short, evaluate long; a Hydra app: -m for sweeps, --cfg job,
                             --help, hydra.run.dir=...   e.g. posbench train encoding=alibi
  eval RUN_DIR [overrides]   re-evaluate a run's checkpoint without retraining, e.g.
                             posbench eval RUN_DIR eval.rope_scaling=yarn eval.lengths=[512,4096]
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


@hydra.main(version_base=None, config_path="pkg://posbench.conf", config_name="config")
def train_app(cfg: DictConfig) -> None:
    from posbench.train import train

    hc = HydraConfig.get()
    run_dir = Path(hc.runtime.output_dir)
    try:
        check(cfg)
        if (run_dir / "results.json").exists():
            raise ConfigError(f"hydra.run.dir={str(run_dir)!r} already holds results.json; "
                              "expected a new run dir (nothing was overwritten)")
        _save_hydra_files(run_dir, cfg)
        if hc.mode == RunMode.MULTIRUN:
            group, name = Path(hc.sweep.dir).name, hc.job.override_dirname or cfg.encoding.name
        else:
            group, name = run_dir.name, run_dir.name
        train(cfg, run_dir, group=group, name=name)
    except ConfigError as err:
        _remove_if_empty(run_dir)
        fail(err)


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


def main() -> None:
    argv = sys.argv[1:]
    if not argv or argv[0] in ("-h", "--help", "help"):
        print(USAGE)
        sys.exit(0 if argv else 2)
    verb, rest = argv[0], argv[1:]
    try:
        if verb == "train":
            sys.argv = ["posbench train", *rest]
            train_app()
        elif verb == "eval":
            if not rest or rest[0].startswith("-") or "=" in rest[0]:
                raise ConfigError("posbench eval needs RUN_DIR first; expected "
                                  "`posbench eval RUN_DIR [overrides]`")
            run_dir = Path(rest[0]).resolve()
            if not (run_dir / ".hydra" / "config.yaml").is_file() or not (
                    run_dir / "checkpoint.pt").is_file():
                raise ConfigError(f"RUN_DIR={rest[0]!r} is not accepted; expected a finished "
                                  "run dir with .hydra/config.yaml and checkpoint.pt")
            sys.argv = ["posbench eval", f"--config-path={run_dir / '.hydra'}",
                        "--config-name=config", f"hydra.run.dir={run_dir}",
                        "hydra.output_subdir=null", "hydra/job_logging=stdout",
                        "hydra.job.name=eval", *rest[1:]]
            eval_app()
        elif verb == "report":
            if len(rest) != 1:
                raise ConfigError("posbench report needs one folder; expected `posbench report DIR`")
            from posbench.report import write_report

            write_report(Path(rest[0]))
        elif verb == "list":
            list_components()
        else:
            raise ConfigError(f"verb {verb!r} is not accepted; expected one of train, eval, "
                              "report, list")
    except ConfigError as err:
        fail(err)
