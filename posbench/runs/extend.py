"""Extending a finished run to a longer length (`posbench extend RUN_DIR`), as the PI, YaRN and
PoSE papers do: continued training at s·L with the run's encoding and a scaling, and the metric
against fine-tuning steps.

An extension is a run of its own, in its own run dir (never the parent's), described by its
config alone, so that it resumes, sweeps and is reported like any run. extension_config turns
the parent's config and the command's overrides into it:
- train.init_from: the parent's run dir; its weights start training (posbench/runs/run.py), the
  optimizer, schedule and step start afresh;
- train.seq_len: the longer length (default SCALE x the parent's), or with train.pose_span the
  parent's length, whose window positions skip to span the longer one (PoSE, pose_positions);
- train.rope_scaling (none, pi, ntk, yarn, llama3) trains with the static factor s = the longer
  length / train.original_len (the length of the first run of the lineage, which the scalings
  count from), and eval.rope_scaling evaluates with the same, unless the command sets them;
  train.rope_scaling=longrope trains with the factors of train.longrope_factors (a file for the
  longer length: LongRoPE's fine-tuning), which the evaluation reads too unless the command sets
  eval.rope_scaling;
- train.steps, train.lr, train.warmup_steps, train.eval_every, train.ckpt_every, eval.lengths:
  the defaults below, unless the command sets them.
Every train.eval_every steps, and before the first, StepCurve scores perplexity at eval.lengths
(and passkey retrieval when eval.retrieval.enabled) into eval_vs_step.csv and eval_vs_step.png.
"""
from __future__ import annotations

import csv
from pathlib import Path
from typing import List, Optional, Tuple

import numpy as np
import torch
from omegaconf import DictConfig, OmegaConf, open_dict

from posbench import evaluations
from posbench.config import TRAIN_ROPE_SCALINGS
from posbench.core.errors import require
from posbench.core.io import write_text
from posbench.core.plots import plain_log_y, pyplot, save_figure
from posbench.core.progress import during
from posbench.runs.results import RESULTS

SCALE = 4  # default longer length: 4 L (PI extends LLaMA from 2048 to 8192 tokens, s = 4)
STEPS = 200  # PI: passkey retrieval holds at the extended length after 200 steps
WARMUP = 20  # PI and YaRN fine-tune with 20 warmup steps
CURVE_POINTS = 10  # default train.eval_every: steps / 10
POSE_STREAM = 11  # PoSE positions come from a generator seeded (seed, step, POSE_STREAM)
CURVE, CURVE_PLOT = "eval_vs_step.csv", "eval_vs_step.png"
COLUMNS = ["step", "length", "loss", "ppl", "bits_saved", "exact_match"]


def extension_config(cfg: DictConfig, parent: Path, trained: dict,
                     given: List[str]) -> DictConfig:
    """The extension run's config: `cfg` (the parent's config with the command's overrides, whose
    keys are `given`) with the extension's keys and defaults; `trained` is the config the parent
    was trained with (its results.json). Refused in one line: a length not above the parent's, a
    scaling the training does not take."""
    p = trained["train"]
    reach = max(p["seq_len"], p.get("pose_span") or 0)  # the longest span the parent trained at
    original = p.get("original_len") or p["seq_len"]  # the first run of the lineage's
    out = OmegaConf.create(OmegaConf.to_container(cfg, resolve=True))
    e = out.train
    with open_dict(out):
        e.init_from, e.original_len = str(parent), original
        if "train.pose_span" not in given:
            e.pose_span = None
        if "train.seq_len" not in given:
            e.seq_len = p["seq_len"] if e.pose_span else SCALE * reach
        target = e.pose_span or e.seq_len
        require(target > reach, "train.pose_span" if e.pose_span else "train.seq_len", target,
                f"a length above the parent's {reach}: posbench extend trains a finished run "
                f"({str(parent)!r}) at a longer length")
        scaling = e.get("rope_scaling", "none")
        require(scaling in TRAIN_ROPE_SCALINGS, "train.rope_scaling", scaling,
                f"one of {TRAIN_ROPE_SCALINGS}")
        if "train.rope_scaling_factor" not in given:  # longrope's factors are its file's
            e.rope_scaling_factor = (target / original if scaling not in ("none", "longrope")
                                     else None)
        if "train.longrope_factors" not in given:  # a file fits one length, never the parent's
            e.longrope_factors = None
        defaults = {"steps": STEPS, "warmup_steps": WARMUP,
                    "lr": p["lr"] * p["min_lr_ratio"]}  # the learning rate the parent ended at
        for key, value in defaults.items():
            if f"train.{key}" not in given:
                e[key] = value
        if "train.eval_every" not in given:
            e.eval_every = max(1, e.steps // CURVE_POINTS)
        if "train.ckpt_every" not in given:
            e.ckpt_every = e.eval_every  # a resume point at every point of the curve
        if "eval.rope_scaling" not in given:
            out.eval.rope_scaling = scaling
            if "eval.rope_scaling_factor" not in given:
                out.eval.rope_scaling_factor = e.rope_scaling_factor
            if "eval.longrope_factors" not in given:
                out.eval.longrope_factors = e.get("longrope_factors")
        if "eval.lengths" not in given:
            out.eval.lengths = sorted({*trained["eval"]["lengths"], target})
    return out


def pose_draws(seed: int, step: int, batch: int, seq_len: int,
               span: int) -> Tuple[np.ndarray, np.ndarray]:
    """PoSE's draws of step `step`, one per window: the first chunk's length r, uniform in
    1..ceil(seq_len/2), and the skip u, uniform in 0..span-seq_len. A function of (seed, step)."""
    rng = np.random.default_rng([seed, step, POSE_STREAM])
    first = rng.integers(1, (seq_len + 1) // 2 + 1, size=batch)
    return first, rng.integers(0, span - seq_len + 1, size=batch)


def pose_positions(seed: int, step: int, batch: int, seq_len: int, span: int) -> torch.Tensor:
    """PoSE's positions (Zhu et al. 2024, dwzhu-pku/PoSE train_pose.py) of step `step`'s windows,
    (batch, seq_len) long: each window is two chunks, the first of r tokens at 0..r-1, the second
    shifted by the skip u, so that its positions run from r + u to seq_len - 1 + u < span
    (pose_draws)."""
    first, skip = pose_draws(seed, step, batch, seq_len, span)
    pos = np.tile(np.arange(seq_len), (batch, 1))
    pos += np.where(np.arange(seq_len) >= first[:, None], skip[:, None], 0)
    return torch.from_numpy(pos)


class StepCurve:
    """eval_vs_step.csv and eval_vs_step.png of a run with train.eval_every > 0: perplexity at each
    of eval.lengths (and the training length) and, with eval.retrieval.enabled, bits saved and
    exact match by length (means over depths), scored with the run's eval settings at the steps
    `score` is called at. A run that resumes from step S keeps the complete rows up to S, so the
    file ends as an uninterrupted run's does."""

    def __init__(self, cfg: DictConfig, start, run_dir: Path, first: int):
        self.cfg, self.start = cfg, start  # start: posbench/runs/run.py's Start
        self.path, self.plot_path = Path(run_dir) / CURVE, Path(run_dir) / CURVE_PLOT
        kept = []
        if self.path.exists():  # a row cut short has no newline; rows past S are scored again
            kept = [line for line in self.path.read_text().splitlines(keepends=True)[1:]
                    if line.endswith("\n") and int(line.split(",", 1)[0]) <= first]
        write_text(self.path, ",".join(COLUMNS) + "\n" + "".join(kept))

    def score(self, step: int, model) -> dict:
        """Appends the rows of `step` and returns its scores: the run's planned evaluations, as
        they score it at the end (the model is left in eval mode)."""
        with during(f"step {step}" + (f"/{self.start.budget.steps}" if self.start.budget.steps
                                       else "")):
            scores = evaluations.run(self.start.evaluations, model, self.start.device)
        found = {p["length"]: p for p in (scores.get("retrieval") or {}).get("by_length", [])}
        with open(self.path, "a", newline="") as f:
            writer = csv.writer(f)
            for point in scores["curve"]:
                cells = {**point, **found.get(point["length"], {})}
                writer.writerow([step] + [repr(cells[k]) if k in cells else ""
                                          for k in COLUMNS[1:]])
        return scores

    def close(self) -> None:
        """eval_vs_step.png: perplexity by step, one curve per length (retrieval beside it)."""
        rows = read_curve(self.path)
        retrieval = any(r["bits_saved"] is not None for r in rows)
        plt = pyplot()
        fig, axes = plt.subplots(1, 2 if retrieval else 1, figsize=(12 if retrieval else 7, 4.5),
                                 squeeze=False)
        for ax, key, label in zip(axes[0], ("ppl", "bits_saved"),
                                  ("perplexity", "bits saved per key token")):
            for length in sorted({r["length"] for r in rows}):
                points = [(r["step"], r[key]) for r in rows
                          if r["length"] == length and r[key] is not None]
                if points:
                    ax.plot(*zip(*points), "o-", markersize=3, label=f"{length}")
            step_axis(ax)
            ax.set_ylabel(label)
            if key == "ppl":
                plain_log_y(ax)
            ax.grid(True, alpha=0.3)
            ax.legend(title="length", fontsize=8)
        t = self.cfg.train
        fig.suptitle(f"{self.cfg.encoding.name} extended to "
                     f"{t.get('pose_span') or t.seq_len} (train.rope_scaling "
                     f"{t.get('rope_scaling', 'none')}"
                     + (f", PoSE windows of {t.seq_len}" if t.get("pose_span") else "") + ")",
                     fontsize=10)
        save_figure(plt, fig, self.plot_path)


def step_axis(ax) -> None:
    """The x axis of fine-tuning steps, ticked at whole steps only."""
    from matplotlib.ticker import MaxNLocator

    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    ax.set_xlabel("fine-tuning step")


def read_curve(path: Path) -> List[dict]:
    """eval_vs_step.csv's rows: step and length as ints, the scores as floats (None: empty)."""
    with open(path, newline="") as f:
        return [{key: (int(value) if key in ("step", "length") else float(value)) if value
                 else None for key, value in row.items()} for row in csv.DictReader(f)]


def plot_sweep(runs: List[dict], labels: dict, path: Path) -> bool:
    """A report's eval_vs_step.png: perplexity at each run's own training length against its
    fine-tuning steps, one curve per run (the figure of the PI and YaRN papers), for the runs
    (records with `_dir`, labelled by `labels[i]`) that wrote eval_vs_step.csv. False if none."""
    curves = []
    for i, run in enumerate(runs):
        file = Path(run["_dir"]) / CURVE
        if run.get("_file") != RESULTS or not file.is_file():
            continue
        t = run["config"]["train"]
        length = t.get("pose_span") or t["seq_len"]  # what PoSE's windows span
        points = [(r["step"], r["ppl"]) for r in read_curve(file) if r["length"] == length]
        curves.append((f"{labels[i]}, seed {run['seed']}", length, points))
    if not curves:
        return False
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for label, length, points in curves:
        ax.plot(*zip(*points), "o-", markersize=3, label=f"{label} (at {length})")
    step_axis(ax)
    ax.set_ylabel("perplexity at the run's training length")
    plain_log_y(ax)
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.01, 1))  # beside: labels are long
    save_figure(plt, fig, path)
    return True


def curve_for(cfg: DictConfig, start, run_dir: Path, first: int) -> Optional[StepCurve]:
    """The run's StepCurve when train.eval_every asks for one, else None."""
    return StepCurve(cfg, start, run_dir, first) if cfg.train.get("eval_every") else None
