"""Perplexity versus length: the same validation windows for every encoding, the same number of
scored tokens at every length, under one of the protocols (a Protocol subclass, one file each:
nonoverlapping.py, sliding.py, growing_context.py). Each curve point also keeps the mean loss by
position in the window (binned), and for a task, exact-match accuracy."""
from __future__ import annotations

import math
from typing import ClassVar, List, Optional

import numpy as np
import torch
import torch.nn.functional as F

from posbench.data import dataset_class
from posbench.data.windows import EvalPlan
from posbench.core.errors import ConfigError, did_you_mean, require, require_positive
from posbench.evaluations.base import (EvalConfig, Evaluation, effective_length, eval_config,
                                       registry, scored_within_memory, set_eval_options,
                                       with_train_length)
from posbench.core.progress import Bar

MAX_BINS = 64  # per-position bins per length


class Protocol(Evaluation):
    """Which validation windows of `length` + 1 tokens (inputs, then targets shifted by one) are
    scored at each length, and from which position on their targets count: `starts` and
    `stride`. The same windows for every encoding; a data source builds them from the starts
    (posbench/data/tokens.py), a task from its instances (posbench/data/tasks.py)."""
    Config: ClassVar[type] = EvalConfig
    key = "curve"
    # scores every target of disjoint windows: the only way to score generated instances, one
    # per window (tasks)
    whole_windows: ClassVar[bool] = False

    @classmethod
    def config(cls, run_cfg):
        return eval_config(run_cfg.eval)

    @classmethod
    def selected(cls, run_cfg) -> bool:
        return run_cfg.eval.protocol == cls.name

    @classmethod
    def check(cls, cfg, run_cfg) -> None:
        require(len(cfg.lengths) > 0, "eval.lengths", list(cfg.lengths),
                "a non-empty list of positive integers")
        for n in cfg.lengths:
            require_positive("eval.lengths", n)
        require_positive("eval.tokens", cfg.tokens)
        require_positive("eval.batch_tokens", cfg.batch_tokens)
        if cfg.stride is not None:
            require_positive("eval.stride", cfg.stride)
            require(cfg.stride <= min(cfg.lengths), "eval.stride", cfg.stride,
                    f"at most the shortest eval length {min(cfg.lengths)}")
        require(math.isfinite(cfg.ppl_tolerance) and cfg.ppl_tolerance >= 0,
                "eval.ppl_tolerance", cfg.ppl_tolerance, "a finite number >= 0")
        whole = [e.name for e in registry().values()
                 if issubclass(e.cls, Protocol) and e.cls.whole_windows]
        require(cls.whole_windows or dataset_class(run_cfg.dataset).text, "eval.protocol",
                cls.name, f"{' or '.join(whole)} for dataset={run_cfg.dataset.name} (each window "
                "is one task instance)")

    @classmethod
    def stride(cls, cfg) -> Optional[int]:
        """Tokens scored at the end of each window; None: all of them."""
        return None

    @classmethod
    def starts(cls, data, length: int, cfg) -> np.ndarray:
        """Where each window starts in data.tokens (posbench/data/windows.py: spread)."""
        raise NotImplementedError

    def __init__(self, cfg, run_cfg, data):
        super().__init__(with_train_length(cfg, run_cfg.train.seq_len), run_cfg, data)
        self.plans = plans(data, self.cfg)

    def run(self, model, device: torch.device) -> List[dict]:
        return score(model, self.plans, self.cfg, device)


def protocol_of(eval_cfg) -> type:
    """The Protocol class eval.protocol names."""
    name = eval_cfg.protocol
    entry = registry().get(name)
    if entry is None or not issubclass(entry.cls, Protocol):
        names = [e.name for e in registry().values() if issubclass(e.cls, Protocol)]
        raise ConfigError(f"eval.protocol={name!r} is not accepted{did_you_mean(name, names)}; "
                          "expected one of: " + ", ".join(names))
    return entry.cls


def eval_plan(data, length: int, eval_cfg) -> EvalPlan:
    """The windows scored at `length` under the eval config's protocol."""
    cfg = eval_config(eval_cfg)
    return data.eval_plan(length, cfg, protocol_of(cfg))


def plans(data, eval_cfg) -> List[EvalPlan]:
    """Every length's windows, built (and refused where the data cannot hold them) before the
    first is scored."""
    return [eval_plan(data, length, eval_cfg) for length in eval_cfg.lengths]


@torch.no_grad()
def evaluate(model, data, eval_cfg, device: torch.device,
             train_len: Optional[int] = None) -> List[dict]:
    """One curve point per length of eval_cfg, and of the run's training length when given: mean
    next-token loss (nats) over the scored tokens, ppl = exp. A length that runs out of memory is
    recorded as such and the others still run."""
    eval_cfg = eval_config(eval_cfg)
    if train_len is not None:
        eval_cfg = with_train_length(eval_cfg, train_len)
    return score(model, plans(data, eval_cfg), eval_cfg, device)


@torch.no_grad()
def score(model, plans: List[EvalPlan], eval_cfg, device: torch.device) -> List[dict]:
    """The curve of `plans` (evaluate)."""
    model.eval()
    set_eval_options(model, eval_cfg)
    curve = []
    bar = Bar("eval", len(plans), "length")
    for plan in plans:
        curve.append(scored_within_memory(
            device, lambda: score_plan(model, plan, eval_cfg.batch_tokens, device),
            length=plan.length))
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


def score_plan(model, plan: EvalPlan, batch_tokens: int, device) -> dict:
    """The curve point of one plan's windows: mean loss over the scored targets, ppl, tokens,
    by position and by window (and accuracy, for a task's answers)."""
    n = plan.length
    loss_sum = torch.zeros(n, dtype=torch.float64, device=device)
    counts = torch.zeros(n, dtype=torch.int64, device=device)
    exact = correct = 0
    task = False
    window_sums, window_tokens = [], []  # per window: for paired comparisons between runs
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
        kept = torch.where(scored, losses.double(), 0.0)
        loss_sum += kept.sum(0)
        counts += scored.sum(0)
        window_sums.append(kept.sum(1).cpu())
        window_tokens.append(scored.sum(1).cpu())
    total = int(counts.sum().item())
    loss = loss_sum.sum().item() / total
    point = {"length": n, "loss": loss, "ppl": math.exp(loss), "tokens": total}
    if task:
        point.update(accuracy=exact / plan.count, token_accuracy=correct / total)
    point["per_position"] = bin_positions(loss_sum.cpu().numpy(), counts.cpu().numpy())
    sums, tokens = torch.cat(window_sums), torch.cat(window_tokens)
    point["windows"] = {"loss": (sums / tokens.clamp(min=1)).tolist(), "tokens": tokens.tolist()}
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


def ppl_effective_length(curve: List[dict], train_len: int, tolerance: float) -> Optional[int]:
    """The largest length >= train_len up to which perplexity stays within (1 + tolerance) of its
    value at train_len. Shorter lengths do not count: less context raises perplexity there."""
    ppl = {p["length"]: p.get("ppl") for p in curve}
    if ppl.get(train_len) is None:
        return None
    bound = (1 + tolerance) * ppl[train_len]
    return effective_length([(n, None if v is None else bound - v) for n, v in ppl.items()
                             if n >= train_len], 0.0)
