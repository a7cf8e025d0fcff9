"""eval.ruler: RULER's synthetic retrieval tasks (Hsieh et al. 2024, "RULER: What's the Real
Context Size of Your Long-Context Language Models?", arXiv 2404.06654; github NVIDIA/RULER,
scripts/synthetic.yaml) at posbench's scale: needle-in-a-haystack with one needle, with
distracting needles, several values and several queries, and variable tracking, in the run's own
tokenizer and text, by length x depth, scored teacher-forced in one pass.

An instance is length+1 tokens: [BOS under dataset.bos] a haystack with needles planted in it, a
query at the end, and the answer after it. Formats (each piece encoded by the run's tokenizer):

    needle "key K is V. "      query "\\nwhat is key K1, K2? "  answer "key K1 is V1, key K2 is V2"
                                (several values of one key, all asked: "key K is V1, V2")
    chain  "var X = V. var Y = X. "  query "\\nwhich vars are V? "  answer "X, Y"

The answer restates each asked key as its needle reads ("key K is "), so that a model that
copies from context can retrieve it, as the passkey's "the key is" does (RULER's answer prefix
restates the keys too).

Keys and values are drawn as tokens of the run's vocabulary (those seen in its validation text):
`words` of lowercase-letter tokens, `numbers` of digit tokens, `uuids` of hex-digit tokens with
a "-" after every fourth, vt's `names` of capital-letter tokens (byte level: short strings of
those characters; GPT-2 BPE: tokens whose bytes are all such characters). Every key, value and
name of an instance is distinct. Haystacks: `noise` (one sentence of no use repeated), `text` (a
stretch of one validation document of the run's corpus), `needle` (needles of the same form
with other keys and values) and `blank` (one token repeated: no content at all).

Depth: the needle of the first answer sits after round-to-nearest(depth x F) tokens of the F
haystack tokens (ties to the lower; over noise and needle haystacks, at the unit boundary
nearest to it, units being whole sentences or needles); depth 0 is the haystack's start, 1 just
before the query. The other needles lie at uniform random boundaries, except that a multi-value
key's other values and a chain's later assignments lie at or after the first (answers follow
the text's order there). Each (seed, task, length, depth, trial) has its own generator, so every
encoding and every run scores the same sequences.

Two scores per (task, length, depth), means over trials, on the answer tokens (the drawn
tokens of the answer; its separators and uuid hyphens are fed but not scored):
- exact_match: whether every answer token is the model's argmax given the true tokens before it
  (what greedy decoding reproduces when the answer's unscored tokens are given);
- bits_saved: the answer's mean loss per token (bits) in the same sequence with the needles that
  hold the answer taken out and the haystack run on to the same length, minus its loss with
  them: what the needles are worth to the model. 0 for a model that does not retrieve.

train.ruler_mix replaces that fraction of training sequences by instances of train.ruler_tasks
at the training length (a tiny model trained on text alone does not learn these formats), each
built by Task.make at eval.ruler's default counts, of a task and a depth drawn uniformly, with
its text haystack from training documents, all from the row's own generator of (seed, step,
row): see training_instance.

Not here: RULER's common and frequent word extraction (cwe, fwe) and QA, and RULER's prompt
templates, which are replaced by the short formats above.
"""
from __future__ import annotations

import math
import zlib
from dataclasses import dataclass, field
from typing import Dict, List, Optional, Tuple

import numpy as np
import torch

from posbench.core.errors import ConfigError, did_you_mean, require, require_positive
from posbench.core.plots import pyplot, save_figure
from posbench.core.progress import Bar
from posbench.data.base import dataset_class, dataset_config
from posbench.data.tokenize import Tokenizer
from posbench.evaluations.base import (Section, SectionConfig, by_length, effective_lengths,
                                       eval_config, plant_share, register,
                                       scored_within_memory, set_eval_options,
                                       with_train_length)

FORMAT = 1  # bump when an instance's format changes: results.json records it
SAMPLE = 1 << 24  # validation tokens read to find which tokens of each kind occur

# the formats' pieces, each encoded by the run's tokenizer
KEY, IS, STOP = "key ", " is ", ". "
ASK, ASKED = "\nwhat is key ", "? "
VAR, EQUALS = "var ", " = "
VT_ASK = "\nwhich vars are "
SEP, HYPHEN = ", ", "-"
NOISE = "the hills are quiet and the river runs slow. "  # the noise haystack's sentence
BLANK = " "  # the blank haystack's token (its first, should the tokenizer split it)
UUID_GROUP = 4  # uuid tokens between hyphens
# train.ruler_mix: a batch's share and rows are drawn from the generator of (seed, step,
# MIX_STREAM), each planted row from that of (seed, step, MIX_STREAM, row + 1): four words where
# an evaluation instance's are five (seed, task, length, depth, trial), so that no training
# generator is an evaluation's (nor the batch's (seed, step), nor retrieval_mix's stream 7)
MIX_STREAM = 11

# the characters of each kind of drawn token
CHARSETS = {"words": b"abcdefghijklmnopqrstuvwxyz", "numbers": b"0123456789",
            "uuids": b"0123456789abcdef", "names": b"ABCDEFGHIJKLMNOPQRSTUVWXYZ"}
# the config key giving each kind's tokens per item
TOKENS_KEY = {"words": "key_tokens", "numbers": "number_tokens", "uuids": "uuid_tokens",
              "names": "name_tokens"}


@dataclass(frozen=True)
class Preset:
    """One task: a haystack, what keys and values are drawn as, and which config counts give
    its needles (None: one). `ruler`: RULER's own settings, which it scales."""
    haystack: str  # noise, text, needle or blank
    key: str  # words, numbers, uuids (vt: names)
    value: str
    keys: Optional[str] = None  # distinct keys, one asked (multi-key)
    values: Optional[str] = None  # values of the one key, all asked (multi-value)
    queries: Optional[str] = None  # keys, all asked in a random order (multi-query)
    chain: bool = False  # variable tracking: chains of `hops` assignments
    ruler: str = ""


PRESETS: Dict[str, Preset] = {
    "niah_single_1": Preset("noise", "words", "numbers", ruler="one needle, word -> 7-digit "
                            "number, in repeated noise"),
    "niah_single_2": Preset("text", "words", "numbers", ruler="one needle, word -> 7-digit "
                            "number, in essays"),
    "niah_single_3": Preset("text", "words", "uuids", ruler="one needle, word -> UUID, in "
                            "essays"),
    "niah_multikey_1": Preset("text", "words", "numbers", keys="keys", ruler="4 needles of "
                              "distinct words, one asked, in essays"),
    "niah_multikey_2": Preset("needle", "words", "numbers", ruler="one needle in a haystack of "
                              "word -> number needles"),
    "niah_multikey_3": Preset("needle", "uuids", "uuids", ruler="one needle in a haystack of "
                              "UUID -> UUID needles"),
    "niah_multivalue": Preset("text", "words", "numbers", values="values", ruler="4 values of "
                              "one word, all asked, in essays"),
    "niah_multiquery": Preset("text", "words", "numbers", queries="queries", ruler="4 words, "
                              "all asked, in essays"),
    "vt": Preset("noise", "names", "numbers", chain=True, ruler="one chain of 4 hops from a "
                 "5-digit number, every name of it asked, in repeated noise"),
    # not RULER's: niah_single_1 over a haystack of one repeated token, so that the distance to
    # the needle and the distraction of the haystack can be told apart
    "niah_control": Preset("blank", "words", "numbers", ruler="(none: niah_single_1 over one "
                           "repeated token)"),
}


@dataclass
class RulerConfig(SectionConfig):
    """eval.ruler: RULER's synthetic retrieval tasks by length and depth, language-model runs
    only (posbench/evaluations/ruler.py)."""
    tasks: List[str] = field(default_factory=lambda: list(PRESETS))
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
    # effective context, per task and over the tasks' mean: the largest length up to which
    # bits saved per answer token stays >= threshold (RULER's absolute rule; 1 bit, as the
    # passkey's), and up to which it keeps 85% of its value at the shortest length (NoLiMa's)
    threshold: float = 1.0


def ruler_lengths(eval_cfg, train_len: int) -> List[int]:
    r = Ruler.typed(eval_cfg)
    return sorted(set(r.lengths)) if r.lengths else list(with_train_length(eval_cfg,
                                                                           train_len).lengths)


class Vocabulary:
    """The run's tokenizer as the tasks draw from it: its encoder, the tokens of each kind seen
    in its validation text, and stretches of its validation documents."""

    def __init__(self, data, dataset_cfg):
        tokenizer = Tokenizer(dataset_config(dataset_cfg))
        val = np.asarray(data.tokens[data.val_docs[0]:min(data.val_docs[-1],
                                                          data.val_docs[0] + SAMPLE)])
        seen = np.bincount(val, minlength=data.vocab_size)
        if tokenizer.bpe is None:
            self.encode = lambda text: np.frombuffer(text.encode(), np.uint8).astype(np.int64)
            spelled = {b: bytes([b]) for b in range(256)}
        else:
            bpe = tokenizer.bpe
            self.encode = lambda text: bpe.encode_batch([text])[0].astype(np.int64)
            spelled = {int(bpe.ids[r]): bpe.encoding.decode_single_token_bytes(r)
                       for r in range(bpe.encoding.n_vocab)}
        self.spelled = {}  # id -> bytes, of the tokens drawn from
        self.alphabets = {}
        for kind, chars in CHARSETS.items():
            ids = sorted(i for i, b in spelled.items()
                         if b and set(b) <= set(chars) and i < len(seen) and seen[i] > 0)
            self.alphabets[kind] = np.array(ids, dtype=np.int64)
            self.spelled.update((i, spelled[i]) for i in ids)
        self.data = data
        self.start = np.array([data.bos] if getattr(data, "bos", None) is not None else [],
                              dtype=np.int64)
        self.blank = self.encode(BLANK)[:1]

    def spell(self, ids) -> bytes:
        return b"".join(self.spelled[int(i)] for i in ids)

    def docs(self, split: str) -> np.ndarray:
        return self.data.val_docs if split == "val" else self.data.train_docs

    def longest_document(self, split: str = "val") -> int:
        docs = self.docs(split)
        return int(np.diff(docs).max()) if len(docs) > 1 else 0

    def text(self, rng: np.random.Generator, n: int, split: str = "val") -> np.ndarray:
        """n tokens of one document of the split (validation: the evaluation's; train: the
        training mix's), from a uniform start among all that fit."""
        docs = self.docs(split)
        counts = np.maximum(np.diff(docs) - n + 1, 0)
        cum = np.cumsum(counts)
        assert cum[-1] > 0, n  # Task.check refused lengths without such a document
        pick = int(rng.integers(cum[-1]))
        doc = int(np.searchsorted(cum, pick, side="right"))
        start = int(docs[doc] + pick - (cum[doc] - counts[doc]))
        return np.asarray(self.data.tokens[start:start + n], dtype=np.int64)


@dataclass
class Placed:
    """A needle (or an assignment) at a haystack offset; `order` breaks ties at one offset."""
    offset: int
    order: tuple
    tokens: np.ndarray
    answer: bool  # it holds part of the answer: taken out of the sequence without the needles


@dataclass
class Instance:
    """One sequence of length+1 tokens, the same without the needles that hold the answer, and
    which of the last len(scored) tokens (the answer) are scored."""
    row: np.ndarray
    removed: np.ndarray
    scored: np.ndarray  # bool, over the answer's tokens


class Task:
    """A preset under a config's counts, drawn in the run's tokenizer."""

    def __init__(self, name: str, cfg: RulerConfig, vocab: Vocabulary):
        self.name, self.preset, self.cfg, self.vocab = name, PRESETS[name], cfg, vocab
        p, enc = self.preset, vocab.encode
        self.pieces = {text: enc(text) for text in (KEY, IS, STOP, ASK, ASKED, VAR, EQUALS,
                                                    VT_ASK, SEP, HYPHEN, NOISE)}
        self.stream = zlib.crc32(name.encode())  # its own sequences, apart from other tasks'
        count = lambda key: getattr(cfg, key) if key else 1
        if p.chain:
            self.n_keys, self.n_values, self.n_asked = cfg.chains, 1, 1
        else:
            self.n_keys = count(p.keys) if p.keys else count(p.queries)
            self.n_values = count(p.values)
            self.n_asked = count(p.queries)

    # ---- sizes, known before any draw -----------------------------------------------------

    def size(self, kind: str) -> int:
        """Tokens of one drawn item of `kind` (a uuid's hyphens included)."""
        n = getattr(self.cfg, TOKENS_KEY[kind])
        return n + ((n - 1) // UUID_GROUP) * len(self.pieces[HYPHEN]) if kind == "uuids" else n

    def needle_size(self) -> int:
        p, n = self.preset, lambda text: len(self.pieces[text])
        return n(KEY) + self.size(p.key) + n(IS) + self.size(p.value) + n(STOP)

    def chain_sizes(self) -> Tuple[int, int]:
        """Tokens of a chain's first assignment and of each later one."""
        n, name = lambda text: len(self.pieces[text]), self.size("names")
        return (n(VAR) + name + n(EQUALS) + self.size("numbers") + n(STOP),
                n(VAR) + name + n(EQUALS) + name + n(STOP))

    def answer_size(self) -> int:
        """Tokens after the query: vt's names; niah's "key K is " and the values of each asked
        key."""
        if self.preset.chain:
            count, item, keys = self.cfg.hops + 1, self.size("names"), 0
        else:
            count, item = self.n_asked * self.n_values, self.size(self.preset.value)
            keys = self.n_asked * (len(self.pieces[KEY]) + self.size(self.preset.key)
                                   + len(self.pieces[IS]))
        return keys + count * item + (count - 1) * len(self.pieces[SEP])

    def fixed(self) -> int:
        """Tokens of an instance that are not haystack: its start, needles, query and answer."""
        n = lambda text: len(self.pieces[text])
        if self.preset.chain:
            first, later = self.chain_sizes()
            needles = self.cfg.chains * (first + self.cfg.hops * later)
            query = n(VT_ASK) + self.size("numbers") + n(ASKED)
        else:
            needles = self.n_keys * self.n_values * self.needle_size()
            query = (n(ASK) + self.n_asked * self.size(self.preset.key)
                     + (self.n_asked - 1) * n(SEP) + n(ASKED))
        return len(self.vocab.start) + needles + query + self.answer_size()

    def removed(self) -> int:
        """Tokens of the needles that hold the answer."""
        if self.preset.chain:
            first, later = self.chain_sizes()
            return first + self.cfg.hops * later
        return self.n_asked * self.n_values * self.needle_size()

    def haystack_size(self, length: int) -> int:
        return length + 1 - self.fixed()

    def unit(self) -> int:
        """The haystack's unit: needles are planted at multiples of it (and at its end)."""
        return {"noise": len(self.pieces[NOISE]), "needle": self.needle_size()}.get(
            self.preset.haystack, 1)

    def demand(self, length: int) -> Dict[str, int]:
        """Distinct items of each kind an instance at `length` draws."""
        p, need = self.preset, {}
        add = lambda kind, k: need.__setitem__(kind, need.get(kind, 0) + k)
        if p.chain:
            add("names", self.cfg.chains * (self.cfg.hops + 1))
            add("numbers", self.cfg.chains)
        else:
            add(p.key, self.n_keys)
            add(p.value, self.n_keys * self.n_values)
            if p.haystack == "needle":
                hay = -(-(self.haystack_size(length) + self.removed()) // self.unit())
                add(p.key, hay)
                add(p.value, hay)
        return need

    def check(self, length: int, split: str = "val") -> None:
        """Refuses, in one line, a length whose window the instance does not fit, items the
        vocabulary cannot draw distinctly enough of, and text no document of the split holds
        (split train: the training mix's instances at train.seq_len, named so)."""
        fixed, train = self.fixed(), split == "train"
        what = (f"train.ruler_tasks={self.name} with train.seq_len={length}" if train
                else f"eval.ruler.tasks={self.name} at length {length}")
        instead = f"a shorter train.seq_len or train.ruler_tasks without {self.name}"
        if fixed > length + 1:
            raise ConfigError(
                f"{what} is not accepted: its needles, query and answer take {fixed} tokens, "
                f"more than the window's {length + 1}; expected " + (
                    f"train.seq_len of at least {fixed - 1}, or train.ruler_tasks without "
                    f"{self.name}" if train else f"eval.ruler.lengths of at least {fixed - 1} "
                    f"for {self.name}, or fewer or shorter needles (eval.ruler's counts)"))
        for kind, need in self.demand(length).items():
            alphabet, n = len(self.vocab.alphabets[kind]), getattr(self.cfg, TOKENS_KEY[kind])
            if need > alphabet ** n:
                drawn = (f"{self.name} at length {length} draws {need} distinct {kind}, and {n} "
                         f"token(s) of the {alphabet} {kind} tokens of the run's vocabulary "
                         f"make {alphabet ** n}")
                raise ConfigError(
                    f"{what} is not accepted: {drawn}; expected {instead}" if train else
                    f"eval.ruler.{TOKENS_KEY[kind]}={n} is not accepted: {drawn}; expected a "
                    f"larger eval.ruler.{TOKENS_KEY[kind]} or shorter lengths")
        if self.preset.haystack == "text":
            need, longest = self.haystack_size(length) + self.removed(), \
                self.vocab.longest_document(split)
            if need > longest:
                raise ConfigError(
                    f"{what} is not accepted: its haystack takes {need} tokens of one "
                    f"{'training' if train else 'validation'} document, and the longest of "
                    f"{self.vocab.data.name} has {longest}; expected "
                    + (instead if train else "shorter eval.ruler.lengths"))

    # ---- drawing ----------------------------------------------------------------------------

    def draw(self, rng: np.random.Generator, kind: str, count: int, taken: set):
        """`count` items of `kind` spelled unlike any in `taken` (which they join): each its
        tokens and which of them were drawn (not a uuid's hyphens)."""
        alphabet, n = self.vocab.alphabets[kind], getattr(self.cfg, TOKENS_KEY[kind])
        out = []
        while len(out) < count:
            ids = alphabet[rng.integers(len(alphabet), size=n)]
            spelled = self.vocab.spell(ids)
            if spelled in taken:
                continue
            taken.add(spelled)
            parts, drawn = [], []
            for g in range(0, n, UUID_GROUP if kind == "uuids" else n):
                if g:
                    parts.append(self.pieces[HYPHEN])
                    drawn.append(np.zeros(len(self.pieces[HYPHEN]), dtype=bool))
                parts.append(ids[g:g + (UUID_GROUP if kind == "uuids" else n)])
                drawn.append(np.ones(len(parts[-1]), dtype=bool))
            out.append((np.concatenate(parts), np.concatenate(drawn)))
        return out

    def needle(self, key: np.ndarray, value: np.ndarray) -> np.ndarray:
        return np.concatenate([self.pieces[KEY], key, self.pieces[IS], value, self.pieces[STOP]])

    def haystack(self, rng: np.random.Generator, n: int, taken: set,
                 split: str = "val") -> np.ndarray:
        kind = self.preset.haystack
        if kind == "blank":
            return np.repeat(self.vocab.blank, n)
        if kind == "text":
            return self.vocab.text(rng, n, split)
        if kind == "noise":
            return np.tile(self.pieces[NOISE], -(-n // self.unit()))[:n]
        count = -(-n // self.unit())  # needles: of other keys and values
        keys = self.draw(rng, self.preset.key, count, taken)
        values = self.draw(rng, self.preset.value, count, taken)
        return np.concatenate([self.needle(k, v) for (k, _), (v, _) in zip(keys, values)]
                              + [np.zeros(0, dtype=np.int64)])[:n]

    def boundaries(self, n: int) -> np.ndarray:
        """The offsets a needle may be planted at in a haystack of n tokens."""
        return np.unique(np.append(np.arange(0, n + 1, self.unit()), n))

    def at_depth(self, depth: float, n: int) -> int:
        """The boundary nearest depth x n (the lower at a tie)."""
        b = self.boundaries(n)
        return int(b[np.argmin(np.abs(b - depth * n))])

    def make(self, rng: np.random.Generator, length: int, depth: float,
             split: str = "val") -> Instance:
        """One instance; a text haystack from documents of `split` (train: the training mix's)."""
        taken: set = set()
        placed, query, answers = (self._chain if self.preset.chain else self._needles)(
            rng, length, depth, taken)
        hay_size = self.haystack_size(length)
        hay = self.haystack(rng, hay_size + self.removed(), taken, split)
        tail = [query, np.concatenate([a for a, _ in answers])]
        row = self._assemble(hay[:hay_size], placed, tail)
        removed = self._assemble(hay, [p for p in placed if not p.answer], tail)
        assert len(row) == len(removed) == length + 1, (self.name, len(row), len(removed))
        return Instance(row, removed, np.concatenate([s for _, s in answers]))

    def _assemble(self, hay: np.ndarray, placed: List[Placed], tail) -> np.ndarray:
        pieces, at = [self.vocab.start], 0
        for p in sorted(placed, key=lambda p: (p.offset, p.order)):
            pieces += [hay[at:p.offset], p.tokens]
            at = p.offset
        return np.concatenate(pieces + [hay[at:], *tail]).astype(np.int64)

    @staticmethod
    def _fed(tokens: np.ndarray) -> tuple:
        """Answer tokens that are fed but not scored."""
        return tokens, np.zeros(len(tokens), dtype=bool)

    def _joined(self, items) -> List[tuple]:
        """Items (tokens, drawn) separated by SEP, as (tokens, scored) pieces."""
        out = []
        for i, item in enumerate(items):
            if i:
                out.append(self._fed(self.pieces[SEP]))
            out.append(item)
        return out

    def _needles(self, rng, length, depth, taken):
        """niah: keys with their values, the asked keys' needles holding the answer."""
        p = self.preset
        keys = self.draw(rng, p.key, self.n_keys, taken)
        values = [self.draw(rng, p.value, self.n_values, taken) for _ in range(self.n_keys)]
        asked = [int(i) for i in rng.permutation(self.n_keys)[:self.n_asked]]
        hay = self.haystack_size(length)
        bounds = self.boundaries(hay)
        first = self.at_depth(depth, hay)
        placed = []
        for k in range(self.n_keys):
            for j in range(self.n_values):
                if k == asked[0] and j == 0:
                    offset, order = first, (0,)
                elif k == asked[0]:  # the asked key's other values: after its first
                    offset, order = int(rng.choice(bounds[bounds >= first])), (1, k, j)
                else:
                    offset, order = int(rng.choice(bounds)), (1, k, j)
                placed.append((Placed(offset, order, self.needle(keys[k][0], values[k][j][0]),
                                      k in asked), k, j))
        query = np.concatenate([self.pieces[ASK],
                                *[t for t, _ in self._joined([keys[k] for k in asked])],
                                self.pieces[ASKED]])
        # per asked key, in the query's order: "key K is " and its values in the text's order
        answer = []
        for i, k in enumerate(asked):
            mine = sorted((p for p in placed if p[1] == k), key=lambda p: (p[0].offset,
                                                                           p[0].order))
            if i:
                answer.append(self._fed(self.pieces[SEP]))
            answer.append(self._fed(np.concatenate([self.pieces[KEY], keys[k][0],
                                                    self.pieces[IS]])))
            answer += self._joined([values[k][j] for _, _, j in mine])
        return [p for p, _, _ in placed], query, answer

    def _chain(self, rng, length, depth, taken):
        """vt: chains X0 = V, X1 = X0, ...; chain 0 asked, every name of it the answer."""
        c, hops = self.cfg.chains, self.cfg.hops
        names = self.draw(rng, "names", c * (hops + 1), taken)
        values = self.draw(rng, "numbers", c, taken)
        hay = self.haystack_size(length)
        bounds = self.boundaries(hay)
        first = self.at_depth(depth, hay)
        placed = []
        for chain in range(c):
            mine = names[chain * (hops + 1):(chain + 1) * (hops + 1)]
            if chain == 0:
                later = np.sort(rng.choice(bounds[bounds >= first], size=hops))
                offsets = [first, *map(int, later)]
            else:
                offsets = list(map(int, np.sort(rng.choice(bounds, size=hops + 1))))
            for step in range(hops + 1):
                source = values[chain][0] if step == 0 else mine[step - 1][0]
                tokens = np.concatenate([self.pieces[VAR], mine[step][0], self.pieces[EQUALS],
                                         source, self.pieces[STOP]])
                placed.append(Placed(offsets[step], (chain, step), tokens, chain == 0))
        query = np.concatenate([self.pieces[VT_ASK], values[0][0], self.pieces[ASKED]])
        return placed, query, self._joined(names[:hops + 1])


def plan_tasks(cfg: RulerConfig, run_cfg, data) -> Dict[str, Task]:
    """The tasks of the run's ruler evaluation, after refusing any that a length cannot hold."""
    vocab = Vocabulary(data, run_cfg.dataset)
    tasks = {name: Task(name, cfg, vocab) for name in cfg.tasks}
    for length in ruler_lengths(run_cfg.eval, run_cfg.train.seq_len):
        for task in tasks.values():
            task.check(length)
    return tasks


def instances(task: Task, cfg: RulerConfig, length: int, depth: float) -> List[Instance]:
    """The trials of one grid cell, each from its own generator."""
    return [task.make(np.random.default_rng([cfg.seed, task.stream, length,
                                             round(depth * 10**6), trial]), length, depth)
            for trial in range(cfg.trials)]


def training_tasks(run_cfg, data) -> List[Task]:
    """train.ruler_mix's tasks, at eval.ruler's default counts, after refusing any that the
    training length or the training documents cannot hold."""
    vocab = Vocabulary(data, run_cfg.dataset)
    tasks = [Task(name, RulerConfig(), vocab) for name in run_cfg.train.ruler_tasks]
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


def answer_scores(model, rows: torch.Tensor, scored: torch.Tensor):
    """Per row: the mean loss (bits per token) of its scored answer tokens, which are among its
    last len(scored), and whether each of them is the model's argmax."""
    span = len(scored)
    h = model.hidden(rows[:, :-1])[:, -span:]
    logp = torch.log_softmax(model.head(h).float(), -1)
    target = rows[:, -span:]
    loss = -logp.gather(-1, target.unsqueeze(-1)).squeeze(-1) / math.log(2)
    hits = logp.argmax(-1) == target
    return loss[:, scored].mean(1), hits[:, scored].all(1)


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

                def cell_scores():
                    parts = [answer_scores(model, rows[i:i + per_batch], scored)
                             for i in range(0, len(rows), per_batch)]
                    loss, hits = (torch.cat(s).double() for s in zip(*parts))
                    with_needles, without = loss[:len(made)], loss[len(made):]
                    return {"exact_match": hits[:len(made)].mean().item(),
                            "loss": with_needles.mean().item(),
                            "loss_removed": without.mean().item(),
                            "bits_saved": (without - with_needles).mean().item()}

                grid.append({"length": length, "depth": depth,
                             **scored_within_memory(device, cell_scores)})
                bar.update()
            point = by_length(grid)[-1]
            bar.log(f"{name} length {length}", bits_saved=f"{point['bits_saved']:.3f}"
                    if "bits_saved" in point else "oom")
        out[name] = {"haystack": task.preset.haystack, "ruler": task.preset.ruler,
                     "answer_tokens": int(made[0].scored.sum()), "grid": grid,
                     **effective_lengths(by_length(grid), cfg.threshold)}
    bar.close()
    return {"format": FORMAT, "units": "bits per answer token", "trials": cfg.trials,
            "seed": cfg.seed, "depths": list(cfg.depths), "threshold": cfg.threshold,
            "counts": {key: getattr(cfg, key) for key in (*TOKENS_KEY.values(), "keys",
                                                          "values", "queries", "hops",
                                                          "chains")},
            "tasks": out, **effective_lengths(average(out), cfg.threshold)}


def average(tasks: Dict[str, dict]) -> List[dict]:
    """Per length, the mean over tasks of their by_length scores (RULER's average), where every
    task has them."""
    out = []
    lengths = sorted({p["length"] for t in tasks.values() for p in t["by_length"]})
    for length in lengths:
        points = [p for t in tasks.values() for p in t["by_length"] if p["length"] == length]
        point = {"length": length}
        if len(points) == len(tasks) and all("bits_saved" in p for p in points):
            for key in ("exact_match", "bits_saved"):
                point[key] = float(np.mean([p[key] for p in points]))
        out.append(point)
    return out


@register("ruler", "RULER's synthetic retrieval tasks (needle in a haystack: single, multi-key, "
          "multi-value, multi-query; variable tracking) by length and depth: exact match and "
          "bits saved per answer token")
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
        tasks = list(t.get("ruler_tasks", PRESETS))
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
        for key in ("trials", *TOKENS_KEY.values(), "keys", "values", "queries", "hops",
                    "chains"):
            require_positive(f"eval.ruler.{key}", getattr(cfg, key))
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
    def length_metrics(cls, result: dict) -> Dict[int, dict]:
        out: Dict[int, dict] = {}
        series = [("ruler", result["by_length"])] + [
            (f"ruler_{name}", task["by_length"]) for name, task in result["tasks"].items()]
        for prefix, points in series:
            for p in points:
                if "bits_saved" in p:
                    out.setdefault(p["length"], {}).update({
                        f"eval/{prefix}_bits_saved": p["bits_saved"],
                        f"eval/{prefix}_exact_match": p["exact_match"]})
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
    return (f"{np.mean([p['bits_saved'] for p in points]):.2f} "
            f"({np.mean([p['exact_match'] for p in points]):.2f})")


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
             "(exact match) by length, means over depths and seeds; 0 bits: the needles are of "
             "no use to the model."]
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
    return lines
