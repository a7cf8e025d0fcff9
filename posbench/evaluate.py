"""Perplexity versus length: the same validation windows for every encoding, the same number of
scored tokens at every length, under one of three protocols (posbench/data/windows.py: eval_plan).
Each curve point also keeps the mean loss by position in the window (binned), and for a task,
exact-match accuracy."""
from __future__ import annotations

import math
from typing import List, Optional

import numpy as np
import torch
import torch.nn.functional as F
from omegaconf import OmegaConf

from posbench.config import EvalConfig
from posbench.data.windows import EvalPlan, eval_plan
from posbench.encodings.base import EVAL_OPTIONS
from posbench.device import autocast
from posbench.progress import Bar

MAX_BINS = 64  # per-position bins per length


def is_oom(err: BaseException) -> bool:
    """CUDA's OutOfMemoryError, or the CPU allocator's failure (a RuntimeError that says "can't
    allocate memory")."""
    if isinstance(err, (torch.cuda.OutOfMemoryError, MemoryError)):
        return True
    text = str(err).lower()
    return isinstance(err, RuntimeError) and ("out of memory" in text
                                              or "can't allocate memory" in text)


def with_train_length(eval_cfg, train_len: int):
    """eval_cfg with the training length among its lengths: every run records its perplexity
    there, the reference of its extrapolation ratio and of the parity check (posbench/parity.py)."""
    if train_len in eval_cfg.lengths:
        return eval_cfg
    cfg = OmegaConf.create(OmegaConf.to_container(eval_cfg, resolve=True))
    cfg.lengths = sorted({*eval_cfg.lengths, train_len})
    return cfg


@torch.no_grad()
def evaluate(model, data, eval_cfg, device: torch.device,
             train_len: Optional[int] = None) -> List[dict]:
    """One curve point per length of eval_cfg, and of the run's training length when given: mean
    next-token loss (nats) over the scored tokens, ppl = exp. A length that runs out of memory is
    recorded as such and the others still run."""
    if train_len is not None:
        eval_cfg = with_train_length(eval_cfg, train_len)
    model.eval()
    # a key missing from a partial eval config takes EvalConfig's default
    model.encoding.set_eval_options(*(eval_cfg.get(key, getattr(EvalConfig, key))
                                      for key in EVAL_OPTIONS))
    # every length's windows are checked before the first is scored
    plans = [eval_plan(data, length, eval_cfg) for length in eval_cfg.lengths]
    curve = []
    bar = Bar("eval", len(plans), "length")
    for plan in plans:
        try:
            with autocast(device):
                curve.append(_score(model, plan, eval_cfg.batch_tokens, device))
        except Exception as err:  # noqa: BLE001 - only out-of-memory is recorded, not hidden
            if not is_oom(err):
                raise
            if device.type == "cuda":
                torch.cuda.empty_cache()
            curve.append({"length": plan.length, "status": "oom"})
        bar.update()
        point = curve[-1]
        bar.log(f"length {plan.length} ({bar.n}/{bar.total})",
                ppl=f"{point['ppl']:.3f}" if "ppl" in point else point["status"])
    bar.close()
    return curve


def _token_scores(model, x, y, with_hits: bool):
    """Per-token loss and, for accuracy, whether the argmax is the target."""
    if not with_hits:
        return model.token_losses(x, y), None
    logits = model(x).float()  # task vocabularies are small: the full logits are cheap
    return F.cross_entropy(logits.transpose(1, 2), y, reduction="none"), logits.argmax(-1) == y


def _score(model, plan: EvalPlan, batch_tokens: int, device) -> dict:
    n = plan.length
    loss_sum = torch.zeros(n, dtype=torch.float64, device=device)
    counts = torch.zeros(n, dtype=torch.int64, device=device)
    exact = correct = 0
    task = False
    per_batch = max(1, batch_tokens // n)
    for i in range(0, plan.count, per_batch):
        rows, answers = plan.rows(i, i + per_batch)
        rows = torch.from_numpy(rows.astype(np.int64)).to(device)
        x, y = rows[:, :-1], rows[:, 1:]
        losses, hits = _token_scores(model, x, y, answers is not None)
        scored = torch.zeros_like(y, dtype=torch.bool)
        scored[:, plan.first:] = True
        if answers is not None:
            task = True
            scored &= torch.from_numpy(answers).to(device)
            exact += (hits | ~scored).all(1).sum().item()
            correct += (hits & scored).sum().item()
        loss_sum += torch.where(scored, losses.double(), 0.0).sum(0)
        counts += scored.sum(0)
    total = int(counts.sum().item())
    loss = loss_sum.sum().item() / total
    point = {"length": n, "loss": loss, "ppl": math.exp(loss), "tokens": total}
    if task:
        point.update(accuracy=exact / plan.count, token_accuracy=correct / total)
    point["per_position"] = bin_positions(loss_sum.cpu().numpy(), counts.cpu().numpy())
    return point


def bin_positions(loss_sum: np.ndarray, counts: np.ndarray, max_bins: int = MAX_BINS) -> dict:
    """Mean loss by position in the window (0 = the first target, predicted from one token), in
    at most `max_bins` bins over the scored positions that widen geometrically: the first
    positions, where the early-token effect is, keep bins of their own at any length."""
    scored = np.flatnonzero(counts)
    lo, hi = int(scored[0]), int(scored[-1]) + 1
    edges = np.unique(np.round(np.geomspace(lo + 1, hi + 1, max_bins + 1)).astype(np.int64)) - 1
    sums, tokens = np.add.reduceat(loss_sum, edges[:-1]), np.add.reduceat(counts, edges[:-1])
    keep = tokens > 0
    return {"start": edges[:-1][keep].tolist(), "end": edges[1:][keep].tolist(),
            "loss": (sums[keep] / tokens[keep]).tolist(), "tokens": tokens[keep].tolist()}
