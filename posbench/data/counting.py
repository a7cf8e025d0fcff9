"""The Counting task of Golovneva, Wang, Weston and Sukhbaatar 2024 ("Contextual Position
Encoding: Learning to Count What's Important", arXiv 2405.18719, Table 3), as its reference
generator makes it.

The reference is github.com/facebookresearch/RAM, projects/cope: scripts/count_data_gen.py draws
the instances (10k for training, 1k each for validation and test per number of variables) and
src/data/tokenizer.py splits them into words. An instance is a short program over `nvars`
variables (the first nvars of a..z) followed by a question, `print v`, whose answer is v's value
at that point. Each statement is drawn with weights 1 : 50 : 7 from

- `v = 0 ;`  a variable drawn uniformly from all nvars is set to 0 (it now exists);
- `pass;`    nothing happens;
- `v ++;`    a variable drawn uniformly from those that exist is incremented;

an increment is drawn again (the statement's kind too) when no variable exists yet or when the
drawn one is already 10 (values never pass 10). The question asks about a variable drawn
uniformly from those that exist; a program in which none does is drawn again. The answer is
0..10.

Task here         reference data (count_data_gen.py --nvars N)   λ counts
task_counting_1   count_var1_step512_train10k                     the program's tokens
task_counting_3   count_var3_step512_train10k                     the program's tokens
task_counting_5   count_var5_step512_train10k                     the program's tokens

How an instance is written: BOS, the program, `print`, the variable, SEP, the answer; the answer
is the one scored token (the reference trains and scores on the answer alone, --train-on
answer). The reference's words are the tokens, as its whitespace tokenizer makes them: `v = 0 ;`
is four tokens, `pass;` one, `v ++;` two, `print v` two, and the answer one (`10` is one word). A
value is one symbol, the same in `v = 0 ;` and in an answer (the reference's one word "0"); the
variables and the words `=`, `;`, `pass;`, `++;`, `print` are marks after the 11 values. SEP
before the answer is posbench's (as in the LEGO task's `? c SEP + 1`): the reference's question
`print v` is followed by the answer directly.

What differs, and why:

- λ is the number of the program's tokens, not of its statements. The reference draws the number
  of statements uniformly from 3..512 and its tokens vary with the draws (1 to 4 per statement);
  its model reads the last 512 tokens of an instance (block size 512; its collator cuts a longer
  one from the left, which drops the start of the program in about one instance in seven). A
  posbench window holds one instance of a fixed size from position 0, and every eval window is
  full, so the size is counted in tokens: statements are drawn as the reference draws them until
  the program has λ tokens, a statement that would overrun them drawn again (so only the last
  three tokens or fewer are drawn among the statements that still fit). Training draws λ
  uniformly up to what its window holds, as the reference draws statements uniformly up to 512;
  `train.seq_len=512` holds programs of up to 507 tokens (about 440 statements), none cut.
- As in the reference, a program has at least 3 statements and a variable that exists when it
  is asked about; the smallest such program is 6 tokens (`a = 0 ; pass; pass;`), min_size.
- Instances are drawn fresh for every step (seeded by the run's seed and step; evaluation's by
  the length), not a fixed set of 10k read for 100 epochs (`dataset.train_instances=10000` reads
  one such set); randomness is numpy's, not Python's `random`.
"""
from __future__ import annotations

from typing import ClassVar, Dict, List, Tuple

import numpy as np

from posbench.data.algorithmic import Written
from posbench.data.base import register
from posbench.data.tasks import BOS, FIRST, SEP

VARIABLES = "abcdefghijklmnopqrstuvwxyz"  # the reference's string.ascii_lowercase
SET, PASS, INCREMENT = 0, 1, 2
WEIGHTS = (1, 50, 7)  # set : pass : increment, count_data_gen.py's OP_WEIGHTS
TOKENS = {SET: 4, PASS: 1, INCREMENT: 2}  # `v = 0 ;`, `pass;`, `v ++;`
MAX_VALUE = 10
MIN_STATEMENTS = 3  # random.randint(3, max_steps)


class Draws:
    """Uniform numbers from `rng`, read one at a time (drawn 256 at once: a statement needs two)."""

    def __init__(self, rng: np.random.Generator):
        self.rng, self.buffer, self.at = rng, np.empty(0), 0

    def __call__(self) -> float:
        if self.at == len(self.buffer):
            self.buffer, self.at = self.rng.random(256), 0
        self.at += 1
        return float(self.buffer[self.at - 1])


class Counting(Written):
    """BOS s1 .. sk print v SEP n: a program of λ tokens over `nvars` variables, the value n of v
    at its end."""
    nvars: ClassVar[int] = 3
    values = MAX_VALUE + 1  # the values 0..10
    marks: ClassVar[Tuple[str, ...]] = ()
    min_size = 6
    _cumulative = np.cumsum(WEIGHTS) / sum(WEIGHTS)

    def __init_subclass__(cls, **kwargs):
        cls.marks = (*VARIABLES[:cls.nvars], "=", ";", "pass;", "++;", "print")
        super().__init_subclass__(**kwargs)

    def parameters(self):
        return {**super().parameters(), "nvars": self.nvars, "weights": WEIGHTS,
                "max_value": MAX_VALUE}

    def size(self, total):
        return total - 5  # BOS, print, the variable, SEP, the answer

    def statement(self, draw: Draws, room: int, values: Dict[int, int]) -> List[int]:
        """One statement of at most `room` tokens, drawn as the reference draws it (a kind by
        its weight, drawn again while it cannot be written), `values` updated."""
        while True:
            kind = int(np.searchsorted(self._cumulative, draw(), side="right"))
            if TOKENS[kind] > room:
                continue
            if kind == PASS:
                return [self.mark("pass;")]
            if kind == SET:
                v = int(draw() * self.nvars)
                values[v] = 0
                return [self.mark(VARIABLES[v]), self.mark("="), FIRST + 0, self.mark(";")]
            if not values:  # nothing to increment yet
                continue
            existing = list(values)  # in the order they were first set, as a dict's keys
            v = existing[int(draw() * len(existing))]
            if values[v] == MAX_VALUE:
                continue
            values[v] += 1
            return [self.mark(VARIABLES[v]), self.mark("++;")]

    def program(self, rng: np.random.Generator, size: int) -> Tuple[List[int], int, int]:
        """A program of `size` tokens, at least 3 statements, a variable set in it; the queried
        variable and its value. Drawn again until it is one."""
        draw = Draws(rng)
        while True:
            values: Dict[int, int] = {}
            tokens: List[int] = []
            statements = 0
            while len(tokens) < size:
                tokens += self.statement(draw, size - len(tokens), values)
                statements += 1
            if values and statements >= MIN_STATEMENTS:
                existing = list(values)
                v = existing[int(draw() * len(existing))]
                return tokens, v, values[v]

    def make(self, rng, size):
        if size < self.min_size:  # no program fits: it would be drawn again for ever
            raise ValueError(f"a counting program of {size} tokens: the reference's smallest "
                             f"(3 statements, one a set) has {self.min_size}")
        tokens, v, value = self.program(rng, size)
        head = [BOS, *tokens, self.mark("print"), self.mark(VARIABLES[v]), SEP]
        seq = np.array(head + [FIRST + value], dtype=np.int64)
        answer = np.zeros(len(seq), dtype=bool)
        answer[-1] = True
        return seq, answer


@register("task_counting_1", "Golovneva et al.'s counting, 1 variable: a program of set, pass "
          "and ++ statements, the variable's value; exact match")
class Counting1(Counting):
    nvars = 1


@register("task_counting_3", "Golovneva et al.'s counting, 3 variables: a program of set, pass "
          "and ++ statements, one variable's value; exact match")
class Counting3(Counting):
    nvars = 3


@register("task_counting_5", "Golovneva et al.'s counting, 5 variables: a program of set, pass "
          "and ++ statements, one variable's value; exact match")
class Counting5(Counting):
    nvars = 5
