"""The algorithmic tasks of Kazemnejad et al. 2023 ("The Impact of Positional Encoding on Length
Generalization in Transformers", arXiv 2305.19466), as their reference generators make them.

The reference is github.com/McGill-NLP/length-generalization: scripts/dataset_builders/
make_<task>_dataset.py draws each instance (what is random, what λ counts) and
src/data/data_instance_processor/<task>_instance_processor.py writes it as a prompt and a target
(no scratchpad). λ is the reference's own instance size, its `cat`; a split `*_trL_ts2L` trains on
λ from `train_min` (4 by default, 3 for parity) to L and tests on L+1..2L: L = 20 for copy,
reverse and parity (and for summation mod 10 scored by a classifier head, sum_mod), L = 8 for
addition, polynomial, sorting, summation, parity and LEGO in its scratchpad study. Here training
draws λ from min_size (1; 2 for LEGO) up to what the training window holds, and each eval length
holds the λ its window fits.

How an instance is written: BOS, the reference's prompt, SEP, its target, with the English words
left out ("Sort the following list", "The answer is", the final '.'); the target's tokens are the
answers. One token per symbol or digit: the reference separates digits by spaces
(number_to_string), most significant first, and writes '-' apart; '+' is PLUS. Lists keep the
reference's "[ a , b ]"; LEGO's clauses, fixed in width, drop their '=' and ',' ("b = - a" is
b - a), and a polynomial's "* x **" is one token x. Two fields the reference writes in varying
width are written in fixed width, so that an eval length holds one λ and its windows are full:
multi-digit numbers zero-padded to 4 digits, and a polynomial's x and coefficients always signed,
'+' or '-' (a term's sign stands for the '+' before it). The reference's symbols are single T5
tokens (get_unique_tokens); here they are symbol ids after the special tokens.

Task here           reference (make_*_dataset.py, its splits)        λ counts
task_copy_repeat    copy repeat_single_char (rsc_tr20_ts40)          repeats of one symbol
task_copy_replace   copy repeat_double_char (rdc_tr20_ts40)          repeats
task_copy_repeat_2x copy repeat_single_2x_char (rsc2x_tr20_ts40)     repeats (the target 2λ)
task_copy_2x        copy copy_multi_char_2x (cmc2x_tr20_ts40)        symbols
task_reverse_2x     reverse multi_char_2x (mc2x_tr20_ts40)           symbols
task_reverse_copy   reverse multi_char_rev_cop (mcrv_tr20_ts40)      symbols
task_sort_single    sort --single_digit (len_sngd_tr8_ts16)          items
task_sort_multi     sort (len_mltd_tr8_ts16)                         numbers
task_sum_mod        sum, s2s_sum modulo 10 (len_tr8_ts16)            numbers added
task_parity         parity (len_tr20_ts40, len_tr8_ts16)             bits
task_poly           poly, modulo 10 (n_terms_tr8_ts16)               terms
task_addition_msb   addition (len_tr8_ts16), its λ-by-λ bins         digits of each operand
task_lego           lego (len_tr8_ts16)                              variables
task_lego_perm      lego --permute_clauses (len_tr8_ts16_perm)       variables

posbench's own tasks (posbench/data/tasks.py) stand for three more: task_copy is copy
copy_multi_char (cmc_tr20_ts40) and task_reverse is reverse multi_char (mc_tr20_ts40), with 16
symbols where the reference draws from 100. task_addition stands for addition but writes every
number least significant digit first, both operands λ digits with leading zeros allowed and the
sum λ+1 digits; the reference writes most significant first, without leading zeros, and draws the
two operands' lengths apart (its bins a-by-b): task_addition_msb is its writing, on the bins where
both are λ digits.

Left out: SCAN, PCFG and CLUTRR (their splits are external data the reference downloads);
count and the plain sum (regression on a classifier head, not generated answers); copy_half, dyck
and subtraction (generators in the reference that none of its experiment lists use).
"""
from __future__ import annotations

from typing import ClassVar, Tuple

import numpy as np

from posbench.data.base import register
from posbench.data.tasks import BOS, FIRST, PLUS, SEP, Task, marked


def instance(prompt, target):
    """BOS, the prompt, SEP, then the target: its tokens are the answers. Each a list of parts,
    a part a token or tokens."""
    head = np.concatenate([[BOS], *map(np.atleast_1d, prompt), [SEP]])
    return marked([head, *target], len(head))


def joined(parts, sep) -> list:
    """The parts with the token `sep` between them."""
    out = []
    for i, part in enumerate(parts):
        out += ([sep] if i else []) + list(np.atleast_1d(part))
    return out


def digits(number: int, width: int = 0) -> list:
    """A non-negative number's digit tokens, most significant first, zero-padded to `width`."""
    return [FIRST + int(d) for d in str(number).zfill(width)]


class Written(Task):
    """A task whose symbols are `values` data symbols (items, digits, bits or variables), then
    `marks`: the reference's punctuation and words that carry meaning, one token each."""
    values: ClassVar[int] = 10
    marks: ClassVar[Tuple[str, ...]] = ()

    def __init_subclass__(cls, **kwargs):
        super().__init_subclass__(**kwargs)
        cls.symbols = cls.values + len(cls.marks)

    def mark(self, name: str) -> int:
        return FIRST + self.values + self.marks.index(name)

    def draw(self, rng, n):
        return rng.integers(FIRST, FIRST + self.values, size=n)

    def listed(self, items) -> list:
        """The reference's list: [ a , b , c ]."""
        return [self.mark("["), *joined(items, self.mark(",")), self.mark("]")]


class Items(Written):
    values = 100  # get_unique_tokens()[:100] in make_copy_dataset.py and make_reverse_dataset.py


@register("task_copy_repeat", "Kazemnejad et al.'s copy 'rsc': one symbol repeated k times, "
          "copied; exact match")
class CopyRepeat(Items):
    """BOS t..t SEP t..t: one symbol t, drawn uniformly (the reference gives each instance of a
    length its own token), λ times in both."""

    def size(self, total):
        return (total - 2) // 2

    def make(self, rng, size):
        t = np.repeat(self.draw(rng, 1), size)
        return instance([t], [t])


@register("task_copy_replace", "Kazemnejad et al.'s copy 'rdc': replace s with t in s..s; "
          "exact match")
class CopyReplace(Items):
    """'Replace s with t in s..s' -> t..t: BOS s t s..s SEP t..t, s != t (the reference takes
    ordered pairs of distinct tokens)."""

    def size(self, total):
        return (total - 4) // 2

    def make(self, rng, size):
        s, t = rng.choice(self.values, 2, replace=False) + FIRST
        return instance([s, t, np.full(size, s)], [np.full(size, t)])


@register("task_copy_repeat_2x", "Kazemnejad et al.'s copy 'rsc2x': one symbol k times, written "
          "2k times; exact match")
class CopyRepeat2x(Items):
    """BOS t^λ SEP t^2λ."""

    def size(self, total):
        return (total - 2) // 3

    def make(self, rng, size):
        t = self.draw(rng, 1)
        return instance([np.repeat(t, size)], [np.repeat(t, 2 * size)])


class Twice(Items):
    """BOS x SEP first [NEXT] second: two renderings of x, the reference's [NEXT] between."""
    marks = ("[NEXT]",)

    @staticmethod
    def renderings(x):
        raise NotImplementedError

    def size(self, total):
        return (total - 3) // 3

    def make(self, rng, size):
        x = self.draw(rng, size)
        first, second = self.renderings(x)
        return instance([x], [first, self.mark("[NEXT]"), second])


@register("task_copy_2x", "Kazemnejad et al.'s copy 'cmc2x': k random symbols copied twice; "
          "exact match")
class Copy2x(Twice):
    renderings = staticmethod(lambda x: (x, x))


@register("task_reverse_2x", "Kazemnejad et al.'s reverse 'mc2x': k random symbols reversed "
          "twice; exact match")
class Reverse2x(Twice):
    renderings = staticmethod(lambda x: (x[::-1], x[::-1]))


@register("task_reverse_copy", "Kazemnejad et al.'s reverse 'mcrv': k random symbols reversed, "
          "then copied; exact match")
class ReverseCopy(Twice):
    renderings = staticmethod(lambda x: (x[::-1], x))


@register("task_sort_single", "Kazemnejad et al.'s sort, single tokens: a list of k symbols "
          "sorted; exact match")
class SortSingle(Written):
    """BOS [ x1 , .. , xλ ] SEP [ sorted ], items drawn with repeats, ordered by symbol id (the
    reference's token rank)."""
    values = 50  # get_unique_tokens()[:50], make_sort_dataset.py
    marks = ("[", "]", ",")

    def size(self, total):
        return (total - 4) // 4

    def make(self, rng, size):
        x = self.draw(rng, size)
        return instance([self.listed(x)], [self.listed(np.sort(x))])


@register("task_sort_multi", "Kazemnejad et al.'s sort, multi-digit: k numbers 10..9999 sorted, "
          "4 digits each; exact match")
class SortMulti(Written):
    """BOS [ n1 , .. , nλ ] SEP [ sorted ], each number its 4 digits (zero-padded: the
    reference writes 2 to 4)."""
    low, high = 10, 9999  # np.random.randint(10, 10000), make_sort_dataset.py
    marks = ("[", "]", ",")

    def parameters(self):
        return {**super().parameters(), "low": self.low, "high": self.high}

    def size(self, total):
        return (total - 4) // (2 * len(str(self.high)) + 2)

    def make(self, rng, size):
        x = rng.integers(self.low, self.high + 1, size)
        width = len(str(self.high))
        return instance([self.listed([digits(n, width) for n in x])],
                        [self.listed([digits(n, width) for n in np.sort(x)])])


@register("task_sum_mod", "Kazemnejad et al.'s summation: k digits 1..9 added, mod 10; exact "
          "match")
class SumMod(Written):
    """'Compute: v1 + .. + vλ' -> the sum mod 10: BOS v1 + .. + vλ SEP s."""
    low, high = 1, 9  # np.random.randint(1, 10), make_sum_dataset.py
    modulus = 10  # modulo_factor, configs/data/s2s_sum.jsonnet

    def parameters(self):
        return {**super().parameters(), "low": self.low, "high": self.high,
                "modulus": self.modulus}

    def size(self, total):
        return (total - 2) // 2

    def make(self, rng, size):
        v = rng.integers(self.low, self.high + 1, size)
        return instance([joined(v + FIRST, PLUS)], [FIRST + int(v.sum()) % self.modulus])


@register("task_parity", "Kazemnejad et al.'s parity: is the number of 1s in k bits even; exact "
          "match")
class Parity(Written):
    """'Is the number of 1's even in the sequence [ b1 , .. , bλ ] ?' -> Yes or No."""
    values = 2
    marks = ("[", "]", ",", "Yes", "No")

    def size(self, total):
        return (total - 4) // 2

    def make(self, rng, size):
        bits = rng.integers(0, 2, size)
        even = bits.sum() % 2 == 0
        return instance([self.listed(bits + FIRST)], [self.mark("Yes" if even else "No")])


@register("task_poly", "Kazemnejad et al.'s polynomial evaluation: k terms at x, mod 10; exact "
          "match")
class Poly(Written):
    """'Evaluate at x = v in c1 * x ** d1 + ..' -> the value mod 10: BOS x = ±v ±c1 x d1 ..
    ±cλ x dλ SEP a (each term's sign stands for the '+' between terms)."""
    marks = ("-", "x", "=")
    coefficients, degrees, points = (-3, 3), (0, 3), (-2, 2)  # make_poly_dataset.py
    modulus = 10  # modulo_factor, configs/data/s2s_poly.jsonnet

    def parameters(self):
        return {**super().parameters(), "coefficients": self.coefficients,
                "degrees": self.degrees, "points": self.points, "modulus": self.modulus}

    def signed(self, n: int) -> list:
        return [PLUS if n >= 0 else self.mark("-"), FIRST + abs(n)]

    def size(self, total):
        return (total - 7) // 4

    def make(self, rng, size):
        c = rng.integers(self.coefficients[0], self.coefficients[1] + 1, size).tolist()
        d = rng.integers(self.degrees[0], self.degrees[1] + 1, size).tolist()
        x = int(rng.integers(self.points[0], self.points[1] + 1))
        value = sum(ci * x ** di for ci, di in zip(c, d)) % self.modulus
        terms = [[*self.signed(ci), self.mark("x"), FIRST + di] for ci, di in zip(c, d)]
        return instance([self.mark("x"), self.mark("="), self.signed(x), *terms],
                        [FIRST + value])


@register("task_addition_msb", "Kazemnejad et al.'s addition: two k-digit numbers, most "
          "significant digit first; exact match")
class AdditionMSB(Written):
    """'Compute a + b ?' -> a + b: BOS a + b SEP s, a and b λ digits without leading zeros
    (0..9 when λ = 1), s as many digits as it has (λ or λ+1)."""

    def size(self, total):
        return (total - 4) // 3

    def number(self, rng, size) -> int:
        # uniform over the λ-digit numbers (the reference's randint(10**(λ-1), 10**λ)), drawn
        # digit by digit: 10**λ outgrows an int64 past 18 digits
        lead = rng.integers(1 if size > 1 else 0, 10)
        return int("".join(map(str, [lead, *rng.integers(0, 10, size - 1)])))

    def make(self, rng, size):
        a, b = self.number(rng, size), self.number(rng, size)
        return instance([digits(a), PLUS, digits(b)], [digits(a + b)])


@register("task_lego", "Kazemnejad et al.'s LEGO: a chain of k variables, each +/- the one "
          "before; one variable's value; exact match")
class Lego(Written):
    """'If a = +1, b = - a, c = + b. Then, what is the value of c?' -> +1: BOS a + 1 b - a c + b
    ? c SEP + 1. Variables are distinct letters, so λ <= 26; the query is one of the chain's later
    half (the reference makes one instance per query there)."""
    values = 26  # ALL_VARS, a..z, make_lego_dataset.py
    marks = ("-", "1", "?")
    min_size = 2  # below two variables the reference has no query
    permute = False

    def size(self, total):
        return (total - 6) // 3

    def fits(self, total):
        if self.size(total) > self.values:
            return f"more than the {3 * self.values + 8} tokens that {self.values} variables fill"
        return super().fits(total)

    def make(self, rng, size):
        bits = rng.integers(0, 2, size)  # 1: +1, 0: -1
        names = rng.permutation(self.values)[:size] + FIRST
        sign = lambda same: PLUS if same else self.mark("-")
        clauses = [[names[0], sign(bits[0] == 1), self.mark("1")]]
        clauses += [[names[i], sign(bits[i] == bits[i - 1]), names[i - 1]] for i in range(1, size)]
        query = int(rng.integers((size + 1) // 2, size))
        if self.permute:
            clauses = [clauses[i] for i in rng.permutation(size)]
        return instance([*clauses, self.mark("?"), names[query]],
                        [sign(bits[query] == 1), self.mark("1")])


@register("task_lego_perm", "Kazemnejad et al.'s LEGO with the clauses shuffled; exact match")
class LegoPerm(Lego):
    permute = True
