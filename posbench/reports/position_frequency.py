"""STRING's position-frequency diagnostic (An et al., ICLR 2025, "Why Does the Effective Context
Length of LLMs Fall Short?", section 2): f(i) = sum over the training sequences s of
max(|s| - i, 0), the number of (query, key) pairs at relative distance i that training scored.
Causal attention over a sequence of n tokens holds n - i pairs at distance i (i = 0: each token
with itself), so f falls linearly to 0 at the longest trained sequence: the distances near it are
the rarest, which the paper ties to effective lengths below the training length.

The report draws f(i) of each group's training beside its perplexity curve
(position_frequency.png) and writes its values (position_frequency.csv).

The training sequences come from `trained_sequences`, the one place that knows how training
formed its batches. Today that is train.batch_size windows of train.seq_len tokens per step,
read from results.json; a run that cut its rows (a length schedule, document packing) or moved
its positions (PoSE) is left out with the reason, until its per-step lengths are read from the
function its training takes them from.
"""
from __future__ import annotations

import csv
from collections import Counter
from pathlib import Path
from typing import Dict, List, Mapping, Optional, Tuple, Union

from posbench.core.io import atomic_path
from posbench.core.plots import plain_log_y, plain_number, pyplot, save_figure

PLOT, TABLE = "position_frequency.png", "position_frequency.csv"
# config keys under which training's sequences are not train.batch_size windows of train.seq_len
# tokens attending to each other at positions 0..L-1, with the value that leaves them so
RESHAPING = {"length_schedule": "none", "pack_documents": False, "pose_span": None}


def pair_frequency(lengths: Mapping[int, int], longest: Optional[int] = None) -> List[int]:
    """f(i), i = 0 .. longest - 1 (default: the longest sequence), from {sequence length: how
    many sequences of that length}."""
    longest = max(lengths, default=0) if longest is None else longest
    return [sum(count * max(n - i, 0) for n, count in lengths.items()) for i in range(longest)]


def trained_sequences(record: dict) -> Union[Counter, str]:
    """{length: count} of the sequences a finished run trained on, or why it is not derived."""
    t, config = record["train"], record.get("config", {}).get("train", {})
    for key, plain in RESHAPING.items():
        if config.get(key, plain) != plain:
            return (f"train.{key}={config[key]}: its sequences are not yet read from the "
                    "batches training formed")
    if "steps" not in t or "batch_size" not in config:
        return "results.json holds no train.steps or train.batch_size"
    return Counter({t["seq_len"]: t["steps"] * config["batch_size"]})


def write(root: Path, runs: Dict[str, dict], ppl: Dict[str, Dict[int, float]]
          ) -> Tuple[bool, List[str]]:
    """position_frequency.png and .csv of each group (`runs`: its first run; `ppl`: its mean
    perplexity by length): whether they were written (not when no group is left), and a line per
    group left out."""
    frequency, left_out = {}, []
    for label, record in runs.items():
        sequences = trained_sequences(record)
        if isinstance(sequences, str):
            left_out.append(f"- {label}: {sequences}")
        else:
            frequency[label] = pair_frequency(sequences)
    if not frequency:
        return False, left_out
    with atomic_path(root / TABLE) as tmp, open(tmp, "w", newline="") as f:
        out = csv.writer(f)
        out.writerow(["label", "distance", "pairs"])
        for label, counts in frequency.items():
            out.writerows([label, i, n] for i, n in enumerate(counts))
    plot({label: ppl[label] for label in frequency if label in ppl}, frequency, root / PLOT)
    return True, left_out


def plot(ppl: Dict[str, Dict[int, float]], frequency: Dict[str, List[int]], path: Path) -> None:
    """Perplexity against the evaluation length (left) beside f(i) against the distance i
    (right), both on log axes over the same range of tokens, so that the lengths where
    perplexity grows line up with the distances training saw rarely or never."""
    plt = pyplot()
    fig, (left, right) = plt.subplots(1, 2, figsize=(12, 4.5), sharex=True)
    for label, by_length in ppl.items():
        lengths = sorted(by_length)
        left.plot(lengths, [by_length[n] for n in lengths], marker="o", label=label)
    for label, counts in frequency.items():
        # i = 0 (each token with itself) has no place on a log axis: from distance 1
        right.plot(range(1, len(counts)), counts[1:], label=label)
        right.axvline(len(counts), color="grey", linestyle=":", linewidth=0.8)
    right.set_yscale("log")
    left.set_xscale("log")
    shortest = min((n for by_length in ppl.values() for n in by_length), default=16)
    left.set_xlim(left=max(1, shortest / 16))  # a few octaves of distances below L
    left.set_xlabel("evaluation length (tokens)")
    left.set_ylabel("perplexity")
    right.set_xlabel("relative distance i (tokens); dotted: the training length")
    right.set_ylabel("f(i): trained query-key pairs at distance i")
    left.set_title("perplexity vs length")
    right.set_title("position frequency f(i) of training (STRING)")
    if ppl:
        plain_log_y(left)
    from matplotlib.ticker import FuncFormatter

    left.xaxis.set_major_formatter(FuncFormatter(lambda v, _: plain_number(v)))
    right.legend(loc="upper right", fontsize=8, frameon=False)
    save_figure(plt, fig, path)
