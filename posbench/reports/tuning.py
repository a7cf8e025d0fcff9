"""Learning rates tuned per group. One learning rate for every encoding is itself a choice: when a
folder's runs sweep `train.lr`, the groups that differ only by it form a family (one encoding
with its other settings), and the report also reads each family at its own best rate.

The best rate is chosen on the validation loss at the training length (metrics.csv's last
`val_loss`: the run's fixed validation windows, mean over seeds), never on the evaluated lengths
being compared. summary.md then ranks the families by their log-ppl growth past L twice, at the
tuned rates and at the rate they all share (posbench's default where every family ran it), and
says whether the order changed.
"""
from __future__ import annotations

import re
from collections import defaultdict
from pathlib import Path
from typing import Callable, Dict, List, Optional

from posbench.config import TrainConfig
from posbench.runs.trainlog import METRICS, read_metrics

LR = re.compile(r"(?:, )?(?:train\.)?lr=[^,\]]+")


def family_of(label: str) -> str:
    """A group's label without its learning rate: `rope [seq_len=64, lr=0.001]` -> `rope
    [seq_len=64]`."""
    text = LR.sub("", label).replace("[, ", "[")
    return text.replace(" []", "")


def validation_loss(run: dict) -> Optional[float]:
    """The run's last validation loss at the training length (metrics.csv); None without one."""
    path = Path(run["_dir"]) / METRICS
    if not path.is_file():
        return None
    losses = [row["val_loss"] for row in read_metrics(path) if row.get("val_loss") is not None]
    return losses[-1] if losses else None


def _mean(values: List[Optional[float]]) -> Optional[float]:
    values = [v for v in values if v is not None]
    return sum(values) / len(values) if values else None


def shared_rate(by_family: Dict[str, Dict[float, str]],
                val: Dict[str, Optional[float]]) -> Optional[float]:
    """The rate the shared-rate verdict reads: posbench's default where every family ran it,
    else the rate every family ran with the lowest mean validation loss over the families."""
    common = set.intersection(*(set(rates) for rates in by_family.values()))
    if TrainConfig.lr in common:
        return TrainConfig.lr
    mean = {lr: _mean([val[rates[lr]] for rates in by_family.values()]) for lr in common}
    scored = {lr: m for lr, m in mean.items() if m is not None}
    return min(scored, key=scored.get) if scored else None


def report_lines(groups: Dict[str, List[dict]], growth: Callable[[str], Optional[float]],
                 ppl_at_train: Callable[[str], Optional[float]]) -> List[str]:
    """summary.md's section on tuned rates: per family, the validation loss at each rate, the
    chosen rate and its headline beside the shared rate's; nothing when no family has two
    rates. `groups`: label -> its runs (trained groups only); `growth` and `ppl_at_train`: a
    label's log-ppl growth past L and perplexity at L."""
    by_family: Dict[str, Dict[float, str]] = defaultdict(dict)
    for label, members in groups.items():
        lr = members[0]["config"].get("train", {}).get("lr")
        if lr is not None:
            by_family[family_of(label)][lr] = label
    by_family = {f: rates for f, rates in by_family.items() if len(rates) > 1}
    if not by_family:
        return []
    val = {label: _mean([validation_loss(r) for r in groups[label]])
           for rates in by_family.values() for label in rates.values()}
    shared = shared_rate(by_family, val)
    tuned = {}
    for family, rates in by_family.items():
        scored = {lr: val[label] for lr, label in rates.items() if val[label] is not None}
        if scored:
            tuned[family] = rates[min(scored, key=scored.get)]
    fmt = lambda x, spec: "—" if x is None else format(x, spec)
    lines = ["", "Learning rate tuned per group: each family (the groups that differ only by "
             "train.lr) at the rate with the lowest validation loss at the training length "
             "(metrics.csv, mean over seeds; the evaluated lengths play no part), beside the "
             "rate every family shares" + (f" ({shared:g})" if shared is not None else
                                          " (none is shared)") + ".", "",
             "| family | validation loss at L by rate | tuned rate | ppl at L | log-ppl growth "
             "past L | at the shared rate: ppl at L | log-ppl growth past L |",
             "|---|---|---:|---:|---:|---:|---:|"]
    for family, rates in sorted(by_family.items()):
        losses = ", ".join(f"{lr:g}: {fmt(val[label], '.4f')}"
                           for lr, label in sorted(rates.items()))
        best = tuned.get(family)
        base = rates.get(shared) if shared is not None else None
        lines.append(
            f"| {family} | {losses} | "
            + (f"{groups[best][0]['config']['train']['lr']:g}" if best else "—")
            + f" | {fmt(best and ppl_at_train(best), '.3f')}"
            + f" | {fmt(best and growth(best), '+.3f')}"
            + f" | {fmt(base and ppl_at_train(base), '.3f')}"
            + f" | {fmt(base and growth(base), '+.3f')} |")

    def order(pick: Dict[str, Optional[str]]) -> List[str]:
        known = {f: growth(label) for f, label in pick.items() if label is not None}
        return sorted((f for f, g in known.items() if g is not None), key=known.get)

    tuned_order = order(tuned)
    shared_order = order({f: rates.get(shared) for f, rates in by_family.items()}
                         if shared is not None else {})
    lines += ["", "Ordered by log-ppl growth past L (least first): tuned "
              + " < ".join(tuned_order) + (f"; at {shared:g} " + " < ".join(shared_order)
                                           if shared_order else "")
              + ("; the same order" if tuned_order == shared_order
                 else "; the order changes with tuning" if shared_order else "") + "."]
    return lines
