"""Experiment loggers: `logger=none` needs nothing; `logger=wandb` works offline with no login."""
from __future__ import annotations

import os
import secrets
from pathlib import Path
from typing import List

from posbench.io import write_text

WANDB_ID = "wandb_run_id"  # in the run dir


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
        mode = logger_cfg.mode
        if mode == "online" and not os.environ.get("WANDB_API_KEY"):
            mode = "offline"  # no key, no network needed: `wandb sync` uploads later
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
