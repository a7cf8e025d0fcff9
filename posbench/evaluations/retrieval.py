"""eval.retrieval: passkey retrieval by length and depth, and its effective context length.

A passkey sequence is real text of the run's corpus (the filler) with a needle planted at a depth
of it, "the key is KEY. ", and a question at the end, "what is the key? the key is KEY", all in the
run's tokenizer; with eval.retrieval.keys > 1 several named keys are planted ("the key 2 is ...")
and one is asked. The key is key_tokens tokens drawn from the letters and digits of the corpus's
vocabulary. Each (seed, length, depth, trial) has its own generator, so every encoding and every
run scores the same sequences.

Two scores per (length, depth), means over trials:
- exact_match: whether the greedy continuation after the question is the key (teacher forcing
  gives it in one pass: greedy decoding reproduces the key exactly when every key token is the
  argmax given the key tokens before it);
- bits_saved: the key's mean loss per token at its first occurrence (unpredictable) minus at its
  second (after the question), in bits: what retrieving the key from context is worth. A model
  that does not copy saves 0 bits; it moves before exact match does.

train.retrieval_mix replaces that fraction of training sequences by passkey sequences of training
text, keys of 1 to TRAIN_KEY_TOKENS tokens at uniform depths, drawn per (seed, step).
"""
from __future__ import annotations

import math
import textwrap
from dataclasses import dataclass, field
from typing import List, Optional

import numpy as np
import torch

from posbench.data.base import dataset_class, dataset_config
from posbench.data.tokenize import Tokenizer
from posbench.core.errors import ConfigError, require, require_positive
from posbench.evaluations.base import (RELATIVE_SHARE, EvalConfig, Section, SectionConfig,
                                       by_length, effective_lengths, eval_config, per_seed,
                                       plant_share, register, scored_within_memory,
                                       set_eval_options, with_train_length)
from posbench.evaluations.perplexity import ppl_effective_length
from posbench.core.plots import pyplot, save_figure
from posbench.core.progress import Bar

ALNUM = b"abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789"
SAMPLE = 1 << 24  # validation tokens read to find which letter and digit tokens occur
TRAIN_KEY_TOKENS = 16  # longest key planted in training sequences
MIX_STREAM = 7  # the mix's generator is seeded (seed, step, MIX_STREAM), apart from the batch's
FORMAT = 1  # bump when the passkey format changes: results.json records it
METRICS = ("bits_saved", "exact_match")


@dataclass
class RetrievalConfig(SectionConfig):
    """eval.retrieval: passkey retrieval by length and depth, language-model runs only."""
    # null: eval.lengths (with the training length)
    lengths: Optional[List[int]] = None
    # where the asked key sits in the filler: 0 at its start, 1 just before the question
    depths: List[float] = field(default_factory=lambda: [0.0, 0.25, 0.5, 0.75, 1.0])
    key_tokens: int = 8
    # keys planted per sequence; one of them is asked
    keys: int = 1
    trials: int = 8
    seed: int = 0
    # effective context: the largest length up to which the mean over depths of `metric` stays
    # >= threshold. 1 bit saved per key token: a key token drawn from the corpus's ~60 letters
    # and digits holds ~6 bits, and a model that does not copy saves 0 +- 0.15 bits
    metric: str = "bits_saved"
    threshold: float = 1.0


def retrieval_lengths(eval_cfg, train_len: int) -> List[int]:
    r = Retrieval.typed(eval_cfg)
    return sorted(set(r.lengths)) if r.lengths else list(with_train_length(eval_cfg,
                                                                           train_len).lengths)


class Passkeys:
    """Builds passkey sequences in the run's tokenizer from the run's corpus."""

    def __init__(self, data, dataset_cfg):
        tokenizer = Tokenizer(dataset_config(dataset_cfg))
        if tokenizer.bpe is None:
            self.encode = lambda text: np.frombuffer(text.encode(), dtype=np.uint8).astype(np.int64)
            symbols = np.frombuffer(ALNUM, dtype=np.uint8).astype(np.int64)
        else:
            bpe = tokenizer.bpe
            self.encode = lambda text: bpe.encode_batch([text])[0]
            ranks = range(bpe.encoding.n_vocab)
            symbols = np.array([bpe.ids[r] for r in ranks
                                if set(bpe.encoding.decode_single_token_bytes(r)) <= set(ALNUM)])
        val = np.asarray(data.tokens[data.val_docs[0]:min(data.val_docs[-1],
                                                          data.val_docs[0] + SAMPLE)])
        seen = np.bincount(val, minlength=data.vocab_size)
        self.alphabet = symbols[seen[symbols] > 0]
        self.data = data
        self.stop = self.encode(". ")
        # dataset.bos: every sequence starts with the BOS token, as every window does
        self.start = np.array([data.bos] if getattr(data, "bos", None) is not None else [],
                              dtype=np.int64)

    def needle(self, name: str) -> np.ndarray:
        return self.encode(f"the key{name} is ")

    def question(self, name: str) -> np.ndarray:
        return self.encode(f"\nwhat is the key{name}? the key{name} is ")

    def overhead(self, keys: int) -> int:
        """Tokens of a sequence with `keys` keys that are neither filler nor key."""
        names = [f" {i + 1}" if keys > 1 else "" for i in range(keys)]
        return (len(self.start) + sum(len(self.needle(n)) + len(self.stop) for n in names)
                + max(len(self.question(n)) for n in names))

    def check(self, length: int, keys: int, key_tokens: int, what: str) -> None:
        need = self.overhead(keys) + (keys + 1) * key_tokens
        if need > length + 1:
            raise ConfigError(
                f"{what} is not accepted: {keys} key(s) of {key_tokens} tokens and the passkey "
                f"format take {need} tokens, more than a window of {length + 1}; expected "
                "fewer or shorter keys, or a longer length")

    def make(self, rng: np.random.Generator, length: int, depth: float, keys: int,
             key_tokens: int, split: str = "val"):
        """One sequence of length+1 tokens, and where the asked key starts in it at its first
        and second occurrence."""
        names = [f" {i + 1}" if keys > 1 else "" for i in range(keys)]
        asked = int(rng.integers(keys))
        values = [self.alphabet[rng.integers(len(self.alphabet), size=key_tokens)]
                  for _ in range(keys)]
        needles = [np.concatenate([self.needle(n), v, self.stop]) for n, v in zip(names, values)]
        question = self.question(names[asked])
        filler = length + 1 - len(self.start) - sum(map(len, needles)) - len(question) - key_tokens
        offsets = rng.integers(0, filler + 1, size=keys)
        offsets[asked] = round(depth * filler)
        text = self._filler(rng, filler, split)
        pieces, at, first = [self.start], 0, 0
        for i in sorted(range(keys), key=lambda i: (offsets[i], i != asked)):
            pieces.append(text[at:offsets[i]])
            if i == asked:
                first = sum(map(len, pieces)) + len(self.needle(names[i]))
            pieces.append(needles[i])
            at = offsets[i]
        pieces += [text[at:], question, values[asked]]
        row = np.concatenate(pieces).astype(np.int64)
        return row, first, len(row) - key_tokens

    def _filler(self, rng: np.random.Generator, n: int, split: str) -> np.ndarray:
        """n tokens of one document of the split, from a uniform start among all that fit."""
        docs = self.data.val_docs if split == "val" else self.data.train_docs
        counts = np.maximum(np.diff(docs) - n + 1, 0)
        if counts.sum() == 0:
            raise ConfigError(f"a passkey filler of {n} tokens is not accepted: no {split} "
                              f"document of {self.data.name} is that long; expected shorter "
                              "eval.retrieval.lengths")
        cum = np.cumsum(counts)
        pick = int(rng.integers(cum[-1]))
        doc = int(np.searchsorted(cum, pick, side="right"))
        start = int(docs[doc] + pick - (cum[doc] - counts[doc]))
        return np.asarray(self.data.tokens[start:start + n], dtype=np.int64)


def plan_passkeys(cfg, data) -> Passkeys:
    """The passkey builder of the run's retrieval evaluation, after checking that every retrieval
    length holds the format."""
    r = Retrieval.typed(cfg.eval)
    passkeys = Passkeys(data, cfg.dataset)
    for length in retrieval_lengths(cfg.eval, cfg.train.seq_len):
        passkeys.check(length, r.keys, r.key_tokens,
                       f"eval.retrieval.key_tokens={r.key_tokens} at length {length}")
    return passkeys


def training_mix(cfg, data):
    """train_batch's `plant` for train.retrieval_mix, after checking that the training length
    holds the format; None when the mix is 0."""
    mix = cfg.train.get("retrieval_mix", 0.0)
    if not mix:
        return None
    passkeys = Passkeys(data, cfg.dataset)
    train_key_tokens(passkeys, cfg.train.seq_len)
    return mixer(passkeys, mix)


def train_key_tokens(passkeys: Passkeys, seq_len: int) -> int:
    """The longest key planted in training sequences of seq_len: TRAIN_KEY_TOKENS, or fewer when
    two of them and the format would not fit."""
    fit = min(TRAIN_KEY_TOKENS, (seq_len + 1 - passkeys.overhead(1)) // 2)
    if fit < 1:
        raise ConfigError(f"train.retrieval_mix is not accepted with train.seq_len={seq_len}: the "
                          f"passkey format alone takes {passkeys.overhead(1)} tokens; expected a "
                          "longer train.seq_len or train.retrieval_mix=0")
    return fit


def mixer(passkeys: Passkeys, mix: float):
    """train_batch's `plant` for train.retrieval_mix; None when it is 0."""
    return (lambda rows, seed, step, taken=(): mix_rows(rows, passkeys, mix, seed, step, taken)
            ) if mix else None


def mix_rows(rows: np.ndarray, passkeys: Passkeys, mix: float, seed: int, step: int,
             taken=()) -> List[int]:
    """Replaces a share `mix` of the batch's rows (not in `taken`) by passkey sequences of
    training text, in place (plant_share): the rows it replaced."""
    longest = train_key_tokens(passkeys, rows.shape[1] - 1)
    return plant_share(rows, mix, seed, step, MIX_STREAM, lambda rng, row, length: passkeys.make(
        rng, length, rng.random(), 1, int(rng.integers(1, longest + 1)), split="train")[0],
        taken)


def sequences(passkeys: Passkeys, r, length: int, depth: float):
    """The trials of one grid cell: rows (trials, length+1), first and second key starts."""
    made = [passkeys.make(np.random.default_rng([r.seed, length, round(depth * 10**6), trial]),
                          length, depth, r.keys, r.key_tokens) for trial in range(r.trials)]
    rows, first, second = zip(*made)
    return np.stack(rows), np.array(first), np.array(second)


def key_scores(model, rows: torch.Tensor, first: torch.Tensor, second: torch.Tensor,
               key_tokens: int):
    """Per row: the key's mean loss (bits per token) at its first and second occurrence, and
    whether every key token of the second is the model's argmax."""
    x = rows[:, :-1]
    h = model.hidden(x)
    span = torch.arange(key_tokens, device=rows.device)
    out = []
    for start in (first, second):
        where = start.view(-1, 1) + span - 1  # the input position that predicts each key token
        logits = model.head(h[torch.arange(len(rows), device=rows.device).view(-1, 1), where])
        logp = torch.log_softmax(logits.float(), -1)
        target = rows.gather(1, where + 1)
        loss = -logp.gather(-1, target.unsqueeze(-1)).squeeze(-1) / math.log(2)
        out.append((loss.mean(1), (logp.argmax(-1) == target).all(1)))
    (first_loss, _), (second_loss, hits) = out
    return first_loss, second_loss, hits


@torch.no_grad()
def evaluate_retrieval(model, passkeys: Passkeys, eval_cfg, train_len: int,
                       device: torch.device) -> dict:
    """The grid of lengths x depths for results.json's eval.retrieval. A cell that runs out of
    memory is recorded as such and the others still run."""
    r = Retrieval.typed(eval_cfg)
    model.eval()
    set_eval_options(model, eval_cfg)
    lengths = retrieval_lengths(eval_cfg, train_len)
    grid = []
    bar = Bar("retrieval", len(lengths) * len(r.depths), "cell")
    for length in lengths:
        per_batch = max(1, eval_config(eval_cfg).batch_tokens // length)
        for depth in r.depths:
            rows, first, second = (torch.from_numpy(a).to(device)
                                   for a in sequences(passkeys, r, length, depth))
            def cell_scores():
                scores = [key_scores(model, rows[i:i + per_batch], first[i:i + per_batch],
                                     second[i:i + per_batch], r.key_tokens)
                          for i in range(0, len(rows), per_batch)]
                loss_1, loss_2, hits = (torch.cat(s).double() for s in zip(*scores))
                return {"exact_match": hits.mean().item(), "loss_first": loss_1.mean().item(),
                        "loss_second": loss_2.mean().item(),
                        "bits_saved": (loss_1 - loss_2).mean().item()}

            grid.append({"length": length, "depth": depth,
                         **scored_within_memory(device, cell_scores)})
            bar.update()
        point = by_length(grid)[-1]
        bar.log(f"retrieval length {length}", bits_saved=f"{point['bits_saved']:.3f}"
                if "bits_saved" in point else "oom")
    bar.close()
    return {"format": FORMAT, "units": "bits per key token", "key_tokens": r.key_tokens,
            "keys": r.keys, "trials": r.trials, "seed": r.seed, "depths": list(r.depths),
            "metric": r.metric, "threshold": r.threshold, "grid": grid,
            **effective_lengths(by_length(grid), r.threshold, r.metric)}


@register("retrieval", "passkey retrieval by length and depth: exact match and bits saved per "
          "key token, and an effective context length")
class Retrieval(Section):
    Config = RetrievalConfig
    has_effective_length = True

    @classmethod
    def report_lines(cls, runs: List[dict], labels: dict) -> List[str]:
        return report_lines(runs, labels)

    @classmethod
    def check(cls, cfg: RetrievalConfig, run_cfg) -> None:
        """Its keys, whether enabled or not, and train.retrieval_mix, which plants its passkeys
        in training sequences."""
        mix = run_cfg.train.get("retrieval_mix", 0.0)  # runs saved before it existed lack it
        require(0 <= mix < 1, "train.retrieval_mix", mix,
                "a fraction in [0, 1) (the share of training sequences that are passkeys)")
        text = dataset_class(run_cfg.dataset).text
        require(mix == 0 or text, "train.retrieval_mix", mix,
                f"0 for dataset={run_cfg.dataset.name} (passkeys are planted in text)")
        for key in ("key_tokens", "keys", "trials"):
            require_positive(f"eval.retrieval.{key}", getattr(cfg, key))
        for n in cfg.lengths or []:
            require_positive("eval.retrieval.lengths", n)
        require(len(cfg.depths) > 0, "eval.retrieval.depths", list(cfg.depths),
                "a non-empty list of depths in [0, 1]")
        for depth in cfg.depths:
            require(0 <= depth <= 1, "eval.retrieval.depths", depth,
                    "depths in [0, 1] (0: the key at the start of the filler, 1: at its end)")
        require(cfg.metric in METRICS, "eval.retrieval.metric", cfg.metric, f"one of {METRICS}")
        require(math.isfinite(cfg.threshold)
                and (cfg.metric == "bits_saved" or 0 < cfg.threshold <= 1),
                "eval.retrieval.threshold", cfg.threshold,
                "a fraction in (0, 1] with metric exact_match" if cfg.metric == "exact_match"
                else "a finite number (bits saved per key token)")
        require(not cfg.enabled or text, "eval.retrieval.enabled", cfg.enabled,
                f"false for dataset={run_cfg.dataset.name} (its tasks report exact match "
                "already)")

    def __init__(self, cfg, run_cfg, data):
        super().__init__(cfg, run_cfg, data)
        self.passkeys = plan_passkeys(run_cfg, data)

    def run(self, model, device: torch.device) -> dict:
        return evaluate_retrieval(model, self.passkeys, self.run_cfg.eval,
                                  self.run_cfg.train.seq_len, device)

    @classmethod
    def write(cls, result: dict, train_len: int, run_dir, stem: str, title: str) -> None:
        plot_heatmap(result, train_len, run_dir / f"retrieval_heatmap{stem}.png", title=title)


# ---- plots and report ------------------------------------------------------------------------

SCORES = (("bits_saved", "bits saved per key token"), ("exact_match", "exact match"))


def _grid(retrieval: dict, key: str):
    lengths = sorted({c["length"] for c in retrieval["grid"]})
    depths = sorted({c["depth"] for c in retrieval["grid"]})
    values = np.full((len(depths), len(lengths)), np.nan)
    for c in retrieval["grid"]:
        if key in c:
            values[depths.index(c["depth"]), lengths.index(c["length"])] = c[key]
    return lengths, depths, values


def _heatmap(ax, retrieval: dict, key: str, train_len: int, vmax: float, title: str):
    lengths, depths, values = _grid(retrieval, key)
    # bits saved diverge from 0 (no retrieval); exact match runs from 0 to 1
    limits = dict(cmap="RdBu", vmin=-vmax, vmax=vmax) if key == "bits_saved" else dict(
        cmap="viridis", vmin=0, vmax=1)
    image = ax.imshow(values, aspect="auto", origin="upper", **limits)
    for (i, j), v in np.ndenumerate(values):
        dark = key == "exact_match" and not v > 0.6  # viridis is dark at its low end
        ax.text(j, i, "oom" if np.isnan(v) else f"{v:.2f}", ha="center", va="center", fontsize=7,
                color="white" if dark else "black")
    ax.set_xticks(range(len(lengths)), [f"{n}{'*' if n == train_len else ''}" for n in lengths])
    ax.set_yticks(range(len(depths)), [f"{d:g}" for d in depths])
    ax.set_xlabel(f"length (* training length {train_len})", fontsize=8)
    ax.set_ylabel("depth of the key", fontsize=8)
    # a re-score's label names every option it changed: wrapped, it stays over its own panel
    ax.set_title("\n".join(textwrap.wrap(title, 48)), fontsize=9)
    return image


def _bits_range(records) -> float:
    values = [c["bits_saved"] for r in records for c in r["grid"] if "bits_saved" in c]
    return max([abs(v) for v in values] + [0.5])


def plot_heatmap(retrieval: dict, train_len: int, path, title: str = "") -> None:
    """retrieval_heatmap.png: bits saved and exact match, depth by length."""

    plt = pyplot()
    fig, axes = plt.subplots(1, 2, figsize=(11, 3.8))
    for ax, (key, name) in zip(axes, SCORES):
        image = _heatmap(ax, retrieval, key, train_len, _bits_range([retrieval]), name)
        fig.colorbar(image, ax=ax)
    fig.suptitle(f"{title}\npasskey retrieval: {retrieval['keys']} key(s) of "
                 f"{retrieval['key_tokens']} tokens, {retrieval['trials']} trials per cell",
                 fontsize=9, y=1.04)
    save_figure(plt, fig, path)


def report_lines(runs: List[dict], labels: dict) -> List[str]:
    """summary.md's effective-length table (every group) and, for groups scored on retrieval,
    mean bits saved per key token by length (mean over depths, then over seeds)."""
    groups = {}
    for i, run in enumerate(runs):
        groups.setdefault(labels[i], []).append(run)
    lines = ["", "Effective context length (tokens; one value per seed where seeds differ): the "
             "largest length up to which perplexity stays within (1 + eval.ppl_tolerance) of "
             "its value at the training length; up to which passkey retrieval stays at or "
             "above eval.retrieval.threshold (RULER's absolute rule); and up to which it keeps "
             f"{RELATIVE_SHARE:.0%} of the run's own score at its shortest length (NoLiMa's "
             "relative rule).", "",
             "| encoding | by ppl | by retrieval | by retrieval, relative |", "|---|---:|---:|---:|"]
    for label, members in groups.items():
        found = [r["eval"].get("effective_length", {}) for r in members]
        # by ppl from the curve itself, so that runs recorded without the field count too
        by_ppl = [ppl_effective_length(r["eval"]["curve"], r["train"]["seq_len"],
                                       r.get("config", {}).get("eval", {}).get(
                                           "ppl_tolerance", EvalConfig.ppl_tolerance))
                  for r in members]
        scored = all(r["eval"].get("retrieval") for r in members)
        relative = [r["eval"]["retrieval"].get("relative_effective_length") for r in members
                    if scored]
        lines.append(f"| {label} | {per_seed(by_ppl)} | "
                     + (per_seed([e.get("retrieval") for e in found]) if scored else "—") + " | "
                     + (per_seed(relative) if scored else "—") + " |")
    scored = {label: [r["eval"]["retrieval"] for r in members if r["eval"].get("retrieval")]
              for label, members in groups.items()}
    scored = {label: records for label, records in scored.items() if records}
    if scored:
        lengths = sorted({p["length"] for rs in scored.values() for r in rs
                          for p in r["by_length"]})
        lines += ["", "Passkey retrieval: bits saved per key token by length (mean over depths "
                  "and seeds; 0: the key is not retrieved).", "",
                  "| encoding | " + " | ".join(map(str, lengths)) + " |",
                  "|---|" + "---:|" * len(lengths)]
        for label, records in scored.items():
            cells = []
            for n in lengths:
                xs = [p["bits_saved"] for r in records for p in r["by_length"]
                      if p["length"] == n and "bits_saved" in p]
                cells.append(f"{np.mean(xs):.3f}" if xs else "—")
            lines.append(f"| {label} | " + " | ".join(cells) + " |")
    return lines


def plot_grid(runs: List[dict], labels: dict, path) -> bool:
    """retrieval_grid.png: one bits-saved heatmap per group (its first seed's run), side by side
    on one colour scale. False, and nothing written, when no run was scored on retrieval."""

    first = {}
    for i, run in enumerate(runs):
        if run["eval"].get("retrieval"):
            first.setdefault(labels[i], run)
    if not first:
        return False
    plt = pyplot()
    cols = min(3, len(first))
    rows = math.ceil(len(first) / cols)
    fig, axes = plt.subplots(rows, cols, squeeze=False, figsize=(5 * cols, 3.8 * rows),
                             layout="constrained")
    vmax = _bits_range([run["eval"]["retrieval"] for run in first.values()])
    for ax, (label, run) in zip(axes.flat, first.items()):
        image = _heatmap(ax, run["eval"]["retrieval"], "bits_saved", run["train"]["seq_len"],
                         vmax, f"{label} (seed {run['seed']})")
    for ax in list(axes.flat)[len(first):]:
        ax.axis("off")
    fig.colorbar(image, ax=axes, label="bits saved per key token")
    save_figure(plt, fig, path)
    return True
