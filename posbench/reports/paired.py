"""Paired comparisons of two groups of runs scored on the same windows.

Every run on the same data and eval config scores the same windows at a length, and the runs of
two groups that share a seed saw the same training batches. So the difference of two groups is
read window by window and seed by seed, D[s, w] = loss_a[s, w] - loss_b[s, w] (nats), which is
far sharper than two overlapping bands of means: what every window finds hard moves both groups
alike and cancels.

The estimate is the token-weighted mean of D over the shared seeds and windows, reported as a
perplexity ratio exp(mean D). Its 95% interval is a percentile bootstrap that resamples seeds and
windows together (DRAWS draws, each seed and each window drawn with replacement, fixed RNG seed),
so both the spread between training seeds and the spread between windows count. With two seeds
the seed part is barely sampled; `seed=0,1,2,3,4` is the way to make a claim.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Dict, List, Optional, Tuple

import numpy as np

DRAWS = 2000
LEVEL = 0.95
RNG_SEED = 0


@dataclass(frozen=True)
class Paired:
    """ppl of group a over ppl of group b, paired by seed and window, with its interval."""
    ratio: float
    low: float
    high: float
    seeds: int
    windows: int

    @property
    def significant(self) -> bool:
        """The interval excludes 1: the two groups differ at the LEVEL."""
        return self.low > 1 or self.high < 1

    def cell(self) -> str:
        return (f"{self.ratio - 1:+.1%} [{self.low - 1:+.1%}, {self.high - 1:+.1%}]"
                + ("*" if self.significant else ""))


def window_losses(run: dict, length: int) -> Optional[Tuple[np.ndarray, np.ndarray]]:
    """(each window's mean loss, its scored tokens) of a run at `length`; None when the run did
    not score that length or holds no per-window losses (results written before they were)."""
    point = next((p for p in run["eval"]["curve"] if p["length"] == length), None)
    if point is None or "windows" not in point:
        return None
    return np.asarray(point["windows"]["loss"]), np.asarray(point["windows"]["tokens"])


def scored_on(run: dict) -> tuple:
    """What decides a run's windows: its data, its protocol and how many tokens per length."""
    e = run["eval"]
    return run["dataset"]["fingerprint"], e["protocol"], e["tokens_per_length"], e.get("stride")


def _by_seed(runs: List[dict], length: int) -> Dict[int, Tuple[np.ndarray, np.ndarray]]:
    out = {}
    for run in runs:
        losses = window_losses(run, length)
        if losses is not None:
            out.setdefault(run.get("seed"), losses)
    return out


def _resampled(rng: np.random.Generator, draws: int, n: int) -> np.ndarray:
    """(draws, n): how often each of `draws` resamples of n items with replacement takes each
    item (one bincount over all draws, not a scatter-add per item)."""
    picks = rng.integers(0, n, (draws, n)) + n * np.arange(draws)[:, None]
    return np.bincount(picks.ravel(), minlength=draws * n).reshape(draws, n).astype(float)


def paired(a: List[dict], b: List[dict], length: int, draws: int = DRAWS) -> Optional[Paired]:
    """Group a against group b at `length`; None when they share no seed with per-window losses
    there, or their windows differ (another dataset, protocol or eval.tokens)."""
    runs_a, runs_b = _by_seed(a, length), _by_seed(b, length)
    seeds = sorted(set(runs_a) & set(runs_b), key=str)
    if not seeds or len({scored_on(run) for run in a + b}) > 1:
        return None
    tokens = runs_a[seeds[0]][1]
    if any(len(r[s][1]) != len(tokens) or not np.array_equal(r[s][1], tokens)
           for r in (runs_a, runs_b) for s in seeds):
        return None
    weighted = np.stack([(runs_a[s][0] - runs_b[s][0]) * tokens for s in seeds])  # (S, W)
    n_seeds, n_windows = weighted.shape
    estimate = weighted.sum() / (n_seeds * tokens.sum())
    rng = np.random.default_rng(RNG_SEED)
    seed_counts = _resampled(rng, draws, n_seeds)
    window_counts = _resampled(rng, draws, n_windows)
    totals = np.einsum("ds,sw,dw->d", seed_counts, weighted, window_counts)
    stats = totals / (n_seeds * (window_counts @ tokens))
    tail = (1 - LEVEL) / 2 * 100
    low, high = np.percentile(stats, [tail, 100 - tail])
    return Paired(math.exp(estimate), math.exp(low), math.exp(high), n_seeds, n_windows)


def report_lines(groups: Dict[str, List[dict]], reference: Dict[str, str]) -> List[str]:
    """summary.md's table of each group against its reference (the best group at its training
    length), by evaluated length; nothing when no pair holds per-window losses."""
    rows, lengths = {}, set()
    for label, members in groups.items():
        ref = reference.get(label)
        if ref is None or ref == label:
            continue
        found = {}
        for n in sorted({p["length"] for r in members for p in r["eval"]["curve"]}):
            result = paired(members, groups[ref], n)
            if result is not None:
                found[n] = result
        if found:
            rows[label] = (ref, found)
            lengths |= set(found)
    if not rows:
        return []
    lengths = sorted(lengths)
    seeds = sorted({p.seeds for _, found in rows.values() for p in found.values()})
    lines = ["", "Paired against the best group at the training length: perplexity relative to "
             "it on the same windows and seeds, with a 95% bootstrap interval over seeds and "
             f"windows; * where the interval excludes 0 (seeds shared: "
             f"{', '.join(map(str, seeds))}; posbench/reports/paired.py).", "",
             "| group | against | " + " | ".join(map(str, lengths)) + " |",
             "|---|---|" + "---:|" * len(lengths)]
    for label, (ref, found) in rows.items():
        lines.append(f"| {label} | {ref} | "
                     + " | ".join(found[n].cell() if n in found else "—" for n in lengths) + " |")
    return lines
