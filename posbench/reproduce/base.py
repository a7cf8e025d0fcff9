"""The contract of a reproduction entry (`posbench reproduce NAME`), one file per published result
in this package, registered as encodings and evaluations are:

    @register("my_entry", "one line for `posbench reproduce --list`")
    class MyEntry(Reproduction):
        paper = "Authors Year, title (arXiv id)"
        where = "Table 2"
        setting = "one line: the setting it runs"
        device = "cpu"                       # or "cuda", with reduced = "<its CPU entry>"
        reduction = "what is reduced from the paper's setting"   # "" at the paper's setting
        axis = "length"                      # or "size", or "score" (below)
        metric = "ppl"                       # or "accuracy" (a task's exact match), or
                                             # "token_accuracy" (its answer tokens right)
        x_name = "instance size"             # axis "score": the x over L of its figure
        paper_train_length = 512
        sweep = Sweep(experiment=None, overrides=("encoding=rope,alibi", ...))
        groups = ("rope", "alibi")           # the encodings compared
        published = {"rope": {512: 20.07, 1012: 21.37}, ...}   # None: not measured (OOM)
        source = "where the numbers were read"
        claims = (OrderPast(...), ...)       # posbench/reproduce/claims.py
        cost = "declared wall time"
        rescored = {"rope_pi": Rescore("rope", ("eval.rope_scaling=pi",))}   # optional

A run belongs to the group `group_of(record)` names: its encoding, unless the entry compares runs
of one encoding under different settings (RoPE at two bases) and says which. axis "score": the
published columns are named scores of each group (a mean reciprocal rank), not lengths or sizes;
such an entry's groups are `<task>/<encoding>`, its published scores are by encoding, and it
measures by length and writes its own tables (`tables`).

A row in `rescored` is not trained: it is another row's finished runs scored again with eval
overrides (`posbench eval RUN_DIR overrides`, results.eval-<tag>.json beside each run's
results.json), which `posbench reproduce` runs after the sweep and the judge reads as its runs
(posbench/reproduce/rescores.py).

check() holds an entry to this contract; tests/test_reproduce.py calls it for every entry.
"""
from __future__ import annotations

import math
import re
from collections import defaultdict
from dataclasses import dataclass
from typing import Any, ClassVar, Dict, List, Optional, Tuple

from omegaconf import OmegaConf

from posbench.core.errors import ConfigError
from posbench.core.registry import Entry, Registry
from posbench.data import build_dataset
from posbench.reports.by_size import model_shape, shape_params
from posbench.reproduce.claims import Claim, Measured

DEVICES = ("cpu", "cuda")
AXES = ("length", "size", "score")
METRICS = ("ppl", "accuracy", "token_accuracy")
# what a metric's values are, as the verdicts and the figure name them (Measured.score)
SCORES = {"ppl": "perplexity", "accuracy": "exact match", "token_accuracy": "token accuracy"}


@dataclass(frozen=True)
class Sweep:
    """The Hydra multirun an entry runs: `+experiment=<experiment>` (a config in
    posbench/conf/experiment) and/or overrides; the command line's overrides replace those of the
    same key."""
    experiment: Optional[str] = None
    overrides: Tuple[str, ...] = ()


@dataclass(frozen=True)
class Rescore:
    """A row that is the finished runs of row `of` scored again with `overrides` (eval keys)."""
    of: str
    overrides: Tuple[str, ...]


def size_value(label: str) -> float:
    """'125M' -> 1.25e8, '1.3B' -> 1.3e9."""
    found = re.fullmatch(r"([\d.]+)([KMB])", label)
    if not found:
        raise ValueError(f"model size {label!r}: expected a number and K, M or B")
    return float(found[1]) * {"K": 1e3, "M": 1e6, "B": 1e9}[found[2]]


class Reproduction:
    name: ClassVar[str] = ""
    description: ClassVar[str] = ""
    paper: ClassVar[str]
    where: ClassVar[str]
    setting: ClassVar[str]
    device: ClassVar[str]
    reduced: ClassVar[Optional[str]] = None  # a cuda entry's CPU entry
    reduction: ClassVar[str] = ""  # what is reduced from the paper's setting; "": none
    axis: ClassVar[str]
    metric: ClassVar[str] = "ppl"
    x_name: ClassVar[str] = "evaluation length"  # what is over L on the x of the score axis
    paper_train_length: ClassVar[int]
    sweep: ClassVar[Sweep]
    groups: ClassVar[Tuple[str, ...]]
    published: ClassVar[Dict[str, Dict[Any, Optional[float]]]]
    source: ClassVar[str]
    claims: ClassVar[Tuple[Claim, ...]]
    cost: ClassVar[str]
    rescored: ClassVar[Dict[str, Rescore]] = {}  # row -> the re-score of another row it is

    @classmethod
    def at_paper_scale(cls) -> bool:
        return not cls.reduction

    @classmethod
    def x_of(cls, published_x) -> float:
        """A published column as the claims read it: a length over the paper's L, or a size."""
        return (published_x / cls.paper_train_length if cls.axis == "length"
                else size_value(published_x))

    @classmethod
    def group_of(cls, record: dict) -> str:
        """The group a run belongs to: its encoding."""
        return record["encoding"]

    @classmethod
    def position(cls, record: dict, length: int) -> float:
        """An evaluated length as the claims read it: over the run's training length."""
        return length / record["train"]["seq_len"]

    @classmethod
    def measure(cls, records: List[dict]) -> Measured:
        """Finished runs' results.json records -> group -> x -> mean over seeds of the entry's
        metric: by length over the training length (axes length and score), or at the training
        length by the model's parameter count (axis size)."""
        from posbench.reports.report import aggregate

        by_group: Dict[str, List[dict]] = defaultdict(list)
        for record in records:
            by_group[cls.group_of(record)].append(record)
        for group, members in by_group.items():
            train_lens = sorted({r["train"]["seq_len"] for r in members})
            if len(train_lens) > 1:
                raise ConfigError(f"the runs of {group} were trained at several lengths "
                                  f"({train_lens}); expected one training length per group of "
                                  f"reproduce entry {cls.name!r}")
        sizes = shape_params(records)
        by_label: Dict[Tuple[str, int], List[dict]] = defaultdict(list)
        for group, members in by_group.items():
            for record in members:
                size = sizes[model_shape(record)] if cls.axis == "size" else 0
                by_label[(group, size)].append(record)
        labels = {f"{group}|{size}": (group, size) for group, size in by_label}
        table = aggregate({label: by_label[key] for label, key in labels.items()}, cls.metric)
        values: Dict[str, Dict[float, float]] = defaultdict(dict)
        spread: Dict[str, Dict[float, float]] = defaultdict(dict)
        lengths: Dict[str, Dict[float, int]] = defaultdict(dict)
        for label, by_length in table.items():
            group, size = labels[label]
            first = by_label[labels[label]][0]
            if cls.axis != "size":
                points = {cls.position(first, n): s for n, s in by_length.items()}
                lengths[group].update({cls.position(first, n): n for n in by_length})
            elif first["train"]["seq_len"] in by_length:
                points = {float(size): by_length[first["train"]["seq_len"]]}
            else:
                continue
            values[group].update({x: s["mean"] for x, s in points.items()})
            spread[group].update({x: s["ci95"] for x, s in points.items()})
        runs = dict(by_group) if cls.axis != "size" else {}
        return Measured(dict(values), at_paper_scale=cls.at_paper_scale(), spread=dict(spread),
                        runs=runs, lengths=dict(lengths), score=SCORES[cls.metric])

    @classmethod
    def pairs(cls, measured: Measured) -> Dict[Any, Optional[float]]:
        """Each published column -> the measured x it is compared with (None: none). Lengths by
        their ratio to the training length, the nearest within a factor of sqrt(2); sizes by
        rank at the ends of the ladders (smallest with smallest, largest with largest); a score
        is compared by the entry's own tables."""
        if cls.axis == "score":
            return {}
        xs = sorted({x for row in measured.values.values() for x in row})
        columns = list(next(iter(cls.published.values())))
        if cls.axis == "length":
            out = {}
            for col in columns:
                want = cls.x_of(col)
                near = [x for x in xs if abs(math.log2(x / want)) <= 0.5]
                out[col] = min(near, key=lambda x: abs(math.log(x / want))) if near else None
            return out
        out = {col: None for col in columns}
        if xs:
            out[columns[0]] = xs[0]
            if len(xs) > 1:
                out[columns[-1]] = xs[-1]
        return out

    @classmethod
    def per_seed(cls, measured: Measured) -> Dict[int, Measured]:
        """seed -> the entry's measure of that seed's runs alone (measured.runs: the length and
        score axes), for the distribution over seeds that a mean hides."""
        records = [r for runs in measured.runs.values() for r in runs]
        return {seed: cls.measure([r for r in records if r["seed"] == seed])
                for seed in sorted({r["seed"] for r in records})}

    @classmethod
    def owns(cls, records: List[dict]) -> List[str]:
        """The groups among the records that this entry does not compare."""
        return sorted({cls.group_of(r) for r in records} - set(cls.groups))

    @classmethod
    def tables(cls, measured: Measured, train_len: int) -> List[str]:
        """The report's tables after its verdicts (markdown lines): the paper's numbers beside
        posbench's (posbench/reproduce/judge.py)."""
        from posbench.reproduce.judge import paired_tables

        return paired_tables(cls, measured, train_len)

    @classmethod
    def check(cls) -> None:
        """The entry's contract, AssertionError naming what is wrong."""
        named = f"reproduce entry {cls.name!r}"
        assert cls.device in DEVICES, f"{named}: device {cls.device!r}, expected one of {DEVICES}"
        assert cls.axis in AXES, f"{named}: axis {cls.axis!r}, expected one of {AXES}"
        assert cls.metric in METRICS, f"{named}: metric {cls.metric!r}, expected one of {METRICS}"
        if cls.device == "cuda":
            reduced = registry().get(cls.reduced or "")
            assert reduced and reduced.cls.device == "cpu", \
                f"{named}: a cuda entry names its CPU entry in `reduced` ({cls.reduced!r})"
        else:
            assert cls.reduced is None, f"{named}: a cpu entry is itself the reduced one"
        for key in ("paper", "where", "setting", "source", "cost"):
            text = getattr(cls, key, "")
            assert isinstance(text, str) and text.strip(), f"{named}: {key} is empty"
            if key == "setting":
                assert "\n" not in text, f"{named}: {key} is one line"
        assert isinstance(cls.sweep, Sweep), f"{named}: sweep is a Sweep"
        assert cls.sweep.experiment or cls.sweep.overrides, f"{named}: sweep runs nothing"
        # a score's groups are `<task>/<encoding>`, its published scores by encoding
        rows = ({g.rpartition("/")[2] for g in cls.groups} if cls.axis == "score"
                else set(cls.groups))
        assert set(cls.published) <= rows, f"{named}: published groups not compared"
        for row, rescore in cls.rescored.items():
            assert isinstance(rescore, Rescore), f"{named}: rescored {row!r} is not a Rescore"
            assert row in rows and rescore.of in rows and rescore.of not in cls.rescored, \
                f"{named}: rescored {row!r} and its source {rescore.of!r} are compared rows, " \
                "the source a trained one"
            assert rescore.overrides and all(o.startswith("eval.") and "=" in o
                                             for o in rescore.overrides), \
                f"{named}: rescored {row!r} changes eval keys only (eval.KEY=VALUE)"
        columns = [list(row) for row in cls.published.values()]
        assert columns and all(c == columns[0] for c in columns), \
            f"{named}: every published group has the same columns"
        if cls.axis != "score":
            for col in columns[0]:
                cls.x_of(col)  # a size label that does not read raises here
        assert cls.claims, f"{named}: no claims"
        names = [c.name for c in cls.claims]
        assert len(set(names)) == len(names), f"{named}: two claims share a name"
        for claim in cls.claims:
            assert isinstance(claim, Claim), f"{named}: {claim!r} is not a Claim"
            assert claim.statement.strip() and claim.why.strip(), \
                f"{named}: claim {claim.name!r} needs its statement and its tolerance's why"
            assert claim.tolerance >= 0, f"{named}: claim {claim.name!r} has a negative tolerance"


def instance_position(record: dict, length: int) -> float:
    """An evaluated length of a task's run as its instance size over the size it trained at:
    the x of the entries over algorithmic tasks, whose L is an instance size."""
    task = build_dataset(OmegaConf.create({"name": record["dataset"]["name"]}))
    return task.size(length + 1) / task.size(record["train"]["seq_len"] + 1)


def ruler_scores(records: List[dict], row_of, tasks: Tuple[str, ...], score: str,
                 at_paper_scale: bool = False) -> Measured:
    """The measure of an entry over eval.ruler's tasks, where one run scores every task: a group
    `<task>/<row>` (claims.task_group) per task of each run, `row_of(record)` naming its row;
    by length over the run's training length, `score` (exact_match, recall) of RULER's by_length
    (the mean over the run's depths and trials), then the mean over seeds with their 95%
    t-interval (0 for one seed). A run without eval.ruler, without one of the tasks, or scored
    before `score` existed adds nothing to it. No lengths: Measured.compare pairs perplexity
    windows, which say nothing of these scores."""
    from posbench.reports.stats import t95
    from posbench.reproduce.claims import score_name, task_group

    scores: Dict[str, Dict[float, List[float]]] = defaultdict(lambda: defaultdict(list))
    runs: Dict[str, List[dict]] = defaultdict(list)
    for record in records:
        found = (record.get("eval") or {}).get("ruler") or {}
        for task in tasks:
            points = (found.get("tasks") or {}).get(task, {}).get("by_length", [])
            group = task_group(task, row_of(record))
            for point in points:
                if score in point:
                    x = point["length"] / record["train"]["seq_len"]
                    scores[group][x].append(point[score])
            if points:
                runs[group].append(record)
    values: Dict[str, Dict[float, float]] = defaultdict(dict)
    spread: Dict[str, Dict[float, float]] = defaultdict(dict)
    for group, by_x in scores.items():
        for x, xs in by_x.items():
            n = len(xs)
            mean = sum(xs) / n
            sd = math.sqrt(sum((v - mean) ** 2 for v in xs) / (n - 1)) if n > 1 else 0.0
            values[group][x] = mean
            spread[group][x] = t95(n - 1) * sd / math.sqrt(n) if n > 1 else 0.0
    return Measured(dict(values), at_paper_scale=at_paper_scale, spread=dict(spread),
                    runs=dict(runs), score=score_name(score))


_REGISTRY = Registry(Reproduction)


def register(name: str, description: str):
    """Class decorator: make `cls` available as `posbench reproduce <name>`."""

    def wrap(cls):
        cls.name, cls.description = name, description
        return _REGISTRY.add(cls, name, description)

    return wrap


def registry() -> Dict[str, Entry]:
    return _REGISTRY.by_name()
