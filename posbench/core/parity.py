"""Parity at the training length: an extrapolation ratio compares encodings only when they were
trained comparably well, so every report shows each group's gap to the best perplexity at the
training length and marks the groups that trail it by more than PARITY_TOLERANCE.

gap = ppl_group(L) / min over groups of ppl(L) - 1, among groups trained at the same length L.
With seeds, the band of the gap is the 95% interval of the group's mean ppl(L) over the same
best mean: the uncertainty of the group, the best taken as the reference.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Dict, List, Optional

PARITY_TOLERANCE = 0.15
UNDER_TRAINED = (f"under-trained: more than {PARITY_TOLERANCE:.0%} behind the best perplexity "
                 "at the training length, so its extrapolation ratio is not comparable; where "
                 "the gap is one of training speed, as for the absolute encodings and NoPE, more "
                 "optimizer steps close it (`train.steps=`; docs/results.md, Parity on text "
                 "nobody tuned on)")


def ppl_at(curve: List[dict], length: int) -> Optional[float]:
    """The perplexity of a run's curve at `length`; None when that point is missing or OOM."""
    return next((p["ppl"] for p in curve if p["length"] == length and "ppl" in p), None)


@dataclass(frozen=True)
class Gap:
    gap: float  # relative to the best group at the same training length, 0 for the best
    band: float  # 95% interval of the gap over seeds, 0 with one seed
    best: str  # label of the best group

    @property
    def under_trained(self) -> bool:
        return self.gap > PARITY_TOLERANCE

    def cell(self) -> str:
        text = f"+{self.gap:.1%}" + (f" ± {self.band:.1%}" if self.band else "")
        return text + (" under-trained" if self.under_trained else "")


def parity_gaps(table: Dict[str, Dict[int, dict]], train_of: Dict[str, int]) -> Dict[str, Gap]:
    """label -> Gap, from report.aggregate's ppl table (label -> length -> {mean, ci95}) and each
    label's training length. Labels without a point at their training length get no gap."""
    at_train = {label: by_length[train_of[label]] for label, by_length in table.items()
                if train_of[label] in by_length}
    gaps = {}
    for label, stats in at_train.items():
        peers = [p for p in at_train if train_of[p] == train_of[label]]
        best = min(peers, key=lambda p: at_train[p]["mean"])
        reference = at_train[best]["mean"]
        gaps[label] = Gap(stats["mean"] / reference - 1, stats["ci95"] / reference, best)
    return gaps
