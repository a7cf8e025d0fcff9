"""RULER's task builders (posbench/evaluations/ruler.py scores them): each preset's instances in
the run's own tokenizer and text, for eval.ruler and train.ruler_mix.

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

Needles go between the haystack's units, as RULER's go between its sentences or needles:
noise and needle haystacks are whole units (sentences, needles) after the cut end of one at the
window's start (a window begins mid-stream, as a text window does), so that no needle splits one
and the last unit before the query is whole; a text haystack's boundaries are its edges and the
gaps between words (a token ending, or the next one starting, with whitespace); a blank's are
every token. Depth: the needle of the first answer sits at the boundary nearest depth x F of
the F haystack tokens (the lower at a tie); depth 0 is the haystack's first boundary, 1 its end,
just before the query. RULER places every needle at random and has no depth axis; here the other
needles lie at uniform random boundaries, except that a multi-value key's other values and a
chain's later assignments lie at or after the first (answers follow the text's order there).
Several needles may share a boundary (at 128 tokens vt's haystack is 8 tokens). Each (seed,
task, length, depth, trial) has its own generator, so every encoding and every run scores the
same sequences.
"""
from __future__ import annotations

import zlib
from dataclasses import dataclass
from typing import Dict, List, Optional, Tuple

import numpy as np

from posbench.core.errors import ConfigError
from posbench.data.base import dataset_config
from posbench.data.tokenize import Tokenizer

FORMAT = 2  # bump when an instance's format changes: results.json records it
# 2: needles between whole units and whole words (1 cut the last unit and planted mid-word)
SAMPLE = 1 << 24  # validation tokens read to find which tokens of each kind occur

# the formats' pieces, each encoded by the run's tokenizer
KEY, IS, STOP = "key ", " is ", ". "
ASK, ASKED = "\nwhat is key ", "? "
VAR, EQUALS = "var ", " = "
VT_ASK = "\nwhich vars are "
SEP, HYPHEN = ", ", "-"
NOISE = "the hills are quiet and the river runs slow. "  # the noise haystack's sentence
BLANK = " "  # the blank haystack's token (its first, should the tokenizer split it)
SPACE = b" \t\n\r\x0b\x0c"  # a text haystack's needles go next to these bytes
UUID_GROUP = 4  # uuid tokens between hyphens

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
    haystack: str  # noise, text, needle, blank, or list (of words: cwe, fwe)
    key: str  # words, numbers, uuids (vt: names)
    value: str
    keys: Optional[str] = None  # distinct keys, one asked (multi-key)
    values: Optional[str] = None  # values of the one key, all asked (multi-value)
    queries: Optional[str] = None  # keys, all asked in a random order (multi-query)
    chain: bool = False  # variable tracking: chains of `hops` assignments
    # cwe, fwe: the common or the frequent words of a list asked (ruler_words.py builds them)
    extract: Optional[str] = None
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
    "cwe": Preset("list", "words", "words", extract="common", ruler="10 words 30 times each (6 "
                  "below 4096 tokens) among words 3 times each (1), the 10 asked"),
    "fwe": Preset("list", "words", "words", extract="frequent", ruler="coded words at Zeta(2) "
                  "counts, the first the noise '...', the next 3 asked"),
}
# eval.ruler.tasks' and train.ruler_tasks' default: cwe and fwe are asked for by name, so that
# the defaults stay the ten tasks that docs/results.md's runs were trained and scored on
DEFAULT_TASKS = [name for name, preset in PRESETS.items() if preset.extract is None]



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
        # a text haystack's word gaps: tokens ending, or starting, with whitespace
        size = max(data.vocab_size, max(spelled) + 1)
        self.space_after, self.space_before = np.zeros(size, bool), np.zeros(size, bool)
        for i, b in spelled.items():
            if b:
                self.space_after[i], self.space_before[i] = b[-1] in SPACE, b[0] in SPACE
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
    """One sequence of length+1 tokens, the same without the needles that hold the answer, which
    of the last len(scored) tokens (the answer) are scored, and which answer item (a value, a
    name, a word) each answer token belongs to: -1 for the fed separators between items."""
    row: np.ndarray
    removed: np.ndarray
    scored: np.ndarray  # bool, over the answer's tokens
    item: np.ndarray  # int, over the answer's tokens

    @classmethod
    def of(cls, row: np.ndarray, removed: np.ndarray, answer: List[tuple]) -> "Instance":
        """From the answer's (tokens, scored) pieces: each piece with a scored token is an item
        (a uuid's fed hyphens are its item's, unscored)."""
        numbers = np.cumsum([s.any() for _, s in answer]) - 1
        item = [np.full(len(s), n if s.any() else -1) for (_, s), n in zip(answer, numbers)]
        return cls(row, removed, np.concatenate([s for _, s in answer]), np.concatenate(item))


class Task:
    """A preset under a config's counts (eval.ruler's RulerConfig, posbench/evaluations/ruler.py),
    drawn in the run's tokenizer."""

    def __init__(self, name: str, cfg, vocab: Vocabulary):
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

    def parts(self) -> Tuple[str, str]:
        """What fixed() counts and what to lessen, for check's refusal."""
        return "its needles, query and answer", "fewer or shorter needles"

    def removed(self) -> int:
        """Tokens of the needles that hold the answer."""
        if self.preset.chain:
            first, later = self.chain_sizes()
            return first + self.cfg.hops * later
        return self.n_asked * self.n_values * self.needle_size()

    def haystack_size(self, length: int) -> int:
        return length + 1 - self.fixed()

    def unit(self) -> int:
        """The haystack's unit: the noise sentence, a needle, or one token (text, blank)."""
        return {"noise": len(self.pieces[NOISE]), "needle": self.needle_size()}.get(
            self.preset.haystack, 1)

    def phase(self, hay: int) -> int:
        """Where in its unit the haystack starts, so that its `hay` tokens end with a whole one."""
        return -hay % self.unit()

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
                size = self.haystack_size(length)
                hay = -(-(self.phase(size) + size + self.removed()) // self.unit())
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
            parts, fewer = self.parts()
            raise ConfigError(
                f"{what} is not accepted: {parts} take {fixed} tokens, more than the window's "
                f"{length + 1}; expected " + (
                    f"train.seq_len of at least {fixed - 1}, or train.ruler_tasks without "
                    f"{self.name}" if train else f"eval.ruler.lengths of at least {fixed - 1} "
                    f"for {self.name}, or {fewer} (eval.ruler's counts)"))
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

    def haystack(self, rng: np.random.Generator, n: int, extra: int, taken: set,
                 split: str = "val") -> np.ndarray:
        """n haystack tokens ending with a whole unit, and `extra` more for the sequence without
        the answer's needles (the haystack runs on into their place)."""
        kind, start = self.preset.haystack, self.phase(n)
        if kind == "blank":
            return np.repeat(self.vocab.blank, n + extra)
        if kind == "text":
            return self.vocab.text(rng, n + extra, split)
        count = -(-(start + n + extra) // self.unit())
        if kind == "noise":
            return np.tile(self.pieces[NOISE], count)[start:start + n + extra]
        keys = self.draw(rng, self.preset.key, count, taken)  # needles of other keys and values
        values = self.draw(rng, self.preset.value, count, taken)
        return np.concatenate([self.needle(k, v) for (k, _), (v, _) in zip(keys, values)]
                              )[start:start + n + extra]

    def boundaries(self, hay: np.ndarray, n: int) -> np.ndarray:
        """The offsets a needle may be planted at among the first n tokens of `hay`: between
        whole units, or (text) between words and at the edges."""
        if self.preset.haystack != "text":
            return np.arange(n % self.unit(), n + 1, self.unit())
        inner = np.flatnonzero(self.vocab.space_after[hay[:max(n - 1, 0)]]
                               | self.vocab.space_before[hay[1:n]]) + 1
        return np.unique(np.concatenate([[0], inner, [n]]))

    @staticmethod
    def at_depth(depth: float, bounds: np.ndarray, n: int) -> int:
        """The boundary nearest depth x n (the lower at a tie)."""
        return int(bounds[np.argmin(np.abs(bounds - depth * n))])

    def make(self, rng: np.random.Generator, length: int, depth: float,
             split: str = "val") -> Instance:
        """One instance; a text haystack from documents of `split` (train: the training mix's)."""
        taken: set = set()
        hay_size = self.haystack_size(length)
        hay = self.haystack(rng, hay_size, self.removed(), taken, split)
        bounds = self.boundaries(hay, hay_size)
        first = self.at_depth(depth, bounds, hay_size)
        placed, query, answers = (self._chain if self.preset.chain else self._needles)(
            rng, bounds, first, taken)
        tail = [query, np.concatenate([a for a, _ in answers])]
        row = self._assemble(hay[:hay_size], placed, tail)
        removed = self._assemble(hay, [p for p in placed if not p.answer], tail)
        assert len(row) == len(removed) == length + 1, (self.name, len(row), len(removed))
        return Instance.of(row, removed, answers)

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

    def _needles(self, rng, bounds, first, taken):
        """niah: keys with their values, the asked keys' needles holding the answer, the first
        answer's at offset `first` and the others at `bounds`."""
        p = self.preset
        keys = self.draw(rng, p.key, self.n_keys, taken)
        values = [self.draw(rng, p.value, self.n_values, taken) for _ in range(self.n_keys)]
        asked = [int(i) for i in rng.permutation(self.n_keys)[:self.n_asked]]
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

    def _chain(self, rng, bounds, first, taken):
        """vt: chains X0 = V, X1 = X0, ...; chain 0 asked, every name of it the answer, its first
        assignment at offset `first`."""
        c, hops = self.cfg.chains, self.cfg.hops
        names = self.draw(rng, "names", c * (hops + 1), taken)
        values = self.draw(rng, "numbers", c, taken)
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



def instances(task: Task, cfg, length: int, depth: float) -> List[Instance]:
    """The trials of one grid cell, each from its own generator (cfg: eval.ruler's seed and
    trials)."""
    return [task.make(np.random.default_rng([cfg.seed, task.stream, length,
                                             round(depth * 10**6), trial]), length, depth)
            for trial in range(cfg.trials)]

