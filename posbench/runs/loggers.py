"""Experiment loggers: `logger=none` needs nothing; `logger=wandb` works offline with no login."""
from __future__ import annotations

import os
import secrets
from pathlib import Path
from typing import Dict, List, Optional

import yaml

from posbench.core.io import write_text

WANDB_ID = "wandb_run_id"  # in the run dir


def wandb_mode(logger_cfg) -> str:
    """logger.mode, except that online without WANDB_API_KEY runs offline (no key, no network
    needed: `wandb sync` uploads later), and says so."""
    if logger_cfg.mode == "online" and not os.environ.get("WANDB_API_KEY"):
        print("posbench: logger.mode=online without WANDB_API_KEY: logging offline; upload "
              "later with `wandb sync`")
        return "offline"
    return logger_cfg.mode


def wandb_group(folder: Path) -> str:
    """The wandb group of the runs in `folder` (a sweep dir, or a single run's own dir): its last
    two path parts, `<date>/<time>` in posbench's layout, so that groups of different days differ."""
    folder = Path(folder).resolve()
    return f"{folder.parent.name}/{folder.name}"


def run_group(run_dir: Path) -> str:
    """The wandb group `posbench train` gave the run in run_dir: its sweep's, or its own."""
    run_dir = Path(run_dir)
    hydra = yaml.safe_load((run_dir / ".hydra" / "hydra.yaml").read_text())["hydra"]
    return wandb_group(run_dir.parent if hydra["mode"] == "MULTIRUN" else run_dir)


class NoLogger:
    def log(self, metrics: dict, step: int) -> None:
        pass

    def log_curve(self, curve: List[dict], step: int,
                  per_length: Optional[Dict[int, dict]] = None) -> None:
        pass

    def finish(self, summary: dict) -> None:
        pass


class WandbLogger:
    """One wandb run per job, and one per re-score (job_type eval). Train metrics use
    `train/step` and eval metrics `eval/length` as their x-axis, so the curves of every run of a
    sweep overlay in one chart. Every row is logged at an explicit step (a training row at its
    training step, the eval rows after the last one), so that a run resumed offline continues
    its step count and its two offline-run folders sync as one run."""

    def __init__(self, logger_cfg, run_dir: Path, name: str, group: str, config: dict,
                 resuming: bool, job_type: str):
        try:
            import wandb
        except ImportError:
            from posbench.core.errors import ConfigError

            raise ConfigError("logger=wandb is not available: the wandb package is not "
                              "installed; expected `pip install 'posbench[wandb]'` or logger=none")
        mode = wandb_mode(logger_cfg)
        self.wandb = wandb
        # a resumed training run continues its wandb run: the id is kept in the run dir; a
        # re-score is a wandb run of its own
        id_file = run_dir / WANDB_ID
        run_id = (id_file.read_text().strip() if resuming and id_file.exists()
                  else secrets.token_hex(4))
        if job_type == "train":
            write_text(id_file, run_id)
        self.run = wandb.init(project=logger_cfg.project, entity=logger_cfg.entity, name=name,
                              group=group, dir=str(run_dir), config=config, mode=mode,
                              id=run_id, resume="allow", reinit="create_new", job_type=job_type)
        self.run.define_metric("train/step")
        self.run.define_metric("train/*", step_metric="train/step")
        self.run.define_metric("eval/length")
        self.run.define_metric("eval/*", step_metric="eval/length")

    def log(self, metrics: dict, step: int) -> None:
        self.run.log(metrics, step=step)

    def log_curve(self, curve: List[dict], step: int,
                  per_length: Optional[Dict[int, dict]] = None) -> None:
        """One row per evaluated length from `step` on (with the sections' scalars of that
        length, `per_length`), then the curve as a table."""
        points = [point for point in curve if "loss" in point]
        for i, point in enumerate(points):
            self.run.log({"eval/length": point["length"], "eval/loss": point["loss"],
                          "eval/ppl": point["ppl"], **(per_length or {}).get(point["length"], {})},
                         step=step + i)
        columns = ["length", "loss", "ppl"]
        self.run.log({"eval/curve": self.wandb.Table(
            columns=columns, data=[[p.get(c) for c in columns] for p in curve])},
            step=step + len(points))

    def finish(self, summary: dict) -> None:
        self.run.summary.update(summary)
        self.run.finish()


def make_logger(cfg, run_dir: Path, name: str, group: str, config: dict, resuming: bool,
                job_type: str = "train"):
    if cfg.logger.name == "wandb":
        return WandbLogger(cfg.logger, run_dir, name, group, config, resuming, job_type)
    return NoLogger()


def log_sweep_report(logger_cfg, sweep_dir: Path, parity: dict) -> None:
    """One more wandb run in the sweep's group, `report`: every group's perplexity at the
    training length, its gap to the best and whether it is under-trained, as a table, in the
    summary (`parity/<label>/gap`, ...) and with every figure the report drew (the sweep
    folder's own .png files, by their names: ppl_vs_length, retrieval_grid, by_size, ...)."""
    import wandb

    mode = wandb_mode(logger_cfg)
    run = wandb.init(project=logger_cfg.project, entity=logger_cfg.entity, name="report",
                     group=wandb_group(sweep_dir), dir=str(sweep_dir), mode=mode,
                     reinit="create_new", job_type="report")
    columns = ["label", "train_length", "train_length_ppl", "gap", "gap_ci95", "under_trained",
               "extrapolation_ratio"]
    run.log({"parity": wandb.Table(columns=columns, data=[[label, *(row[c] for c in columns[1:])]
                                                          for label, row in parity.items()]),
             **{png.stem: wandb.Image(str(png)) for png in sorted(sweep_dir.glob("*.png"))}})
    run.summary.update({f"parity/{label}/{key}": value for label, row in parity.items()
                        for key, value in row.items()})
    run.finish()
