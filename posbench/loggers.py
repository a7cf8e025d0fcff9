"""Experiment loggers: `logger=none` needs nothing; `logger=wandb` works offline with no login."""
from __future__ import annotations

import os
import secrets
from pathlib import Path
from typing import List

from posbench.io import write_text

WANDB_ID = "wandb_run_id"  # in the run dir


def wandb_mode(logger_cfg) -> str:
    """logger.mode, except that online without WANDB_API_KEY runs offline (no key, no network
    needed: `wandb sync` uploads later), and says so."""
    if logger_cfg.mode == "online" and not os.environ.get("WANDB_API_KEY"):
        print("posbench: logger.mode=online without WANDB_API_KEY: logging offline; upload "
              "later with `wandb sync`")
        return "offline"
    return logger_cfg.mode


class NoLogger:
    def log(self, metrics: dict) -> None:
        pass

    def log_curve(self, curve: List[dict]) -> None:
        pass

    def finish(self, summary: dict) -> None:
        pass


class WandbLogger:
    """One wandb run per job. Train metrics use `train/step` and eval metrics `eval/length` as
    their x-axis, so the curves of every run of a sweep overlay in one chart."""

    def __init__(self, logger_cfg, run_dir: Path, name: str, group: str, config: dict,
                 resuming: bool):
        try:
            import wandb
        except ImportError:
            from posbench.config import ConfigError

            raise ConfigError("logger=wandb is not available: the wandb package is not "
                              "installed; expected `pip install 'posbench[wandb]'` or logger=none")
        mode = wandb_mode(logger_cfg)
        self.wandb = wandb
        # a resumed run continues its wandb run: the id is kept in the run dir
        id_file = run_dir / WANDB_ID
        run_id = (id_file.read_text().strip() if resuming and id_file.exists()
                  else secrets.token_hex(4))
        write_text(id_file, run_id)
        self.run = wandb.init(project=logger_cfg.project, entity=logger_cfg.entity, name=name,
                              group=group, dir=str(run_dir), config=config, mode=mode,
                              id=run_id, resume="allow", reinit="create_new")
        self.run.define_metric("train/step")
        self.run.define_metric("train/*", step_metric="train/step")
        self.run.define_metric("eval/length")
        self.run.define_metric("eval/*", step_metric="eval/length")

    def log(self, metrics: dict) -> None:
        self.run.log(metrics)

    def log_curve(self, curve: List[dict]) -> None:
        for point in curve:
            if "loss" in point:
                self.run.log({"eval/length": point["length"], "eval/loss": point["loss"],
                              "eval/ppl": point["ppl"]})
        columns = ["length", "loss", "ppl"]
        self.run.log({"eval/curve": self.wandb.Table(
            columns=columns, data=[[p.get(c) for c in columns] for p in curve])})

    def finish(self, summary: dict) -> None:
        self.run.summary.update(summary)
        self.run.finish()


def make_logger(cfg, run_dir: Path, name: str, group: str, config: dict, resuming: bool):
    if cfg.logger.name == "wandb":
        return WandbLogger(cfg.logger, run_dir, name, group, config, resuming)
    return NoLogger()


def log_sweep_report(logger_cfg, sweep_dir: Path, parity: dict) -> None:
    """One more wandb run in the sweep's group, `report`: every group's perplexity at the
    training length, its gap to the best and whether it is under-trained, as a table, in the
    summary (`parity/<label>/gap`, ...) and with the sweep's plot."""
    import wandb

    mode = wandb_mode(logger_cfg)
    run = wandb.init(project=logger_cfg.project, entity=logger_cfg.entity, name="report",
                     group=sweep_dir.name, dir=str(sweep_dir), mode=mode, reinit="create_new",
                     job_type="report")
    grid = sweep_dir / "retrieval_grid.png"
    columns = ["label", "train_length", "train_length_ppl", "gap", "gap_ci95", "under_trained",
               "extrapolation_ratio"]
    run.log({"parity": wandb.Table(columns=columns, data=[[label, *(row[c] for c in columns[1:])]
                                                          for label, row in parity.items()]),
             "ppl_vs_length": wandb.Image(str(sweep_dir / "ppl_vs_length.png")),
             # the side-by-side retrieval heatmaps, when the sweep scored retrieval
             **({"retrieval_grid": wandb.Image(str(grid))} if grid.exists() else {})})
    run.summary.update({f"parity/{label}/{key}": value for label, row in parity.items()
                        for key, value in row.items()})
    run.finish()
