"""Published claims, each judged on measured numbers: `judge(measured) -> (verdict, detail)`.

A claim states what the paper says in one line, the tolerance it is judged under and why that
tolerance (`why`). It reads a Measured table: group -> x -> value, x a length as a multiple of
the training length (x = 1 is L) or a model size in parameters. Verdicts:

- reproduced: the measured numbers say what the paper says, within the tolerance;
- not reproduced: they say otherwise by more than the tolerance;
- not comparable at this scale: they cannot say (absolute values of a reduced setting, a group
  under-trained at L, no measured point where the claim looks, a difference inside the noise).
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Dict, List, Optional, Tuple

from posbench.reports.by_size import size_label
from posbench.reports.paired import Paired, paired

REPRODUCED, NOT_REPRODUCED, NOT_COMPARABLE = ("reproduced", "not reproduced",
                                              "not comparable at this scale")
VERDICTS = (REPRODUCED, NOT_REPRODUCED, NOT_COMPARABLE)
# the why of a Below claim with no margin, which entries complete with their paper's gaps
PAIRED_WHY = ("each pair is judged paired, on the same windows and seeds (posbench/reports/"
              "paired.py), no margin added: a 95% interval that holds no difference is a tie the "
              "seeds and windows cannot resolve")


@dataclass(frozen=True)
class Measured:
    """values: group -> x -> value (perplexity); a point that was not measured (OOM) is absent.
    at_paper_scale: whether the numbers come from the paper's setting (the paper's own numbers,
    or an entry that runs at it), so that absolute values may be compared. spread: group -> x ->
    the 95% half-width of the mean over seeds (t-interval; 0 for one seed), where known. runs:
    group -> its results.json records, and lengths: group -> x -> the evaluated length it is,
    for paired comparisons (compare). score: what an accuracy claim's values are, named in its
    verdict."""
    values: Dict[str, Dict[float, float]]
    at_paper_scale: bool
    spread: Dict[str, Dict[float, float]] = field(default_factory=dict)
    runs: Dict[str, List[dict]] = field(default_factory=dict)
    lengths: Dict[str, Dict[float, int]] = field(default_factory=dict)
    score: str = "exact match"

    def compare(self, a: str, b: str, x: float) -> Optional[Paired]:
        """Group a against group b at x on the same windows and seeds; None where they were not
        scored at one length there or hold no per-window losses."""
        length = self.lengths.get(a, {}).get(x)
        if length is None or self.lengths.get(b, {}).get(x) != length:
            return None
        return paired(self.runs.get(a, []), self.runs.get(b, []), length)

    def present(self, groups: Tuple[str, ...]) -> List[str]:
        return [g for g in groups if self.values.get(g)]

    def common(self, groups: List[str]) -> List[float]:
        """The xs where every group has a value, ascending."""
        xs = set.intersection(*(set(self.values[g]) for g in groups)) if groups else set()
        return sorted(xs)


def score_name(key: str) -> str:
    """A results.json score key as a verdict names it (Measured.score): exact_match, exact match."""
    return key.replace("_", " ")


def pct(x: float) -> str:
    return f"{x:+.1%}"


def x_text(x: float) -> str:
    """A length ratio as `8L`, a model size as `125M`."""
    return f"{x:.3g}L" if x < 1000 else size_label(x)


@dataclass(frozen=True)
class Claim:
    name: str
    statement: str  # the paper's claim, one line
    tolerance: float
    why: str  # the tolerance's justification
    unit: str = field(default="relative", kw_only=True)  # how tolerance reads: relative, nats

    def tolerance_text(self) -> str:
        return (f"{self.tolerance:g} nats" if self.unit == "nats"
                else f"{self.tolerance:.0%}" if self.unit == "relative" else f"{self.tolerance:g}")

    def judge(self, measured: Measured) -> Tuple[str, str]:
        raise NotImplementedError


def unmeasured(groups: Tuple[str, ...], present: List[str]) -> str:
    """`; not measured: t5` for the groups a claim names that have no numbers."""
    missing = [g for g in groups if g not in present]
    return f"; not measured: {', '.join(missing)}" if missing else ""


@dataclass(frozen=True)
class WithinBest(Claim):
    """Every group within `tolerance` (relative) of the best group at x = `at` (every shared x
    when None). absolute: the claim is about absolute values, which a reduced setting cannot
    compare with the paper's."""
    groups: Tuple[str, ...] = ()
    at: Optional[float] = 1.0
    absolute: bool = False

    def judge(self, m: Measured) -> Tuple[str, str]:
        groups = m.present(self.groups)
        if self.absolute and not m.at_paper_scale:
            return NOT_COMPARABLE, ("a claim about absolute perplexity, measured here at a reduced "
                                    "setting whose perplexities are not the paper's")
        if len(groups) < 2:
            return NOT_COMPARABLE, f"fewer than two of {', '.join(self.groups)} were measured"
        xs = [self.at] if self.at is not None else m.common(groups)
        worst = None  # (gap, group, best, x)
        for x in xs:
            values = {g: m.values[g][x] for g in groups if x in m.values[g]}
            if len(values) < 2:
                continue
            best = min(values, key=values.get)
            for g, v in values.items():
                gap = v / values[best] - 1
                if worst is None or gap > worst[0]:
                    worst = (gap, g, best, x)
        if worst is None:
            return NOT_COMPARABLE, "no point where two of the groups were both measured"
        gap, g, best, x = worst
        where = "" if self.at == 1.0 else f" at {x_text(x)}"
        detail = (f"largest gap: {g} {pct(gap)} behind {best}{where} (tolerance "
                  f"{self.tolerance_text()}){unmeasured(self.groups, groups)}")
        return (REPRODUCED if gap <= self.tolerance else NOT_REPRODUCED), detail


@dataclass(frozen=True)
class OrderPast(Claim):
    """Past `past`·L the groups degrade in `order` (worst first): each group's log-ppl growth,
    the mean over the lengths x > past that every group shares of ln(ppl(x)/ppl(L)), is at least
    the next group's minus `tolerance` (nats). Groups more than `parity` behind the best at L
    make the ratios not comparable (posbench/core/parity.py)."""
    order: Tuple[str, ...] = ()
    past: float = 2.0
    parity: float = 0.15

    def judge(self, m: Measured) -> Tuple[str, str]:
        groups = [g for g in m.present(self.order) if 1.0 in m.values[g]]
        if len(groups) < 2:
            return NOT_COMPARABLE, f"fewer than two of {', '.join(self.order)} were measured at L"
        at_l = {g: m.values[g][1.0] for g in groups}
        best = min(at_l.values())
        behind = {g: v / best - 1 for g, v in at_l.items() if v / best - 1 > self.parity}
        if behind:
            return NOT_COMPARABLE, ("under-trained at L, so its ratios are not comparable: "
                                    + ", ".join(f"{g} {pct(gap)} behind the best"
                                                for g, gap in behind.items())
                                    + f" (parity tolerance {self.parity:.0%})")
        xs = [x for x in m.common(groups) if x > self.past * (1 + 1e-9)]
        if not xs:
            return NOT_COMPARABLE, (f"no length past {self.past:g}L was measured for all of "
                                    + ", ".join(groups))
        growth = {g: sum(math.log(m.values[g][x] / at_l[g]) for x in xs) / len(xs)
                  for g in groups}
        shown = " > ".join(f"{g} {growth[g]:+.3f}" for g in groups)
        inverted = [(a, b) for a, b in zip(groups, groups[1:])
                    if growth[a] < growth[b] - self.tolerance]
        ties = [(a, b) for a, b in zip(groups, groups[1:])
                if growth[b] - self.tolerance <= growth[a] < growth[b]]
        where = ", ".join(x_text(x) for x in xs)
        detail = f"log-ppl growth over {where}: {shown}"
        if inverted:
            return NOT_REPRODUCED, (
                detail + unmeasured(self.order, groups) + "; out of order beyond the tolerance: "
                + ", ".join(f"{b} worse than {a} by {growth[b] - growth[a]:.3f}"
                            for a, b in inverted))
        if ties:
            detail += "; inverted within the tolerance (a tie here): " + ", ".join(
                f"{a}/{b}" for a, b in ties)
        return REPRODUCED, (detail + f" (tolerance {self.tolerance_text()})"
                            + unmeasured(self.order, groups))


@dataclass(frozen=True)
class RatioNear(Claim):
    """A claim on ppl(x)/ppl(L) of `group`, x the measured length nearest to `at`·L (within a
    factor of 1.5); `read(ratio) -> (holds, detail)` says what the claim accepts."""
    group: str = "alibi"
    at: float = 8.0

    def read(self, ratio: float) -> Tuple[bool, str]:
        raise NotImplementedError

    def judge(self, m: Measured) -> Tuple[str, str]:
        values = m.values.get(self.group, {})
        near = [x for x in values if x > 1 and abs(math.log(x / self.at)) <= math.log(1.5)]
        if 1.0 not in values or not near:
            return NOT_COMPARABLE, f"{self.group} was not measured at L and near {self.at:.3g}L"
        x = min(near, key=lambda x: abs(math.log(x / self.at)))
        ratio = values[x] / values[1.0]
        holds, detail = self.read(ratio)
        return ((REPRODUCED if holds else NOT_REPRODUCED),
                f"{self.group}: ppl({x:.3g}L)/ppl(L) = {ratio:.3f}, {detail}")


@dataclass(frozen=True)
class FlatAt(RatioNear):
    """The ratio at most `most` + tolerance."""
    most: float = 1.0

    def read(self, ratio: float) -> Tuple[bool, str]:
        return (ratio <= self.most + self.tolerance,
                f"at most {self.most:g} + {self.tolerance:g} accepted")


@dataclass(frozen=True)
class RatioAt(RatioNear):
    """How fast an encoding degrades, where the order alone would pass a curve that rises three
    times as fast, or not at all: the log-growth ln(ratio) within `tolerance` (relative) of the
    paper's ln(`ratio`), which is not 1. On the growth, not the ratio: a ratio within 25% of the
    paper's 1.32 would admit a flat curve, which has none of its growth."""
    ratio: float = 2.0

    def read(self, ratio: float) -> Tuple[bool, str]:
        off = math.log(ratio) / math.log(self.ratio) - 1
        return (abs(off) <= self.tolerance, f"log-growth {math.log(ratio):.3f} against the "
                f"paper's {math.log(self.ratio):.3f} ({self.ratio:.3f}) at {self.at:.3g}L "
                f"({pct(off)}; tolerance {self.tolerance_text()})")


@dataclass(frozen=True)
class BestAtEvery(Claim):
    """`group` has the lowest value at every x the groups share, or is within `tolerance`
    (relative) of the lowest."""
    group: str = "alibi"
    others: Tuple[str, ...] = ()

    def judge(self, m: Measured) -> Tuple[str, str]:
        others = m.present(self.others)
        if not m.values.get(self.group) or not others:
            return NOT_COMPARABLE, f"{self.group} and another group were not both measured"
        xs = m.common([self.group, *others])
        if not xs:
            return NOT_COMPARABLE, "no point where they were all measured"
        worst = max(((m.values[self.group][x] / min(m.values[o][x] for o in others) - 1, x)
                     for x in xs))
        detail = (f"{self.group} against the best other group: at worst {pct(worst[0])} at "
                  f"{x_text(worst[1])} (tolerance {self.tolerance_text()})")
        return (REPRODUCED if worst[0] <= self.tolerance else NOT_REPRODUCED), detail


@dataclass(frozen=True)
class GapShrinks(Claim):
    """`group`'s relative gap to `reference` at L is smaller at the largest size than at the
    smallest: gap(largest) <= (1 - tolerance) * gap(smallest) is reproduced, a gap that does not
    shrink is not, a shrink smaller than the tolerance is inside the noise (not comparable)."""
    group: str = "nope"
    reference: str = "learned"

    def judge(self, m: Measured) -> Tuple[str, str]:
        if not (m.values.get(self.group) and m.values.get(self.reference)):
            return NOT_COMPARABLE, f"{self.group} and {self.reference} were not both measured"
        xs = m.common([self.group, self.reference])
        if len(xs) < 2:
            return NOT_COMPARABLE, "fewer than two model sizes were measured for both"
        gap = {x: m.values[self.group][x] / m.values[self.reference][x] - 1 for x in xs}
        small, large = gap[xs[0]], gap[xs[-1]]
        detail = (f"{self.group}'s gap to {self.reference} at L: {pct(small)} at the smallest "
                  f"size, {pct(large)} at the largest")
        if small <= 0:
            return NOT_COMPARABLE, detail + f"; {self.group} is not behind at the smallest size"
        if large <= 0:
            return REPRODUCED, detail + f" ({self.group} is no longer behind at the largest)"
        if large <= (1 - self.tolerance) * small:
            return REPRODUCED, detail + f" (shrinks by {1 - large / small:.0%}, at least " \
                                        f"{self.tolerance:.0%} needed)"
        if large >= small:
            return NOT_REPRODUCED, detail + " (it does not shrink)"
        return NOT_COMPARABLE, detail + (f" (shrinks by {1 - large / small:.0%}, less than the "
                                         f"{self.tolerance:.0%} that the noise allows)")


def task_group(task: str, encoding: str) -> str:
    """The group of a task's runs of one encoding: `copy/nope`."""
    return f"{task}/{encoding}"


def run_task_group(record: dict, row: str) -> str:
    """task_group of a task's run: its task is its dataset's name without `task_`."""
    return task_group(record["dataset"]["name"].removeprefix("task_"), row)


@dataclass(frozen=True)
class AccuracyIn(Claim):
    """Exact-match accuracy of each of `groups` at every measured x in [low, high] is at least
    `least`, or at most `most`, within `tolerance` (accuracy points). learned: the accuracy at L
    below which a group has not learned the task, so that what it does past L is not comparable
    (None: the claim is about L itself)."""
    groups: Tuple[str, ...] = ()
    low: float = 1.0
    high: float = 1.0
    least: Optional[float] = None
    most: Optional[float] = None
    learned: Optional[float] = 0.95
    unit: str = field(default="accuracy", kw_only=True)

    def judge(self, m: Measured) -> Tuple[str, str]:
        if self.learned is not None:
            unlearned = [f"{g} {m.values[g][1.0]:.3f}" for g in m.present(self.groups)
                         if m.values[g].get(1.0, 0.0) < self.learned]
            if unlearned:
                return NOT_COMPARABLE, (f"not learned at L ({m.score} under "
                                        f"{self.learned:g}): {', '.join(unlearned)}")
        points = [(g, x, m.values[g][x]) for g in m.present(self.groups)
                  for x in sorted(m.values[g]) if self.low - 1e-9 <= x <= self.high + 1e-9]
        if not points:
            return NOT_COMPARABLE, (f"none of {', '.join(self.groups)} was measured between "
                                    f"{x_text(self.low)} and {x_text(self.high)}")
        if self.least is not None:
            g, x, v = min(points, key=lambda p: p[2])
            holds, bound = v >= self.least - self.tolerance, f"at least {self.least:g}"
        else:
            g, x, v = max(points, key=lambda p: p[2])
            holds, bound = v <= self.most + self.tolerance, f"at most {self.most:g}"
        detail = (f"{'lowest' if self.least is not None else 'highest'}: {g} {v:.3f} at "
                  f"{x_text(x)} ({bound} within {self.tolerance:g} accepted)"
                  f"{unmeasured(self.groups, m.present(self.groups))}")
        return (REPRODUCED if holds else NOT_REPRODUCED), detail


@dataclass(frozen=True)
class AheadAt(Claim):
    """In each of `tasks`, `task/group`'s score (Measured.score) at x = `at` is above the best
    of its `rivals` (`task/<rival>`) by more than the band: `tolerance` (accuracy points) plus
    the two groups' seed bands (Measured.spread) combined in quadrature. tie: the claim is "best
    or tied-best", so a gap inside the band holds too.

    A score past L says nothing about length for a model that cannot do the task at L: a task
    where the group's score at x = 1 is under `learned` is not comparable, and a rival
    under it is left out and named (a task with no rival left is not comparable). Verdict over
    the tasks: any task behind beyond its band is not reproduced; else any task not comparable,
    or inside its band without `tie`, leaves the claim not comparable; else reproduced."""
    group: str = "drope"
    rivals: Tuple[str, ...] = ()
    tasks: Tuple[str, ...] = ()
    at: float = 2.0
    tie: bool = False
    learned: Optional[float] = 0.5
    unit: str = field(default="accuracy", kw_only=True)

    def judge(self, m: Measured) -> Tuple[str, str]:
        parts, ahead, behind, open_ = [], 0, 0, 0
        for task in self.tasks:
            mine = task_group(task, self.group)
            row = m.values.get(mine, {})
            if self.at not in row:
                parts.append(f"{task}: {self.group} not measured at {x_text(self.at)}")
                open_ += 1
                continue
            if self.learned is not None and row.get(1.0, 0.0) < self.learned:
                parts.append(f"{task}: {self.group} not learned at L ({row.get(1.0, 0.0):.3f} "
                             f"under {self.learned:g})")
                open_ += 1
                continue
            scores, left_out, absent = {}, [], []
            for rival in self.rivals:
                theirs = m.values.get(task_group(task, rival), {})
                if self.at not in theirs:
                    absent.append(rival)
                elif self.learned is not None and theirs.get(1.0, 0.0) < self.learned:
                    left_out.append(f"{rival} {theirs.get(1.0, 0.0):.3f}")
                else:
                    scores[rival] = theirs[self.at]
            notes = ((f"; not learned at L, left out: {', '.join(left_out)}" if left_out else "")
                     + (f"; not measured: {', '.join(absent)}" if absent else ""))
            if not scores:
                parts.append(f"{task}: no rival of {self.group} to compare with{notes}")
                open_ += 1
                continue
            best = max(scores, key=scores.get)
            gap = row[self.at] - scores[best]
            band = self.tolerance + math.hypot(
                m.spread.get(mine, {}).get(self.at, 0.0),
                m.spread.get(task_group(task, best), {}).get(self.at, 0.0))
            outcome, said = against_band(gap, band, self.tie)
            ahead, behind, open_ = (ahead + (outcome == "ahead"), behind + (outcome == "behind"),
                                    open_ + (outcome == "tie"))
            parts.append(f"{task}: {self.group} {row[self.at]:.3f} against {best} "
                         f"{scores[best]:.3f} ({gap:+.3f}, band ±{band:.3f}){said}{notes}")
        return tallied(ahead, behind, open_), (f"{m.score} at {x_text(self.at)}: "
                                               + "; ".join(parts))


def against_band(gap: float, band: float, tie: bool = False) -> Tuple[str, str]:
    """A group's gap to its best rival against the band: ("ahead", "") beyond it above, or inside
    it where a tie holds the claim (" tied"); ("behind", ...) beyond it below; else a tie that
    leaves the claim open. The second item is what the claim's detail adds."""
    if gap > band:
        return "ahead", ""
    if tie and gap >= -band:
        return "ahead", " tied"
    return ("behind", " behind beyond the band") if gap < -band else ("tie", " a tie")


def tallied(ahead: int, behind: int, open_: int) -> str:
    """A claim's verdict over its parts: any part behind beyond its band is not reproduced; any
    part open (not measured, or a tie), or none ahead, leaves it not comparable."""
    if behind:
        return NOT_REPRODUCED
    return NOT_COMPARABLE if open_ or not ahead else REPRODUCED


def reciprocal_ranks(scores: Dict[str, float]) -> Dict[str, float]:
    """1/rank of each score, the highest ranked 1; tied scores share the mean of their ranks."""
    ordered = sorted(scores.values(), reverse=True)
    out = {}
    for name, score in scores.items():
        first = ordered.index(score) + 1
        ties = ordered.count(score)
        out[name] = 1 / (first + (ties - 1) / 2)
    return out


def mean_reciprocal_ranks(m: Measured, tasks: Tuple[str, ...], encodings: Tuple[str, ...],
                          past: float, upto: float, learned: Optional[float] = None
                          ) -> Tuple[Dict[str, float], List[str], List[str]]:
    """Each encoding's mean over `tasks` of its reciprocal rank, a task ranking the encodings by
    their mean accuracy over the measured x in (past, upto]. Returns the ranks, the tasks not
    measured for every encoding, and (with `learned`) the tasks that no encoding learned at
    x = 1 (accuracy under `learned` for all): both are left out. A task nobody learned ranks the
    encodings by noise about chance, which says nothing about their positions."""
    skipped, unlearned = [], []
    ranks: Dict[str, List[float]] = {e: [] for e in encodings}
    for task in tasks:
        rows = {enc: m.values.get(task_group(task, enc), {}) for enc in encodings}
        scores = {}
        for enc, row in rows.items():
            xs = [x for x in row if past + 1e-9 < x <= upto + 1e-9]
            if xs:
                scores[enc] = sum(row[x] for x in xs) / len(xs)
        if len(scores) < len(encodings):
            skipped.append(task)
            continue
        if learned is not None and not any(row.get(1.0, 0.0) >= learned for row in rows.values()):
            unlearned.append(task)
            continue
        for enc, rr in reciprocal_ranks(scores).items():
            ranks[enc].append(rr)
    mrr = {e: sum(r) / len(r) for e, r in ranks.items() if r}
    return mrr, skipped, unlearned


@dataclass(frozen=True)
class RankOrder(Claim):
    """The encodings' mean reciprocal rank over `tasks` (mean_reciprocal_ranks, x in (past,
    upto]) falls in `order`: each at least the next minus `tolerance`. A rank over some of the
    tasks is shown but not comparable: a claim about a ranking over all of them. A task that no
    encoding learned at L (accuracy under `learned`) is left out and named: the rank is then
    over the tasks this scale can learn."""
    tasks: Tuple[str, ...] = ()
    order: Tuple[str, ...] = ()
    past: float = 1.0
    upto: float = 2.0
    learned: Optional[float] = field(default=0.95, kw_only=True)
    unit: str = field(default="mrr", kw_only=True)

    def judge(self, m: Measured) -> Tuple[str, str]:
        mrr, skipped, unlearned = mean_reciprocal_ranks(m, self.tasks, self.order, self.past,
                                                        self.upto, self.learned)
        left_out = (f"; left out, learned at L by no encoding (under {self.learned:g}): "
                    + ", ".join(unlearned) if unlearned else "")
        if not mrr:
            return NOT_COMPARABLE, ("no task was measured for every one of "
                                    + ", ".join(self.order) + f" past {x_text(self.past)}"
                                    + left_out)
        shown = " > ".join(f"{e} {mrr[e]:.2f}" for e in self.order)
        counted = len(self.tasks) - len(skipped) - len(unlearned)
        detail = f"MRR over {counted} task{'s' * (counted != 1)}: {shown}" + (
            f"; not measured for every encoding: {', '.join(skipped)}" if skipped else "")
        detail += left_out
        if skipped:
            return NOT_COMPARABLE, detail
        inverted = [(a, b) for a, b in zip(self.order, self.order[1:])
                    if mrr[a] < mrr[b] - self.tolerance]
        if inverted:
            return NOT_REPRODUCED, detail + "; out of order beyond the tolerance: " + ", ".join(
                f"{b} above {a} by {mrr[b] - mrr[a]:.2f}" for a, b in inverted)
        return REPRODUCED, detail + f" (tolerance {self.tolerance:g})"


@dataclass(frozen=True)
class Below(Claim):
    """`lower` has a lower perplexity than `higher` at x = `at`, told apart by the seeds. Judged
    paired, on the same windows and seeds (posbench/reports/paired.py): the ratio's 95% interval
    above 1 + `tolerance` is reproduced, below 1 not reproduced, across them not comparable;
    fewer than two shared seeds cannot say. Runs that hold no per-window losses (written before
    they were recorded) are judged by the two means' 95% bands combined (in quadrature,
    relative) instead."""
    lower: str = "p_rope"
    higher: str = "rope"
    at: float = 1.0

    def judge(self, m: Measured) -> Tuple[str, str]:
        a, b = m.values.get(self.lower, {}), m.values.get(self.higher, {})
        if self.at not in a or self.at not in b:
            return NOT_COMPARABLE, (f"{self.lower} and {self.higher} were not both measured at "
                                    f"{x_text(self.at)}")
        pair = m.compare(self.higher, self.lower, self.at)
        if pair is None:
            return self._by_bands(m, a, b)
        detail = (f"{self.higher} {pct(pair.ratio - 1)} against {self.lower} at "
                  f"{x_text(self.at)}, paired over {pair.seeds} seed{'s' * (pair.seeds > 1)} "
                  f"and {pair.windows} windows: 95% interval [{pct(pair.low - 1)}, "
                  f"{pct(pair.high - 1)}]")
        if pair.seeds < 2:
            return NOT_COMPARABLE, detail + " (one shared seed cannot say whether another agrees)"
        if pair.low > 1 + self.tolerance:
            return REPRODUCED, detail
        if pair.high < 1:
            return NOT_REPRODUCED, detail + f" ({self.lower} is the higher, beyond the interval)"
        return NOT_COMPARABLE, detail + " (the interval holds no difference: a tie)"

    def _by_bands(self, m: Measured, a: dict, b: dict) -> Tuple[str, str]:
        gap = math.log(b[self.at] / a[self.at])
        bands = [m.spread.get(g, {}).get(self.at, 0.0) / v[self.at]
                 for g, v in ((self.lower, a), (self.higher, b))]
        band = math.sqrt(sum(x * x for x in bands)) + self.tolerance
        detail = (f"{self.higher} {pct(math.exp(gap) - 1)} against {self.lower} at "
                  f"{x_text(self.at)}; seeds' 95% band of the difference ±{band:.1%} (no "
                  "per-window losses to pair)")
        if not all(bands):
            return NOT_COMPARABLE, detail + " (fewer than two seeds: no band)"
        if gap > band:
            return REPRODUCED, detail
        if gap < -band:
            return NOT_REPRODUCED, detail + f" ({self.lower} is the higher, beyond the band)"
        return NOT_COMPARABLE, detail + " (inside the band: the seeds cannot tell them apart)"


def gain_past(m: Measured, task: str, first: str, second: str, past: float = 1.0,
              upto: float = math.inf) -> Optional[float]:
    """The mean over the x in (past, upto] where `task/first` and `task/second` were both
    measured of second - first; None where there is no such x."""
    a = m.values.get(task_group(task, first), {})
    b = m.values.get(task_group(task, second), {})
    xs = [x for x in a if x in b and past + 1e-9 < x <= upto + 1e-9]
    return sum(b[x] - a[x] for x in xs) / len(xs) if xs else None


@dataclass(frozen=True)
class MeanGain(Claim):
    """The second group of each of `pairs` raises a task's accuracy past L over the first, on
    average: each task's gain is the mean over the x in (past, upto] where both `task/first` and
    `task/second` were measured of their difference (second - first), and the claim's gain the
    mean of those over `tasks` and `pairs`, at least `least` within `tolerance` (accuracy points).
    A gain at or below 0 is not reproduced; one between 0 and least - tolerance is inside the
    noise (not comparable). A task where either group is under `learned` at L is left out, its
    length generalization not readable; fewer than `min_tasks` counted for a pair is not
    comparable, and so is a pair with a task not measured past L (a mean over some of the tasks
    is another number)."""
    tasks: Tuple[str, ...] = ()
    pairs: Tuple[Tuple[str, str], ...] = ()
    past: float = 1.0
    upto: float = math.inf
    least: float = 0.0
    learned: Optional[float] = 0.95
    min_tasks: int = 1
    unit: str = field(default="accuracy", kw_only=True)

    def judge(self, m: Measured) -> Tuple[str, str]:
        gains: List[float] = []
        parts, unlearned, missing, short = [], [], [], []
        for first, second in self.pairs:
            counted, absent = {}, []
            for task in self.tasks:
                gain = gain_past(m, task, first, second, self.past, self.upto)
                if gain is None:
                    absent.append(task)
                    continue
                at_l = {g: m.values[task_group(task, g)].get(1.0, 0.0) for g in (first, second)}
                below = [f"{task_group(task, g)} {v:.3f}" for g, v in at_l.items()
                         if self.learned is not None and v < self.learned]
                if below:
                    unlearned += below
                    continue
                counted[task] = gain
            if counted:
                parts.append(f"{second} - {first}: {sum(counted.values()) / len(counted):+.3f} "
                             "(" + ", ".join(f"{t} {g:+.3f}" for t, g in counted.items()) + ")")
            if absent:
                missing.append(f"{first} and {second} on "
                               + ("every task" if len(absent) == len(self.tasks)
                                  else ", ".join(absent)))
            if len(counted) < self.min_tasks:
                short.append(f"{second} - {first} on {len(counted)}")
            gains += counted.values()
        notes = ((f"; not learned at L (under {self.learned:g}), left out: "
                  + ", ".join(unlearned) if unlearned else "")
                 + (f"; not both measured past {x_text(self.past)}: {'; '.join(missing)}"
                    if missing else ""))
        if not gains:
            return NOT_COMPARABLE, "no task was counted for any pair" + notes
        gain = sum(gains) / len(gains)
        over = (f"{len(gains)} task{'s' * (len(gains) != 1)}" if len(self.pairs) == 1
                else f"{len(gains)} gains (tasks by pairs)")
        detail = (f"mean gain past {x_text(self.past)} over {over}: {gain:+.3f}; "
                  + "; ".join(parts) + notes)
        if missing:
            return NOT_COMPARABLE, detail
        if short:
            return NOT_COMPARABLE, (detail + f" (fewer than {self.min_tasks} tasks counted: "
                                    + ", ".join(short) + ")")
        if gain >= self.least - self.tolerance:
            return REPRODUCED, detail + (f" (at least {self.least:g} within "
                                         f"{self.tolerance:g} accepted)")
        if gain <= 0:
            return NOT_REPRODUCED, detail + " (no gain)"
        return NOT_COMPARABLE, detail + (f" (a gain under {self.least - self.tolerance:g}, "
                                         "inside the noise)")
