"""RULER's aggregation tasks at posbench's scale: common-word extraction (cwe) and frequent-word
extraction (fwe), after NVIDIA/RULER's scripts/data/synthetic/common_words_extraction.py and
freq_words_extraction.py. The other presets are built in ruler_tasks.py; ruler.py scores both.

An instance is length+1 tokens: [BOS under dataset.bos] blank tokens that pad the window, a list
of words separated by " ", the query and the answer (each piece encoded by the run's tokenizer):

    cwe   "abc kel abc zqp ... \\nmost common words? abc, kel"
    fwe   "... abc ... ... kel ... \\nmost frequent words? abc, kel, zqp"

Words are `key_tokens` lowercase-letter tokens, all distinct within an instance (Task.draw).
The answer gives the asked words in the order of their first occurrence in the list: RULER's
score (string_match_all, the fraction of the asked words found in the output) ignores order, and
a teacher-forced answer needs one; the text's is the one niah_multivalue's answer follows. Every
word's tokens are scored, its separators fed.

cwe: `common` words (RULER's num_cw, 10) occur `common_repeats` times each (freq_cw: 30 from
4096 tokens on, 6 below) and as many other words `uncommon_repeats` times each (freq_ucw: 3,
below 4096 tokens 1) as the window holds, in a random order. RULER fills its context the same
way, by searching the number of words; its numbering of the list ("1. word 2. word") is dropped,
which would take a third of a byte-level window.

fwe: the word of rank r = 1, 2, ... occurs floor(N r^-alpha / zeta(alpha)) times (RULER's counts,
fixed rather than drawn), the word of rank 1 being the noise "..." (RULER's vocab[0]), and the
`frequent` (RULER: 3) words of the ranks after it are asked. N is the largest whose list fits the
window and under which every asked word occurs more often than the rank after the asked ones:
RULER steps N up by length // 32 words until the list passes the window and takes the step
before (the largest to within a step), and at its lengths no two of those ranks tie, while at
posbench's they can (at N = 42 ranks 4 and 5 occur once each). RULER's vocabulary of
length // 50 coded words is more than get a count at any of its lengths; here every rank with a
count is a word.

Depth plays no part in either: the words are spread through the whole list, as RULER's are, so
the cells of a length's depths are more trials of the same task, each from its own generator.
The sequence without the answer (bits_saved's) replaces every occurrence of an asked word in
place by a word drawn afresh, each once, so that the list keeps its length and each other word
its place.
"""
from __future__ import annotations

import functools
from typing import Dict, List, Tuple

import numpy as np

from posbench.evaluations.ruler_tasks import SEP, Instance, Task, Vocabulary

LIST_SEP = " "  # between the list's words
DOTS = "..."  # fwe's noise, its word of rank 1
ASKS = {"common": "\nmost common words? ", "frequent": "\nmost frequent words? "}


@functools.lru_cache(maxsize=None)
def zeta(alpha: float, terms: int = 64) -> float:
    """Riemann's zeta at alpha > 1: the first terms - 1 terms of the sum, and the Euler-Maclaurin
    estimate of the rest (its error below terms^(-alpha - 5))."""
    k = np.arange(1, terms, dtype=np.float64)
    n = float(terms)
    return float(np.sum(k ** -alpha) + n ** (1 - alpha) / (alpha - 1) + n ** -alpha / 2
                 + alpha * n ** (-alpha - 1) / 12
                 - alpha * (alpha + 1) * (alpha + 2) * n ** (-alpha - 3) / 720)


def zeta_counts(n: int, alpha: float) -> np.ndarray:
    """fwe's occurrences by rank: floor(n r^-alpha / zeta(alpha)) for r = 1, 2, ..., the ranks
    with none left out."""
    top = int((n / zeta(alpha)) ** (1 / alpha)) + 2
    r = np.arange(1, top + 1, dtype=np.float64)
    counts = np.floor(n * r ** -alpha / zeta(alpha)).astype(np.int64)
    return counts[counts > 0]


class WordList(Task):
    """cwe or fwe under a config's counts, drawn in the run's tokenizer."""

    def __init__(self, name: str, cfg, vocab: Vocabulary):
        super().__init__(name, cfg, vocab)
        self.common = self.preset.extract == "common"
        self.ask = ASKS[self.preset.extract]
        for text in (LIST_SEP, DOTS, self.ask):
            self.pieces[text] = vocab.encode(text)
        self.n_asked = cfg.common if self.common else cfg.frequent
        self.layouts: Dict[int, np.ndarray] = {}
        if not self.common:  # fwe's smallest N that ranks the asked words
            self.least = 1
            while not self.ranked(self.least)[1]:
                self.least += 1

    # ---- sizes, known before any draw -----------------------------------------------------

    def asked(self) -> range:
        """Which entries of a layout are the asked words (fwe's entry 0 is the noise)."""
        return range(self.n_asked) if self.common else range(1, self.n_asked + 1)

    def list_size(self, counts: np.ndarray) -> int:
        """Tokens of a list whose word i occurs counts[i] times (fwe: word 0 the noise)."""
        dots = 0 if self.common else int(counts[0])
        items = int(counts.sum())
        return (dots * len(self.pieces[DOTS]) + (items - dots) * self.size("words")
                + (items - 1) * len(self.pieces[LIST_SEP]))

    def answer_size(self) -> int:
        return self.n_asked * self.size("words") + (self.n_asked - 1) * len(self.pieces[SEP])

    def budget(self, length: int) -> int:
        """Tokens the list and its padding take at `length`."""
        return (length + 1 - len(self.vocab.start) - len(self.pieces[self.ask])
                - self.answer_size())

    def ranked(self, n: int):
        """fwe's counts at N = n, and whether each asked word occurs more often than the next
        rank (0 times where it has none)."""
        counts = zeta_counts(n, self.cfg.alpha)
        last = self.n_asked  # the last asked word's entry
        return counts, len(counts) > last and counts[last] > (
            counts[last + 1] if len(counts) > last + 1 else 0)

    def shortest(self) -> np.ndarray:
        """The layout of the shortest instance: cwe's with one uncommon word, fwe's at the
        smallest N that ranks the asked words."""
        c = self.cfg
        if self.common:
            return np.array([c.common_repeats] * c.common + [c.uncommon_repeats])
        return self.ranked(self.least)[0]

    def layout(self, length: int) -> np.ndarray:
        """Occurrences of each word of the list at `length` (check has refused a length with
        none): cwe's uncommon words, fwe's N, as many as fit."""
        if length not in self.layouts:
            c, budget = self.cfg, self.budget(length)
            if self.common:
                item = self.size("words") + len(self.pieces[LIST_SEP])
                uncommon = ((budget + len(self.pieces[LIST_SEP])) // item
                            - c.common * c.common_repeats) // c.uncommon_repeats
                counts = np.array([c.common_repeats] * c.common
                                  + [c.uncommon_repeats] * uncommon)
            else:
                n, best = self.least, None  # the list's tokens grow with N
                while True:
                    counts, ranks = self.ranked(n)
                    if self.list_size(counts) > budget:
                        break
                    best = counts if ranks else best
                    n += 1
                counts = best
            self.layouts[length] = counts
        return self.layouts[length]

    def fixed(self) -> int:
        return (len(self.vocab.start) + self.list_size(self.shortest())
                + len(self.pieces[self.ask]) + self.answer_size())

    def parts(self) -> Tuple[str, str]:
        c = self.cfg
        if self.common:
            shortest = (f"{c.common} words {c.common_repeats} times each and one "
                        f"{c.uncommon_repeats} time(s)")
        else:
            shortest = (f"N = {self.least}: '{DOTS}' and {len(self.shortest()) - 1} words at "
                        f"Zeta({c.alpha}) counts, the {c.frequent} asked above the rest")
        return (f"its shortest list ({shortest}), query and answer",
                "fewer asked words or fewer repeats")

    def demand(self, length: int) -> Dict[str, int]:
        """The list's words and the fresh ones that replace the asked words' occurrences."""
        counts = self.layout(length)
        words = len(counts) - (0 if self.common else 1)
        return {"words": words + int(counts[list(self.asked())].sum())}

    # ---- drawing ----------------------------------------------------------------------------

    def make(self, rng: np.random.Generator, length: int, depth: float,
             split: str = "val") -> Instance:
        """One instance; depth and split play no part (no needle, no text)."""
        counts, taken = self.layout(length), set()
        offset = 0 if self.common else 1  # fwe's entry 0 is the noise
        words = [(self.pieces[DOTS], None)] * offset + self.draw(rng, "words",
                                                                 len(counts) - offset, taken)
        order = rng.permutation(np.repeat(np.arange(len(counts)), counts))
        asked = set(self.asked())
        fresh = iter(self.draw(rng, "words", int(counts[list(asked)].sum()), taken))
        kept = [words[i][0] for i in order]
        removed = [next(fresh)[0] if i in asked else tokens for i, tokens in zip(order, kept)]
        first = [int(i) for i in dict.fromkeys(order.tolist()) if i in asked]
        answer = self._joined([words[i] for i in first])
        pad = np.repeat(self.vocab.blank, self.budget(length) - self.list_size(counts))
        tail = [self.pieces[self.ask], *[tokens for tokens, _ in answer]]
        row, without = (np.concatenate([self.vocab.start, pad, *self._listed(items), *tail])
                        for items in (kept, removed))
        assert len(row) == len(without) == length + 1, (self.name, len(row), len(without))
        return Instance.of(row, without, answer)

    def _listed(self, items: List[np.ndarray]) -> List[np.ndarray]:
        out = []
        for i, tokens in enumerate(items):
            if i:
                out.append(self.pieces[LIST_SEP])
            out.append(tokens)
        return out
