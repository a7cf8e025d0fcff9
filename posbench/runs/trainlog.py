"""The training log on disk: metrics.csv in the run dir gets a row every train.log_every steps
(step, the mean training loss of those steps, the learning rate, tokens per second) and every
train.val_every steps (the validation loss at the training length, on a few fixed validation
windows), one row where both fall on a step; loss_vs_step.png plots it.

Rows are appended as training goes. A run that resumes from its checkpoint at step S first keeps
only the complete rows up to S, so its file ends with the rows an uninterrupted run writes
(tokens per second aside, which measures the sitting that wrote the row)."""
from __future__ import annotations

import csv
from pathlib import Path
from typing import List, Optional

import numpy as np
import torch
from omegaconf import OmegaConf

from posbench.core.device import autocast
from posbench.evaluations.base import set_eval_options
from posbench.core.errors import ConfigError
from posbench.evaluations.perplexity import eval_plan
from posbench.core.io import write_text
from posbench.core.plots import pyplot, save_figure

METRICS = "metrics.csv"
LOSS_PLOT = "loss_vs_step.png"
COLUMNS = ["step", "loss", "lr", "tokens_per_second", "val_loss"]


def _cell(value: Optional[float]) -> str:
    return "" if value is None else repr(float(value))  # repr: the float, exactly


class MetricsLog:
    """metrics.csv of a run that starts (or resumes) at `first_step`."""

    def __init__(self, path: Path, first_step: int):
        self.path = Path(path)
        kept = []
        if self.path.exists():
            # a row cut short by a kill has no newline; a row past the checkpoint is written again
            lines = self.path.read_text().splitlines(keepends=True)[1:]
            kept = [line for line in lines if line.endswith("\n")
                    and int(line.split(",", 1)[0]) <= first_step]
        write_text(self.path, ",".join(COLUMNS) + "\n" + "".join(kept))

    def append(self, step: int, loss: Optional[float] = None, lr: Optional[float] = None,
               tokens_per_second: Optional[float] = None,
               val_loss: Optional[float] = None) -> None:
        with open(self.path, "a") as f:
            f.write(",".join([str(step), *map(_cell, (loss, lr, tokens_per_second, val_loss))])
                    + "\n")


def read_metrics(path: Path) -> List[dict]:
    """metrics.csv's rows, numbers as floats (step as int), empty cells as None."""
    with open(path, newline="") as f:
        return [{key: (int(value) if key == "step" else float(value)) if value else None
                 for key, value in row.items()} for row in csv.DictReader(f)]


class Validation:
    """Mean loss at the training length on the first `windows` nonoverlapping validation windows
    (for a task, its first instances), the same at every call. The model is scored as
    evaluation scores it, with the encoding options it trains with (`options`, the eval-time
    defaults for the keys it lacks), then put back in training mode."""

    def __init__(self, data, seq_len: int, windows: int, device: torch.device,
                 options: Optional[dict] = None):
        try:
            self.plan = eval_plan(data, seq_len, OmegaConf.create(
                {"protocol": "nonoverlapping", "tokens": windows * seq_len, "stride": None,
                 "lengths": [seq_len]}))
        except ConfigError:
            raise ConfigError(
                f"train.seq_len={seq_len} is not accepted with train.batch_size={windows}: "
                f"validation scores {windows} windows of {seq_len + 1} tokens, more than the "
                f"validation documents of {data.name} hold; expected a shorter train.seq_len, a "
                "smaller train.batch_size, or train.val_every=0") from None
        self.windows, self.device, self.options = windows, device, options or {}

    @torch.no_grad()
    def __call__(self, model) -> float:
        model.eval()
        set_eval_options(model, self.options)
        rows, answers = self.plan.rows(0, self.windows)
        rows = torch.from_numpy(rows.astype(np.int64)).to(self.device)
        with autocast(self.device):
            losses = model.token_losses(rows[:, :-1], rows[:, 1:]).double()
        model.train()
        if answers is None:  # from plan.first: not the prediction made at dataset.bos's BOS
            return losses[:, self.plan.first:].mean().item()
        scored = torch.from_numpy(answers).to(self.device)
        return (losses[scored].sum() / scored.sum()).item()


def plot_losses(metrics: Path, path: Path, title: str) -> None:
    """Training loss, and validation loss where measured, against the step."""

    rows = read_metrics(metrics)
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for key, label, style in (("loss", "training loss (mean of each log window)", "-"),
                              ("val_loss", "validation loss at the training length", "o--")):
        points = [(row["step"], row[key]) for row in rows if row[key] is not None]
        if points:
            ax.plot(*zip(*points), style, label=label, markersize=4)
    ax.set_xlabel("step")
    ax.set_ylabel("loss (nats)")
    ax.set_title(title, fontsize=10)
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=8)
    save_figure(plt, fig, path)
