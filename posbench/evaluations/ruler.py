"""eval.ruler: RULER's synthetic retrieval tasks (Hsieh et al. 2024, "RULER: What's the Real
Context Size of Your Long-Context Language Models?", arXiv 2404.06654; github NVIDIA/RULER,
scripts/synthetic.yaml) at posbench's scale: needle-in-a-haystack with one needle, with
distracting needles, several values and several queries, variable tracking, and common and
frequent word extraction, in the run's own tokenizer and text, by length x depth, scored
teacher-forced in one pass.

The instances, their formats and their generators are in posbench/evaluations/ruler_tasks.py
(common and frequent word extraction in ruler_words.py); this module scores them, plans them
for a run and plants them in training rows, and reports the scores.

Three scores per (task, length, depth), means over trials, on the answer tokens (the drawn
tokens of the answer; its separators and uuid hyphens are fed but not scored):
- exact_match: whether every answer token is the model's argmax given the true tokens before it
  (what greedy decoding reproduces when the answer's unscored tokens are given);
- recall: the share of the answer's items (values, names, words) all of whose tokens are the
  model's argmax: RULER's own score (string_match_all, the share of expected answers found in
  the output), equal to exact_match where the answer is one item and above it where a model
  finds some of several values;
- bits_saved: the answer's mean loss per token (bits) in the same sequence with the needles that
  hold the answer taken out and the haystack run on to the same length (cwe, fwe: the asked
  words replaced by others), minus its loss with them: what the needles are worth to the
  model. 0 for a model that does not retrieve.

train.ruler_mix replaces that fraction of training sequences by instances of train.ruler_tasks
at the training length (a tiny model trained on text alone does not learn these formats), each
built by Task.make at eval.ruler's default counts, of a task and a depth drawn uniformly, with
its text haystack from training documents, all from the row's own generator of (seed, step,
row): see training_instance.

Not here: RULER's QA, and RULER's prompt templates, which are replaced by short formats
(ruler_tasks.py, ruler_words.py).
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Dict, List, Optional, Tuple

import numpy as np
import torch

from posbench.core.errors import did_you_mean, require, require_positive
from posbench.core.plots import pyplot, save_figure
from posbench.core.progress import Bar
from posbench.data.base import dataset_class
from posbench.evaluations.base import (RELATIVE_SHARE, Section, SectionConfig, by_length,
                                       effective_lengths, eval_config, per_seed, plant_share,
                                       register, scored_within_memory, set_eval_options,
                                       with_train_length)
from posbench.evaluations.ruler_tasks import (DEFAULT_TASKS, FORMAT, PRESETS, TOKENS_KEY,
                                              Instance, Task, Vocabulary, instances)
from posbench.evaluations.ruler_words import WordList

# train.ruler_mix: a batch's share and rows are drawn from the generator of (seed, step,
# MIX_STREAM), each planted row from that of (seed, step, MIX_STREAM, row + 1): four words where
# an evaluation instance's are five (seed, task, length, depth, trial), so that no training
# generator is an evaluation's (nor the batch's (seed, step), nor retrieval_mix's stream 7)
MIX_STREAM = 11
# each cell's scores that its length's point averages over depths, and the tasks' average
SCORES = ("exact_match", "recall", "bits_saved")
# eval.ruler's counts, positive integers, which results.json records with fwe's alpha
COUNTS = (*TOKENS_KEY.values(), "keys", "values", "queries", "hops", "chains", "common",
          "common_repeats", "uncommon_repeats", "frequent")


@dataclass
class RulerConfig(SectionConfig):
    """eval.ruler: RULER's synthetic retrieval tasks by length and depth, language-model runs
    only (posbench/evaluations/ruler.py)."""
    tasks: List[str] = field(default_factory=lambda: list(DEFAULT_TASKS))
    # null: eval.lengths (with the training length)
    lengths: Optional[List[int]] = None
    # where the first answer's needle sits in the haystack: 0 at its start, 1 before the query
    depths: List[float] = field(default_factory=lambda: [0.0, 0.25, 0.5, 0.75, 1.0])
    trials: int = 8
    seed: int = 0
    # RULER's counts, and its items' sizes scaled to windows of 128 bytes: every task fits 128
    # tokens at byte level with these. Tokens of a word key (RULER: an adjective-noun pair), of
    # a number (RULER: 7 digits; vt's 5), of a UUID-like string (RULER: a UUID's 32 hex digits)
    # and of a vt variable name (RULER: 5 capital letters)
    key_tokens: int = 3
    number_tokens: int = 4
    uuid_tokens: int = 8
    name_tokens: int = 3
    keys: int = 4  # niah_multikey_1: needles of distinct keys, one asked (RULER: 4)
    values: int = 4  # niah_multivalue: values of the one key (RULER: 4)
    # niah_multiquery: keys asked (RULER: 4, which take 167 tokens at byte level with the
    # other defaults)
    queries: int = 2
    hops: int = 4  # vt: assignments after the first in a chain (RULER: 4)
    chains: int = 1  # vt: chains, one asked (RULER: 1)
    # cwe: `common` words (RULER: 10) each `common_repeats` times among as many words each
    # `uncommon_repeats` times as fill the window (RULER: 30 and 3, below 4096 tokens 6 and 1).
    # RULER's repeats below 4096 tokens, and 2 words, so that at 128 bytes they are 12 of the
    # list's 25 (RULER's 10 words' answer alone would take 48)
    common: int = 2
    common_repeats: int = 6
    uncommon_repeats: int = 1
    # fwe: words asked, the most frequent after the noise (RULER: 3), at counts of a Zeta law of
    # this alpha (RULER: 2.0)
    frequent: int = 3
    alpha: float = 2.0
    # effective context, per task and over the tasks' mean: the largest length up to which
    # bits saved per answer token stays >= threshold (RULER's absolute rule; 1 bit, as the
    # passkey's), and up to which it keeps 85% of its value at the shortest length (NoLiMa's)
    threshold: float = 1.0


def ruler_lengths(eval_cfg, train_len: int) -> List[int]:
    r = Ruler.typed(eval_cfg)
    return sorted(set(r.lengths)) if r.lengths else list(with_train_length(eval_cfg,
                                                                           train_len).lengths)


def build_task(name: str, cfg: RulerConfig, vocab: Vocabulary) -> Task:
    """A preset's builder: cwe and fwe's in ruler_words.py, the others' in ruler_tasks.py."""
    return (WordList if PRESETS[name].extract else Task)(name, cfg, vocab)


def plan_tasks(cfg: RulerConfig, run_cfg, data) -> Dict[str, Task]:
    """The tasks of the run's ruler evaluation, after refusing any that a length cannot hold."""
    vocab = Vocabulary(data, run_cfg.dataset)
    tasks = {name: build_task(name, cfg, vocab) for name in cfg.tasks}
    for length in ruler_lengths(run_cfg.eval, run_cfg.train.seq_len):
        for task in tasks.values():
            task.check(length)
    return tasks


def training_tasks(run_cfg, data) -> List[Task]:
    """train.ruler_mix's tasks, at eval.ruler's default counts, after refusing any that the
    training length or the training documents cannot hold."""
    vocab = Vocabulary(data, run_cfg.dataset)
    tasks = [build_task(name, RulerConfig(), vocab) for name in run_cfg.train.ruler_tasks]
    for task in tasks:
        task.check(run_cfg.train.seq_len, split="train")
    return tasks


def training_instance(tasks: List[Task], seed: int, step: int, row: int,
                      length: int) -> Tuple[Task, Instance]:
    """Row `row` of training batch `step` under train.ruler_mix: a task of `tasks` and a depth in
    [0, 1) drawn uniformly, and the instance Task.make builds of them at `length`, its text
    haystack from training documents; all from the row's own generator (MIX_STREAM)."""
    rng = np.random.default_rng([seed, step, MIX_STREAM, row + 1])
    task = tasks[int(rng.integers(len(tasks)))]
    return task, task.make(rng, length, float(rng.random()), split="train")


def training_mix(run_cfg, data):
    """train_batch's `plant` for train.ruler_mix (plant_share), after refusing tasks that the
    training length cannot hold; None when the mix is 0."""
    mix = run_cfg.train.get("ruler_mix", 0.0)  # runs saved before it existed lack it
    if not mix:
        return None
    tasks = training_tasks(run_cfg, data)

    def plant(rows: np.ndarray, seed: int, step: int, taken=()) -> List[int]:
        return plant_share(rows, mix, seed, step, MIX_STREAM, lambda rng, row, length:
                           training_instance(tasks, seed, step, row, length)[1].row, taken)
    return plant


def answer_scores(model, rows: torch.Tensor, scored: torch.Tensor, item: torch.Tensor):
    """Per row: the mean loss (bits per token) of its scored answer tokens, which are among its
    last len(scored); whether each of them is the model's argmax (exact match); and the share of
    the answer's items all of whose scored tokens are (recall: RULER's string_match_all, which
    credits each expected value found)."""
    span = len(scored)
    h = model.hidden(rows[:, :-1])[:, -span:]
    logp = torch.log_softmax(model.head(h).float(), -1)
    target = rows[:, -span:]
    loss = -logp.gather(-1, target.unsqueeze(-1)).squeeze(-1) / math.log(2)
    hits = logp.argmax(-1) == target
    found = torch.stack([hits[:, scored & (item == i)].all(1)
                         for i in range(int(item.max()) + 1)], 1)
    return loss[:, scored].mean(1), hits[:, scored].all(1), found.double().mean(1)


@torch.no_grad()
def evaluate_ruler(model, tasks: Dict[str, Task], cfg: RulerConfig, eval_cfg, train_len: int,
                   device: torch.device) -> dict:
    """results.json's eval.ruler: per task, the grid of lengths x depths. A cell that runs out
    of memory is recorded as such and the others still run."""
    model.eval()
    set_eval_options(model, eval_cfg)
    lengths = ruler_lengths(eval_cfg, train_len)
    batch_tokens = eval_config(eval_cfg).batch_tokens
    out = {}
    bar = Bar("ruler", len(tasks) * len(lengths) * len(cfg.depths), "cell")
    for name, task in tasks.items():
        grid = []
        for length in lengths:
            per_batch = max(1, batch_tokens // length)
            for depth in cfg.depths:
                made = instances(task, cfg, length, depth)
                rows = torch.from_numpy(np.stack([m.row for m in made]
                                                 + [m.removed for m in made])).to(device)
                scored = torch.from_numpy(made[0].scored).to(device)
                item = torch.from_numpy(made[0].item).to(device)

                def cell_scores():
                    parts = [answer_scores(model, rows[i:i + per_batch], scored, item)
                             for i in range(0, len(rows), per_batch)]
                    loss, hits, found = (torch.cat(s).double() for s in zip(*parts))
                    with_needles, without = loss[:len(made)], loss[len(made):]
                    return {"exact_match": hits[:len(made)].mean().item(),
                            "recall": found[:len(made)].mean().item(),
                            "loss": with_needles.mean().item(),
                            "loss_removed": without.mean().item(),
                            "bits_saved": (without - with_needles).mean().item()}

                grid.append({"length": length, "depth": depth,
                             **scored_within_memory(device, cell_scores)})
                bar.update()
            point = by_length(grid, SCORES)[-1]
            bar.log(f"{name} length {length}", bits_saved=f"{point['bits_saved']:.3f}"
                    if "bits_saved" in point else "oom")
        out[name] = {"haystack": task.preset.haystack, "ruler": task.preset.ruler,
                     "answer_tokens": int(made[0].scored.sum()), "grid": grid,
                     **effective_lengths(by_length(grid, SCORES), cfg.threshold)}
    bar.close()
    return {"format": FORMAT, "units": "bits per answer token", "trials": cfg.trials,
            "seed": cfg.seed, "depths": list(cfg.depths), "threshold": cfg.threshold,
            "counts": {key: getattr(cfg, key) for key in (*COUNTS, "alpha")},
            "tasks": out, **effective_lengths(average(out), cfg.threshold)}


def average(tasks: Dict[str, dict]) -> List[dict]:
    """Per length, the mean over the tasks scored of their by_length scores, where every task
    has them (RULER's average is over its own tasks: niah_control, where scored, is in this one)."""
    out = []
    lengths = sorted({p["length"] for t in tasks.values() for p in t["by_length"]})
    for length in lengths:
        points = [p for t in tasks.values() for p in t["by_length"] if p["length"] == length]
        point = {"length": length}
        if len(points) == len(tasks) and all("bits_saved" in p for p in points):
            for key in SCORES:
                point[key] = float(np.mean([p[key] for p in points]))
        out.append(point)
    return out


@register("ruler", "RULER's synthetic tasks (needle in a haystack: single, multi-key, "
          "multi-value, multi-query; variable tracking; common and frequent word extraction) by "
          "length and depth: exact match and bits saved per answer token")
class Ruler(Section):
    Config = RulerConfig
    has_effective_length = True

    @classmethod
    def check(cls, cfg: RulerConfig, run_cfg) -> None:
        """Its keys, whether enabled or not, and train.ruler_mix's, which plants its tasks in
        training sequences; what the run's tokenizer and text must hold is checked when it is
        planned (plan_tasks, training_tasks)."""
        t = run_cfg.train
        mix = t.get("ruler_mix", 0.0)  # runs saved before it existed lack it
        require(0 <= mix < 1, "train.ruler_mix", mix,
                "a fraction in [0, 1) (the share of training sequences that are RULER tasks)")
        passkeys = t.get("retrieval_mix", 0.0)
        require(mix == 0 or mix + passkeys < 1, "train.ruler_mix", mix,
                f"less than 1 - train.retrieval_mix={passkeys} (the two mixes share the rows)")
        require(mix == 0 or dataset_class(run_cfg.dataset).text, "train.ruler_mix", mix,
                f"0 for dataset={run_cfg.dataset.name} (RULER's tasks are planted in text)")
        tasks = list(t.get("ruler_tasks", DEFAULT_TASKS))
        require(mix == 0 or len(tasks) > 0, "train.ruler_tasks", tasks,
                "a non-empty list of tasks: " + ", ".join(PRESETS))
        for name in tasks:
            require(name in PRESETS, "train.ruler_tasks", name,
                    f"one of {', '.join(PRESETS)}{did_you_mean(name, PRESETS)}")
        require(len(set(tasks)) == len(tasks), "train.ruler_tasks", tasks, "each task once")
        require(len(cfg.tasks) > 0, "eval.ruler.tasks", list(cfg.tasks),
                "a non-empty list of tasks: " + ", ".join(PRESETS))
        for name in cfg.tasks:
            require(name in PRESETS, "eval.ruler.tasks", name,
                    f"one of {', '.join(PRESETS)}{did_you_mean(name, PRESETS)}")
        require(len(set(cfg.tasks)) == len(cfg.tasks), "eval.ruler.tasks", list(cfg.tasks),
                "each task once")
        for key in ("trials", *COUNTS):
            require_positive(f"eval.ruler.{key}", getattr(cfg, key))
        require(cfg.common_repeats > cfg.uncommon_repeats, "eval.ruler.common_repeats",
                cfg.common_repeats, f"more than eval.ruler.uncommon_repeats="
                f"{cfg.uncommon_repeats} (cwe's common words are the most repeated)")
        require(math.isfinite(cfg.alpha) and cfg.alpha > 1, "eval.ruler.alpha", cfg.alpha,
                "a number above 1 (fwe's Zeta law, whose sum diverges at 1)")
        for n in cfg.lengths or []:
            require_positive("eval.ruler.lengths", n)
        require(math.isfinite(cfg.threshold), "eval.ruler.threshold", cfg.threshold,
                "a finite number of bits saved per answer token")
        require(len(cfg.depths) > 0, "eval.ruler.depths", list(cfg.depths),
                "a non-empty list of depths in [0, 1]")
        for depth in cfg.depths:
            require(0 <= depth <= 1, "eval.ruler.depths", depth,
                    "depths in [0, 1] (0: the needle at the haystack's start, 1: at its end)")
        text = dataset_class(run_cfg.dataset).text
        require(not cfg.enabled or text, "eval.ruler.enabled", cfg.enabled,
                f"false for dataset={run_cfg.dataset.name} (its tasks report exact match "
                "already)")

    def __init__(self, cfg, run_cfg, data):
        super().__init__(cfg, run_cfg, data)
        self.tasks = plan_tasks(cfg, run_cfg, data)

    def run(self, model, device: torch.device) -> dict:
        return evaluate_ruler(model, self.tasks, self.cfg, self.run_cfg.eval,
                              self.run_cfg.train.seq_len, device)

    @classmethod
    def write(cls, result: dict, train_len: int, run_dir, stem: str, title: str) -> None:
        plot_tasks(result, train_len, run_dir / f"ruler_heatmap{stem}.png", title=title)

    @classmethod
    def report_lines(cls, runs: List[dict], labels: dict) -> List[str]:
        return report_lines(runs, labels)

    @classmethod
    def summary_metrics(cls, result: dict) -> Dict[str, Optional[int]]:
        """Each task's effective lengths, absolute and relative (the average's are
        effective_length/ruler and ruler_relative)."""
        return {f"effective_length/ruler_{name}{suffix}": task.get(key)
                for name, task in result["tasks"].items()
                for suffix, key in (("", "effective_length"),
                                    ("_relative", "relative_effective_length"))}

    @classmethod
    def length_metrics(cls, result: dict) -> Dict[int, dict]:
        out: Dict[int, dict] = {}
        series = [("ruler", result["by_length"])] + [
            (f"ruler_{name}", task["by_length"]) for name, task in result["tasks"].items()]
        for prefix, points in series:
            for p in points:
                if "bits_saved" in p:
                    out.setdefault(p["length"], {}).update({
                        f"eval/{prefix}_{key}": p[key] for key in SCORES})
        return out


# ---- plot and report -------------------------------------------------------------------------

def _panel(ax, task: dict, train_len: int, vmax: float, title: str):
    """One task's bits saved, depth by length, each cell's exact match beside its bits."""
    lengths = sorted({c["length"] for c in task["grid"]})
    depths = sorted({c["depth"] for c in task["grid"]})
    bits, exact = (np.full((len(depths), len(lengths)), np.nan) for _ in range(2))
    for c in task["grid"]:
        if "bits_saved" in c:
            at = depths.index(c["depth"]), lengths.index(c["length"])
            bits[at], exact[at] = c["bits_saved"], c["exact_match"]
    image = ax.imshow(bits, aspect="auto", origin="upper", cmap="RdBu", vmin=-vmax, vmax=vmax)
    for (i, j), v in np.ndenumerate(bits):
        ax.text(j, i, "oom" if np.isnan(v) else f"{v:.2f}\n({exact[i, j]:.2f})", ha="center",
                va="center", fontsize=7, color="white" if abs(v) > 0.6 * vmax else "black")
    ax.set_xticks(range(len(lengths)), [f"{n}{'*' if n == train_len else ''}" for n in lengths])
    ax.set_yticks(range(len(depths)), [f"{d:g}" for d in depths])
    ax.set_xlabel(f"length (* training length {train_len})", fontsize=8)
    ax.set_ylabel("depth of the first answer", fontsize=8)
    ax.set_title(title, fontsize=9)
    return image


def plot_tasks(result: dict, train_len: int, path, title: str = "") -> None:
    """ruler_heatmap.png: a panel per task, bits saved per answer token (exact match), depth by
    length, on one colour scale (0: the needles are of no use)."""
    plt = pyplot()
    tasks = result["tasks"]
    cols = min(3, len(tasks))
    rows = math.ceil(len(tasks) / cols)
    fig, axes = plt.subplots(rows, cols, squeeze=False, figsize=(4.6 * cols, 3.4 * rows),
                             layout="constrained")
    values = [c["bits_saved"] for t in tasks.values() for c in t["grid"] if "bits_saved" in c]
    vmax = max([abs(v) for v in values] + [0.5])
    for ax, (name, task) in zip(axes.flat, tasks.items()):
        image = _panel(ax, task, train_len, vmax, name)
    for ax in list(axes.flat)[len(tasks):]:
        ax.axis("off")
    fig.colorbar(image, ax=axes, label="bits saved per answer token")
    fig.suptitle(f"{title}\nRULER tasks: bits saved per answer token (exact match), "
                 f"{result['trials']} trials per cell", fontsize=9)
    save_figure(plt, fig, path)


def _cell(points: List[dict]) -> str:
    if not points:
        return "—"
    if any("bits_saved" not in p for p in points):
        return "oom"
    scores = [np.mean([p[key] for p in points]) for key in ("exact_match", "recall")
              if all(key in p for p in points)]  # recall: not in records from before it
    return (f"{np.mean([p['bits_saved'] for p in points]):.2f} "
            f"({', '.join(f'{v:.2f}' for v in scores)})")


def report_lines(runs: List[dict], labels: dict) -> List[str]:
    """summary.md's RULER tables: per task (and their average), a row per group with bits saved
    per answer token and exact match by length, means over depths and seeds."""
    groups: Dict[str, List[dict]] = {}
    for i, run in enumerate(runs):
        if run["eval"].get("ruler"):
            groups.setdefault(labels[i], []).append(run["eval"]["ruler"])
    if not groups:
        return []
    names = list(dict.fromkeys(n for rs in groups.values() for r in rs for n in r["tasks"]))
    lines = ["", "RULER (Hsieh et al. 2024) at posbench's scale: bits saved per answer token "
             "(exact match, recall: RULER's score, the share of the answer's items found) by "
             "length, means over depths and seeds; 0 bits: the needles are of no use to the "
             "model."]
    for name in ["average", *names]:
        def points(record):
            return record["by_length"] if name == "average" else \
                record["tasks"].get(name, {}).get("by_length", [])
        lengths = sorted({p["length"] for rs in groups.values() for r in rs for p in points(r)})
        ruler = next((r["tasks"][name]["ruler"] for rs in groups.values() for r in rs
                      if name in r["tasks"]), "mean over the tasks")
        lines += ["", f"{name} ({ruler}):", "",
                  "| encoding | " + " | ".join(map(str, lengths)) + " |",
                  "|---|" + "---:|" * len(lengths)]
        for label, records in groups.items():
            cells = [_cell([p for r in records for p in points(r) if p["length"] == n])
                     for n in lengths]
            lines.append(f"| {label} | " + " | ".join(cells) + " |")
    return lines + effective_length_lines(groups, names)


def effective_length_lines(groups: Dict[str, List[dict]], names: List[str]) -> List[str]:
    """summary.md's table of RULER's effective lengths: per group, the average's and each
    task's, absolute / relative, each seed's where they differ."""
    def cell(scores: List[dict]) -> str:
        return " / ".join(per_seed([s[key] for s in scores if s is not None and key in s])
                          for key in ("effective_length", "relative_effective_length"))

    lines = ["", "RULER's effective length (tokens; one value per seed where seeds differ): "
             "absolute / relative, the largest length up to which bits saved per answer token "
             "stay at or above eval.ruler.threshold (RULER's rule) / keep "
             f"{RELATIVE_SHARE:.0%} of the run's own score at its shortest length (NoLiMa's "
             "rule); none: not even at the shortest.", "",
             "| encoding | average | " + " | ".join(names) + " |",
             "|---|" + "---:|" * (len(names) + 1)]
    for label, records in groups.items():
        cells = [cell(records)] + [cell([r["tasks"].get(n) for r in records]) for n in names]
        lines.append(f"| {label} | " + " | ".join(cells) + " |")
    return lines
