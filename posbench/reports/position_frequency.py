"""STRING's position-frequency diagnostic (An et al., ICLR 2025, "Why Does the Effective Context
Length of LLMs Fall Short?", section 2): f(i) = sum over the training sequences s of
max(|s| - i, 0), the number of (query, key) pairs at relative distance i that training scored.
Causal attention over a sequence of n tokens holds n - i pairs at distance i (i = 0: each token
with itself), so f falls linearly to 0 at the longest trained sequence: the distances near it are
the rarest, which the paper ties to effective lengths below the training length.

The report draws f(i) of each group's training beside its perplexity curve
(position_frequency.png) and writes its values (position_frequency.csv).

What training attended within comes from the run's results.json and the functions its training
formed its batches with (docs/design.md#length-schedules), exactly:
- train.batch_size rows of train.seq_len L tokens per step, each attending to all of itself;
- train.length_schedule=skyladder: each row cut into windows of the step's w tokens from its start,
  the last shorter (posbench/runs/lengths.py: window_steps, from the config alone);
- train.pack_documents: the segments (document pieces, cut into windows under a schedule) that
  training counted as it formed them, results.json's train.segment_lengths;
- train.pose_span: i is the distance between position ids, which is what the encoding sees: the
  token distance within each of PoSE's two chunks, the skip u more across them, up to span - 1.
  PoSE's draws are replayed step by step (posbench/runs/extend.py: pose_draws).
f is summed from its kinks: a sequence's n - i, and the pairs across PoSE's skip, are piecewise
linear in i, so each adds a few integers to an array whose second cumulative sum is f.
"""
from __future__ import annotations

import csv
from collections import Counter
from pathlib import Path
from typing import Dict, List, Tuple, Union

import numpy as np

from posbench.core.io import atomic_path
from posbench.core.plots import plain_log_y, plain_number, pyplot, save_figure
from posbench.runs.extend import pose_draws
from posbench.runs.lengths import window_steps

PLOT, TABLE = "position_frequency.png", "position_frequency.csv"


def add_sequences(kinks: np.ndarray, n, count) -> None:
    """`count` sequences of n tokens: n - i pairs at i = 0..n-1, the kinks n at 0, -(n + 1) at 1
    and 1 at n + 1 (n, count: numbers or arrays of them, a negative count taking them off)."""
    n, count = np.asarray(n, dtype=np.int64), np.asarray(count, dtype=np.int64)
    kinks[0] += (n * count).sum()
    kinks[1] -= ((n + 1) * count).sum()
    np.add.at(kinks, n + 1, np.broadcast_to(count, n.shape))


def add_across(kinks: np.ndarray, m, n, skip) -> None:
    """The pairs of a key among m tokens and a query among the n tokens right after them, whose
    positions lie `skip` further on (arrays, one entry per such split): min(m, n, i - skip,
    m + n - i + skip) pairs at i = skip + 1 .. skip + m + n - 1, a trapezoid of four kinks."""
    start = skip + 1
    for at, sign in ((start, 1), (start + m, -1), (start + n, -1), (start + m + n, 1)):
        kinks += sign * np.bincount(at, minlength=len(kinks))


def trained_sequences(record: dict) -> Union[Counter, str]:
    """{length: count} of the token sequences a finished run attended within, or why it is not
    derived."""
    t, config = record["train"], record.get("config", {}).get("train", {})
    if "steps" not in t or "batch_size" not in config:
        return "results.json holds no train.steps or train.batch_size"
    if config.get("pack_documents", False):
        if "segment_lengths" not in t:
            return ("train.pack_documents=True: results.json holds no train.segment_lengths (a "
                    "run trained, or resumed from a checkpoint saved, before training counted it)")
        return Counter({int(n): count for n, count in t["segment_lengths"].items()})
    rows, length = config["batch_size"], t["seq_len"]
    sequences = Counter()
    for window, steps in window_steps(t["steps"], config).items():
        sequences[window] += steps * rows * (length // window)
        if length % window:
            sequences[length % window] += steps * rows
    return sequences


def add_pose(kinks: np.ndarray, record: dict) -> None:
    """PoSE's skips, over the sequences of trained_sequences: in each row, the sequence (tokens
    a..b-1, its window) that PoSE's second chunk starts inside, at token r > a, is two, of r - a
    and b - r tokens, and the pairs across them lie the row's skip u further apart."""
    t, config = record["train"], record["config"]["train"]
    rows, length = config["batch_size"], t["seq_len"]
    draws = [pose_draws(record["config"]["seed"], step, rows, length, config["pose_span"])
             for step in range(t["steps"])]
    first, skip = (np.concatenate([d[i] for d in draws]) for i in (0, 1))
    windows = window_steps(t["steps"], config)  # in step order: one per row of each step
    window = np.repeat(list(windows), [steps * rows for steps in windows.values()])
    split = first % window != 0
    r, u, w = first[split], skip[split], window[split]
    a = r // w * w
    b = np.minimum(a + w, length)
    add_sequences(kinks, b - a, -1)
    add_sequences(kinks, r - a, 1)
    add_sequences(kinks, b - r, 1)
    add_across(kinks, r - a, b - r, u)


def frequency(record: dict) -> Union[List[int], str]:
    """f(i), i = 0 .. the longest distance trained, of a finished run, or why it is not
    derived."""
    sequences = trained_sequences(record)
    if isinstance(sequences, str):
        return sequences
    if not sum(sequences.values()):
        return "it trained no step"
    span = record["config"]["train"].get("pose_span")
    kinks = np.zeros(max(span or 0, *sequences) + 2, dtype=np.int64)
    add_sequences(kinks, list(sequences), list(sequences.values()))
    if span:
        add_pose(kinks, record)
    f = np.cumsum(np.cumsum(kinks))
    return f[:np.flatnonzero(f)[-1] + 1].tolist()


def write(root: Path, runs: Dict[str, dict], ppl: Dict[str, Dict[int, float]]
          ) -> Tuple[bool, List[str]]:
    """position_frequency.png and .csv of each group (`runs`: its first run; `ppl`: its mean
    perplexity by length): whether they were written (not when no group is left), and a line per
    group left out."""
    drawn, left_out = {}, []
    for label, record in runs.items():
        counts = frequency(record)
        if isinstance(counts, str):
            left_out.append(f"- {label}: {counts}")
        else:
            drawn[label] = counts
    if not drawn:
        return False, left_out
    with atomic_path(root / TABLE) as tmp, open(tmp, "w", newline="") as f:
        out = csv.writer(f)
        out.writerow(["label", "distance", "pairs"])
        for label, counts in drawn.items():
            out.writerows([label, i, n] for i, n in enumerate(counts))
    plot({label: ppl[label] for label in drawn if label in ppl}, drawn, root / PLOT)
    return True, left_out


def plot(ppl: Dict[str, Dict[int, float]], drawn: Dict[str, List[int]], path: Path) -> None:
    """Perplexity against the evaluation length (left) beside f(i) against the distance i
    (right), both on log axes over the same range of tokens, so that the lengths where
    perplexity grows line up with the distances training saw rarely or never."""
    plt = pyplot()
    fig, (left, right) = plt.subplots(1, 2, figsize=(12, 4.5), sharex=True)
    for label, by_length in ppl.items():
        lengths = sorted(by_length)
        left.plot(lengths, [by_length[n] for n in lengths], marker="o", label=label)
    for label, counts in drawn.items():
        # i = 0 (each token with itself) has no place on a log axis: from distance 1
        right.plot(range(1, len(counts)), counts[1:], label=label)
        right.axvline(len(counts), color="grey", linestyle=":", linewidth=0.8)
    right.set_yscale("log")
    left.set_xscale("log")
    shortest = min((n for by_length in ppl.values() for n in by_length), default=16)
    left.set_xlim(left=max(1, shortest / 16))  # a few octaves of distances below L
    left.set_xlabel("evaluation length (tokens)")
    left.set_ylabel("perplexity")
    right.set_xlabel("relative distance i (positions); dotted: past the longest trained")
    right.set_ylabel("f(i): trained query-key pairs at distance i")
    left.set_title("perplexity vs length")
    right.set_title("position frequency f(i) of training (STRING)")
    if ppl:
        plain_log_y(left)
    from matplotlib.ticker import FuncFormatter

    left.xaxis.set_major_formatter(FuncFormatter(lambda v, _: plain_number(v)))
    right.legend(loc="upper right", fontsize=8, frameon=False)
    save_figure(plt, fig, path)
