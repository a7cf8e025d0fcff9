"""The training loop: from a planned start (posbench/runs/run.py) until its budget is spent
(train.steps under the default train.budget=tokens; posbench/runs/budget.py), with its
checkpoints.

A non-finite loss stops training: on CPU it is caught at the step that made it; on CUDA, to
spare a host sync per step, at the next log step or checkpoint, always before the bad weights
are saved, so the checkpoint kept is good.
"""
from __future__ import annotations

import math
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Optional, Tuple

import torch
from omegaconf import DictConfig

from posbench.runs import distributed
from posbench.runs.checkpoint import CHECKPOINT, Checkpoint
from posbench.config import to_container
from posbench.data.windows import IGNORE
from posbench.core.device import allow_tf32, autocast, rng_state, set_rng_state
from posbench.evaluations.base import set_eval_options
from posbench.runs.extend import curve_for, pose_positions
from posbench.runs.lengths import SegmentCount, training_batch
from posbench.core.progress import Bar
from posbench.runs.trainlog import LOSS_PLOT, METRICS, MetricsLog, plot_losses
from posbench.core.version import __version__


@dataclass
class Progress:
    """What a failure report needs, kept current by the training loop."""
    first: int = 0  # step this session started from
    step: int = 0  # steps done
    saved_step: Optional[int] = None  # step of the checkpoint on disk
    last_loss: Optional[float] = None  # last finite per-step training loss


def cosine_lr(progress: float, cfg) -> float:
    """The decay after warmup: cosine from lr at progress 0 to min_lr_ratio * lr at 1."""
    return cfg.lr * (cfg.min_lr_ratio + (1 - cfg.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * progress)))


def lr_at(step: int, cfg) -> float:
    """Linear warmup, then cosine decay to min_lr_ratio * lr."""
    if step < cfg.warmup_steps:
        return cfg.lr * (step + 1) / cfg.warmup_steps
    return cosine_lr((step - cfg.warmup_steps) / max(1, cfg.steps - cfg.warmup_steps), cfg)


def lr_at_fraction(fraction: float, cfg) -> float:
    """lr_at's schedule over a time budget (train.budget=wallclock) at the fraction of it spent:
    warmup for the first warmup_steps/steps of it, then cosine decay to its end."""
    warmup = cfg.warmup_steps / cfg.steps
    if fraction < warmup:
        return cfg.lr * fraction / warmup
    return cosine_lr((fraction - warmup) / max(1e-9, 1 - warmup), cfg)


def make_optimizer(model, cfg, device):
    """AdamW in three groups: weight matrices with weight decay; gains and biases without; the
    encoding's parameters (position tables, bias tables, slopes, generators) without weight
    decay, as their references train them (minGPT's position table, T5's Adafactor), and at
    train.position_lr_mult times the learning rate (docs/encodings.md, "Training defaults")."""
    encoding = getattr(model, "encoding", None)  # the peers in scripts/bench.py have none
    position = list(encoding.parameters()) if encoding is not None else []
    own = {id(p) for p in position}
    decay = [p for p in model.parameters() if p.dim() >= 2 and id(p) not in own]
    no_decay = [p for p in model.parameters() if p.dim() < 2 and id(p) not in own]
    groups = [{"params": decay, "weight_decay": cfg.weight_decay},
              {"params": no_decay, "weight_decay": 0.0},
              {"params": position, "weight_decay": 0.0, "lr_mult": cfg.position_lr_mult}]
    return torch.optim.AdamW(groups, lr=cfg.lr, betas=(0.9, 0.95), fused=device.type == "cuda")


def check_finite(losses: torch.Tensor, first_step: int, last_good: Optional[float]) -> float:
    """The last of `losses` (the losses of steps first_step+1, ...), or FloatingPointError naming
    the first non-finite one and the loss before it."""
    bad = (~torch.isfinite(losses)).nonzero()
    if len(bad):
        i = int(bad[0])
        good = float(losses[i - 1]) if i else last_good
        raise FloatingPointError(f"non-finite training loss {float(losses[i])} at step "
                                 f"{first_step + i + 1}; last good loss "
                                 + (f"{good:.4f}" if good is not None else "none"))
    return float(losses[-1])


class LossWindow:
    """Per-step losses of the open log window, kept on the device (no host sync per step on
    CUDA). final_loss is the mean of the last closed window, so the open one is checkpointed."""

    def __init__(self, size: int, device: torch.device):
        self.losses = torch.zeros(size, device=device)
        self.n = 0
        self.final_loss = float("nan")

    def add(self, loss: torch.Tensor) -> None:
        self.losses[self.n] = loss
        self.n += 1

    def check(self, done: int, progress: Progress) -> None:
        """progress.last_loss from the open window's steps, or FloatingPointError."""
        progress.last_loss = check_finite(self.losses[:self.n], done - self.n, progress.last_loss)

    def close(self) -> float:
        self.final_loss = self.losses[:self.n].mean().item()
        self.n = 0
        return self.final_loss

    def restore(self, checkpoint: Checkpoint) -> None:
        self.n = len(checkpoint.window)
        self.losses[:self.n] = checkpoint.window.to(self.losses.device)
        self.final_loss = checkpoint.final_loss


def train_step(model, step_fn, optimizer, x, y, lr: float, grad_clip: float,
               pos: Optional[torch.Tensor] = None,
               segments: Optional[torch.Tensor] = None) -> torch.Tensor:
    """One optimizer step at learning rate lr (positions `pos`, default 0..T-1; attention within
    `segments`, posbench/runs/lengths.py); the loss of the global batch, on the device."""
    for group in optimizer.param_groups:
        group["lr"] = lr * group.get("lr_mult", 1.0)
    with autocast(x.device):
        # mean over trained targets (tasks mark the others IGNORE; text trains on all)
        loss = step_fn(x, pos=pos, targets=y, segments=segments).sum() / (y != IGNORE).sum()
    optimizer.zero_grad(set_to_none=True)
    loss.backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), grad_clip)
    optimizer.step()
    return distributed.mean(loss.detach())  # the global batch's loss on every rank


def training_options(t) -> dict:
    """The encoding options the model trains with: train.rope_scaling and its factor or
    LongRoPE's factors file (an extension's, posbench/runs/extend.py), the eval-time defaults
    otherwise."""
    return {"rope_scaling": t.get("rope_scaling", "none"),
            "rope_scaling_factor": t.get("rope_scaling_factor"),
            "longrope_factors": t.get("longrope_factors")}


def prepare_training(model, t) -> None:
    """Training mode, with the encoding options the model trains with (after evaluation too)."""
    set_eval_options(model, training_options(t))
    model.train()


def fit(cfg: DictConfig, start, run_dir: Path, logger,
        progress: Progress) -> Tuple[dict, Optional[dict]]:
    """Trains a planned start (posbench/runs/run.py: Start) from its step until its budget is
    spent; returns the `train` part of results.json and, when train.eval_every scored the last
    step, its scores (the final evaluation's, which need not run again)."""
    t, device, model, data = cfg.train, start.device, start.model, start.data
    budget = start.budget
    main = distributed.is_main()
    allow_tf32(device)
    optimizer = make_optimizer(model, t, device)
    net = distributed.wrap(model, device)
    step_fn = torch.compile(net) if t.compile else net
    window, seconds = LossWindow(t.log_every, device), 0.0
    if start.checkpoint:
        optimizer.load_state_dict(start.checkpoint.optimizer)
        set_rng_state(start.checkpoint.rng, device)
        window.restore(start.checkpoint)
        seconds, progress.last_loss = start.checkpoint.seconds, start.checkpoint.last_loss
    log = TrainingLog(cfg, start, run_dir, logger, progress.first)
    counted = segment_count(t, start.checkpoint)
    # train.eval_every: the metric against the step, scored before the first step and at every
    # eval_every steps before that step's checkpoint, so that a resume keeps what it scored
    curve = curve_for(cfg, start, run_dir, progress.first) if main else None
    if curve is not None and progress.first == 0:
        curve.score(0, model)
    final = None
    session, evaluating = time.perf_counter(), 0.0

    def trained_for() -> float:  # this session's training seconds, its evaluations left out
        return time.perf_counter() - session - evaluating

    def spent() -> float:  # training seconds over every start of the run
        if budget.seconds is not None and device.type == "cuda":
            torch.cuda.synchronize(device)  # the clock counts finished steps, not queued ones
        return seconds + trained_for()

    prepare_training(model, t)
    step = progress.first
    while not budget.spent(step, spent()):
        batch = training_batch(data, cfg, step, start.plant)
        if counted is not None:
            counted.add(batch[3])  # the global batch's segments, before the shard
        x, y, pos, segments = (None if z is None else
                               distributed.shard(z).to(device, non_blocking=True) for z in batch)
        if t.get("pose_span"):
            pos = distributed.shard(pose_positions(cfg.seed, step, t.batch_size, t.seq_len,
                                                   t.pose_span)).to(device)
        lr = (lr_at(step, budget.schedule) if budget.seconds is None
              else lr_at_fraction(spent() / budget.seconds, t))
        model.encoding.at_step(step)  # a schedule's encoding for this step (train.switch_*)
        window.add(train_step(model, step_fn, optimizer, x, y, lr, t.grad_clip, pos, segments))
        done = step + 1
        log.step()
        last = budget.spent(done, spent())
        closes = window.n == t.log_every or last
        saves = last or (t.ckpt_every > 0 and done % t.ckpt_every == 0)
        if device.type == "cpu" or closes or saves:
            window.check(done, progress)
        loss = window.close() if closes else None
        began = time.perf_counter()  # validation is evaluation: not training time
        log.row(done, model, loss, lr, trained_for())
        if curve is not None and done % t.eval_every == 0:
            scores = curve.score(done, model)
            if last:  # what the final evaluation would score again
                final = scores
            prepare_training(model, t)
        evaluating += time.perf_counter() - began
        if saves and main:
            save(run_dir / CHECKPOINT, cfg, start, optimizer, window, progress, spent(), done,
                 counted)
            progress.saved_step = done
        progress.step = step = done
    log.close()
    if curve is not None:
        curve.close()
    wall = spent()
    tokens = t.batch_size * t.seq_len * progress.step
    return {"seq_len": t.seq_len, "steps": progress.step, "tokens": tokens,
            "final_loss": window.final_loss, "tokens_per_second": tokens / wall,
            "wall_seconds": wall, "resumed_from_step": progress.first,
            **({"segment_lengths": counted.record()} if counted is not None else {}),
            **budget.record(progress.step, wall, device)}, final


def segment_count(t, checkpoint) -> Optional[SegmentCount]:
    """Where the data cut the rows (train.pack_documents), their segments' count from the
    checkpoint's; None otherwise, and for a checkpoint saved before the count was kept (its
    earlier steps are not counted: the run records none)."""
    if not t.get("pack_documents", False):
        return None
    if checkpoint is None:
        return SegmentCount(t.seq_len)
    saved = checkpoint.segment_lengths
    return None if saved is None else SegmentCount(t.seq_len, saved)


def save(path: Path, cfg: DictConfig, start, optimizer, window: LossWindow, progress: Progress,
         seconds: float, done: int, counted: Optional[SegmentCount]) -> None:
    Checkpoint(version=__version__, config=to_container(cfg), dataset=start.data.fingerprint,
               vocab_size=start.data.vocab_size, step=done, model=start.model.state_dict(),
               optimizer=optimizer.state_dict(), rng=rng_state(start.device),
               window=window.losses[:window.n].cpu(), final_loss=window.final_loss,
               last_loss=progress.last_loss, seconds=seconds,
               device=start.budget.spent_on(start.device),
               segment_lengths=None if counted is None else counted.counts).save(path)


class TrainingLog:
    """Where training reports: the progress bar, metrics.csv and loss_vs_step.png (rank 0), the
    validation loss every train.val_every steps, and the logger (wandb)."""

    def __init__(self, cfg: DictConfig, start, run_dir: Path, logger, first: int):
        main = distributed.is_main()
        self.cfg, self.run_dir, self.logger, self.first = cfg, run_dir, logger, first
        self.metrics = MetricsLog(run_dir / METRICS, first) if main else None
        self.validation = start.validation
        self.bar = Bar(f"train {cfg.encoding.name}", start.budget.steps, "step", initial=first,
                       enabled=main)

    def step(self) -> None:
        self.bar.update()

    def row(self, done: int, model, loss: Optional[float], lr: float, seconds: float) -> None:
        """A row when a log window closed (its mean `loss`) or validation is due; `seconds`:
        this session's training time so far."""
        t = self.cfg.train
        row = {}
        if loss is not None:
            tps = t.batch_size * t.seq_len * (done - self.first) / seconds
            row = {"loss": loss, "lr": lr, "tokens_per_second": tps}
        if self.validation is not None and done % t.val_every == 0:
            row["val_loss"] = self.validation(model)
        if not row:
            return
        self.bar.log(**{key: f"{row[key]:.3f}" for key in ("loss", "val_loss") if key in row},
                     **({"lr": f"{lr:.2e}", "tok_s": f"{tps:.0f}"} if loss is not None else {}))
        if self.metrics is not None:
            self.metrics.append(done, **row)
        self.logger.log({"train/step": done, **{f"train/{key}": value
                                                for key, value in row.items()}}, step=done)

    def close(self) -> None:
        self.bar.close()
        if self.metrics is not None:
            t = self.cfg.train
            plot_losses(self.run_dir / METRICS, self.run_dir / LOSS_PLOT,
                        f"{self.cfg.encoding.name} (seed {self.cfg.seed}), trained at {t.seq_len}")
