"""The tasks of Delétang et al. 2023 ("Neural Networks and the Chomsky Hierarchy", ICLR 2023), as
their reference generators make them; Ruoss et al. 2023 (randomized positional encodings) train
and test on the same ones.

The reference is github.com/google-deepmind/neural_networks_chomsky_hierarchy: tasks/regular,
tasks/dcf and tasks/cs hold one generator each, and experiments/constants.py says how the paper
builds them (modular_arithmetic_brackets with '*'). A generator's `length` is its instance size λ
here, the length of its input: the paper trains on λ drawn uniformly from 1..40 and tests on
41..500 (Ruoss et al. the same). Training here draws λ from 1 up to what the training window
holds, and an eval length holds the λ its window fits: `${posbench.task_window:40}` is the
training length of λ = 40.

How an instance is written: BOS, the reference's input, SEP, its output; the output's tokens are
the answers, a classification task's one class token. One token per symbol. Symbols that mean the
same in input and output share a token: the bits (or residues, positions, bucket_sort's 5
symbols) are the first `values` symbols, so a copy is a copy of tokens; the reference's other
input symbols and its termination symbol are marks after them, one token each ('+' is PLUS, as
in algorithmic.py).

Task here                         reference                        input      output, scored
task_even_pairs                   regular/even_pairs               λ bits     1: #(01, 10) mod 2
task_parity_check                 regular/parity_check             λ bits     1: #1s mod 2
task_cycle_navigation             regular/cycle_navigation         λ moves    1: position mod 5
task_modular_arithmetic           regular/modular_arithmetic       λ (odd)    1: value mod 5
task_modular_arithmetic_brackets  dcf/modular_arithmetic_brackets  λ          1: value mod 5
task_solve_equation               dcf/solve_equation               λ          1: x mod 5
task_reverse_string               dcf/reverse_string               λ bits     λ
task_stack_manipulation           dcf/stack_manipulation           λ          stack, END (of λ+1)
task_duplicate_string             cs/duplicate_string              λ bits     2λ
task_missing_duplicate_string     cs/missing_duplicate_string      λ          1: the missing bit
task_odds_first                   cs/odds_first                    λ bits     λ
task_binary_addition              cs/binary_addition               λ          sum, END (of λ+1)
task_binary_multiplication        cs/binary_multiplication         λ          product, END (of λ)
task_compute_sqrt                 cs/compute_sqrt                  λ bits     ceil(λ/2)
task_bucket_sort                  cs/bucket_sort                   λ of 5     λ

Each draws what the reference draws, from the same ranges with the same probabilities, its
quirks included: modular_arithmetic writes λ - 1 symbols when λ is even, and the small sizes are
its degenerate instances (missing_duplicate_string at λ = 1 is the input 1 and the answer 1,
solve_equation below λ = 3 is all 0s and the answer 0, binary addition and multiplication at
λ <= 2 are one number without an operator, stack_manipulation at λ = 1 one bit and no action).
What differs, and why:

- A causal decoder reads tokens, not one-hot vectors, and writes its output after the input, one
  token after another, each answer predicted from the true tokens before it (in training and in
  evaluation): the reference's transformer by default reads the input followed by blank output
  cells and fills them all at once (its autoregressive option trains on the targets fed back, as
  here, but evaluates on its own predictions fed back). The input and output alphabets, separate
  one-hot spaces there, are one vocabulary here (the table above); the reference's ids order the
  tokens (stack_manipulation's POP, PUSH 0 and PUSH 1 are its 2, 3 and 4).
- Where the reference pads an output to a fixed length after its termination symbol
  (stack_manipulation, binary_addition, binary_multiplication), the padding is written as it is
  (0s), so that every instance of a λ fills its window, but only the tokens up to and including
  the termination symbol are answers: that is the reference's accuracy_mask. Its loss also trains
  on the padding; here nothing after the last answer is trained or scored (a causal decoder's
  answers never see it).
- Scores: posbench reports exact match (every answer of an instance right) and token accuracy,
  pooled over the scored tokens; the reference's accuracy is the latter (averaged over its
  sub-batches of equal size).
- Randomness comes from the numpy Generator posbench seeds per run and step (evaluation: per
  length) rather than JAX keys, np.random and Python's random; the reference's big numbers
  (random.randint(1, 2**n - 1)) are drawn as n uniform bits, drawn again while all are 0.
  modular_arithmetic_brackets is generated without recursion (its depth grows with λ), which
  draws the same sizes, symbols and operators in another order.
- modular_arithmetic's alphabet in the reference also has a blank '_' that no instance holds, and
  modular_arithmetic_brackets' has 'x' and '=' (solve_equation's); they have no token here.
  modular_arithmetic's operators are all three of '+', '-', '*' (the reference keeps them in a
  generator expression, which only its first call reads; its docstring means all three).
- odds_first writes the symbols at odd 0-based indices first, then the even ones, as the
  reference's code does (its docstring's examples put the even ones first).
"""
from __future__ import annotations

import math
from typing import ClassVar, Tuple

import numpy as np

from posbench.data.algorithmic import Written
from posbench.data.base import register
from posbench.data.tasks import BOS, FIRST, PLUS, SEP


def written(inputs, outputs, scored: int = -1) -> Tuple[np.ndarray, np.ndarray]:
    """BOS, the input tokens, SEP, then the output tokens: the first `scored` of them are the
    answers (all of them when -1)."""
    head = [BOS, *inputs, SEP]
    seq = np.array(head + list(outputs), dtype=np.int64)
    answer = np.zeros(len(seq), dtype=bool)
    answer[len(head):len(head) + (len(outputs) if scored < 0 else scored)] = True
    return seq, answer


def nonzero_bits(rng, n: int) -> list:
    """The n bits of a number drawn uniformly from 1..2**n - 1, least significant first."""
    while True:
        bits = rng.integers(0, 2, n).tolist()
        if any(bits):
            return bits


def binary(number: int, width: int = 0) -> list:
    """A number's bits, least significant first, zero-filled to `width` (0 is the one bit 0)."""
    return [int(b) for b in reversed(f"{number:b}".zfill(width))]


def operate(op: str, a: int, b: int, modulus: int) -> int:
    return (a + b if op == "+" else a - b if op == "-" else a * b) % modulus


class Chomsky(Written):
    """A task of Delétang et al.: `values` symbols (bits by default), then `marks`."""
    values = 2
    level: ClassVar[str] = ""  # the reference's folder: regular, dcf or cs


class Classify(Chomsky):
    """BOS x1..xλ SEP c: one class token."""

    def size(self, total):
        return total - 3


class Modular(Classify):
    """Residues 0..modulus-1 are the first symbols and the classes."""
    modulus: ClassVar[int] = 5  # 'We use 5 in the paper'

    def parameters(self):
        return {**super().parameters(), "modulus": self.modulus}

    def token(self, symbol) -> int:
        """A residue's token, or a mark's ('+' is PLUS)."""
        if isinstance(symbol, (int, np.integer)):
            return FIRST + int(symbol)
        return PLUS if symbol == "+" else self.mark(symbol)


@register("task_even_pairs", "Deletang et al.'s even pairs (regular): are the 01s and 10s in k "
          "bits even; exact match")
class EvenPairs(Classify):
    """BOS b1..bλ SEP c, c the number of unequal neighbours mod 2."""
    level = "regular"

    def make(self, rng, size):
        bits = rng.integers(0, 2, size)
        return written(FIRST + bits, [FIRST + int(np.sum(bits[1:] != bits[:-1])) % 2])


@register("task_parity_check", "Deletang et al.'s parity check (regular): the number of 1s in k "
          "bits mod 2; exact match")
class ParityCheck(Classify):
    """BOS b1..bλ SEP c, c the number of 1s mod 2."""
    level = "regular"

    def make(self, rng, size):
        bits = rng.integers(0, 2, size)
        return written(FIRST + bits, [FIRST + int(bits.sum()) % 2])


@register("task_cycle_navigation", "Deletang et al.'s cycle navigation (regular): k moves on a "
          "cycle of 5, the final position; exact match")
class CycleNavigation(Classify):
    """BOS m1..mλ SEP p: moves -1, 0, +1 (the reference's 0, 1, 2) from position 0 on a cycle of
    5; p the final position."""
    level = "regular"
    values = 5  # the positions, the classes
    marks = ("-1", "0", "+1")

    def make(self, rng, size):
        moves = rng.integers(0, 3, size)
        return written(self.mark("-1") + moves, [FIRST + int(np.sum(moves - 1)) % self.values])


@register("task_modular_arithmetic", "Deletang et al.'s modular arithmetic (regular): k residues "
          "and operators +-* mod 5; exact match")
class ModularArithmetic(Modular):
    """BOS r op r .. op r SEP v: λ symbols (λ - 1 when λ is even), residues mod 5 and operators
    +, -, * drawn uniformly; v the value, '*' before '+' and '-'."""
    level = "regular"
    values = 5
    marks = ("-", "*")

    def make(self, rng, size):
        n = size if size % 2 else size - 1
        residues = rng.integers(0, self.modulus, n // 2 + 1).tolist()
        ops = [("+", "*", "-")[i] for i in rng.integers(0, 3, n // 2)]
        terms, sign, product = [], 1, residues[0]
        for op, r in zip(ops, residues[1:]):
            if op == "*":
                product *= r
            else:
                terms.append(sign * product)
                sign, product = (1 if op == "+" else -1), r
        value = (sum(terms) + sign * product) % self.modulus
        symbols = [residues[0]] + [s for pair in zip(ops, residues[1:]) for s in pair]
        return written([self.token(s) for s in symbols], [FIRST + value])


def bracketed(rng, length: int, modulus: int, ops: str) -> Tuple[list, int]:
    """The reference's expression of exactly `length` symbols and its value mod `modulus`: d,
    -d, (d), (-d) up to 4 symbols, else (left op right) with left 1..length-4 symbols."""
    symbols, values, todo = [], [], [("expression", length)]
    while todo:
        kind, item = todo.pop()
        if kind == "op":
            symbols.append(item)
        elif kind == "close":
            right, left = values.pop(), values.pop()
            symbols.append(")")
            values.append(operate(item, left, right, modulus))
        elif item <= 4:
            d = int(rng.integers(0, modulus))
            symbols += [[d], ["-", d], ["(", d, ")"], ["(", "-", d, ")"]][item - 1]
            values.append(-d % modulus if item in (2, 4) else d)
        else:
            left = int(rng.integers(1, item - 3))
            op = ops[int(rng.integers(0, len(ops)))]
            symbols.append("(")
            todo += [("close", op), ("expression", item - 3 - left), ("op", op),
                     ("expression", left)]
    return symbols, values[0]


@register("task_modular_arithmetic_brackets", "Deletang et al.'s modular arithmetic with "
          "brackets (DCF): an expression of k symbols mod 5; exact match")
class ModularArithmeticBrackets(Modular):
    """BOS e SEP v: e an expression of exactly λ symbols (residues mod 5, +, -, *, brackets),
    split at random into bracketed (left op right); v its value."""
    level = "dcf"
    values = 5
    marks = ("-", "*", "(", ")")
    ops = "+-*"  # mult=True, experiments/constants.py

    def make(self, rng, size):
        symbols, value = bracketed(rng, size, self.modulus, self.ops)
        return written([self.token(s) for s in symbols], [FIRST + value])


@register("task_solve_equation", "Deletang et al.'s solve equation (DCF): a bracketed +- "
          "equation of k symbols mod 5, the unknown x; exact match")
class SolveEquation(Modular):
    """BOS e = v SEP d: e a bracketed expression of λ - 2 symbols with + and - only, one of its
    residues replaced by x (the first at or after a uniformly drawn symbol); d that residue, v the
    expression's value. Below λ = 3, λ 0s and the answer 0 (the reference's)."""
    level = "dcf"
    values = 5
    marks = ("-", "(", ")", "x", "=")

    def make(self, rng, size):
        if size < 3:
            return written([FIRST] * size, [FIRST])
        symbols, value = bracketed(rng, size - 2, self.modulus, "+-")
        at = int(rng.integers(0, len(symbols)))
        while not isinstance(symbols[at], int):
            at = (at + 1) % len(symbols)
        solution, symbols[at] = symbols[at], "x"
        return written([self.token(s) for s in [*symbols, "=", value]], [FIRST + solution])


@register("task_reverse_string", "Deletang et al.'s reverse string (DCF): k bits reversed; "
          "exact match")
class ReverseString(Chomsky):
    """BOS b1..bλ SEP bλ..b1."""
    level = "dcf"

    def size(self, total):
        return (total - 2) // 2

    def make(self, rng, size):
        bits = self.draw(rng, size)
        return written(bits, bits[::-1])


@register("task_stack_manipulation", "Deletang et al.'s stack manipulation (DCF): a stack and "
          "POP/PUSH actions, the final stack; exact match")
class StackManipulation(Chomsky):
    """BOS s1..sj a1..aλ-j SEP t1..ti END 0..0: a stack of j bits (1..λ-1, bottom first), then
    λ - j actions POP, PUSH 0, PUSH 1 (POP on an empty stack does nothing); the final stack top
    first, END, then 0s to λ + 1 tokens. The stack and END are the answers. At λ = 1, one bit
    and no action."""
    level = "dcf"
    marks = ("POP", "PUSH 0", "PUSH 1", "END")

    def size(self, total):
        return (total - 3) // 2

    def make(self, rng, size):
        if size == 1:
            stack = rng.integers(0, 2, 1).tolist()
            inputs = list(stack)
        else:
            stack = rng.integers(0, 2, int(rng.integers(1, size))).tolist()
            actions = rng.integers(0, 3, size - len(stack)).tolist()  # POP, PUSH 0, PUSH 1
            inputs = stack + [self.values + a for a in actions]
            for a in actions:
                if a:
                    stack.append(a - 1)
                elif stack:
                    stack.pop()
        out = [FIRST + b for b in stack[::-1]] + [self.mark("END")]
        return written([FIRST + s for s in inputs], out + [FIRST] * (size + 1 - len(out)),
                       scored=len(out))


@register("task_duplicate_string", "Deletang et al.'s duplicate string (CS): k bits written "
          "twice; exact match")
class DuplicateString(Chomsky):
    """BOS b1..bλ SEP b1..bλ b1..bλ."""
    level = "cs"

    def size(self, total):
        return (total - 2) // 3

    def make(self, rng, size):
        bits = self.draw(rng, size)
        return written(bits, np.concatenate([bits, bits]))


@register("task_missing_duplicate_string", "Deletang et al.'s missing duplicate string (CS): a "
          "duplicated bit string with one bit missing, that bit; exact match")
class MissingDuplicateString(Classify):
    """BOS w w (EMPTY) SEP b: w of λ // 2 bits written twice, one of the 2 (λ // 2) bits replaced
    by MISSING, and EMPTY after them when λ is odd; b the missing bit. At λ = 1 the input is the
    bit 1 and the answer 1 (the reference's)."""
    level = "cs"
    marks = ("MISSING", "EMPTY")

    def make(self, rng, size):
        if size == 1:
            return written([FIRST + 1], [FIRST + 1])
        half = self.draw(rng, size // 2)
        doubled = np.concatenate([half, half])
        at = int(rng.integers(0, len(doubled)))
        answer = doubled[at]
        doubled[at] = self.mark("MISSING")
        return written([*doubled, *[self.mark("EMPTY")] * (size % 2)], [answer])


@register("task_odds_first", "Deletang et al.'s odds first (CS): k bits, those at odd indices "
          "first; exact match")
class OddsFirst(Chomsky):
    """BOS b0..bλ-1 SEP b1 b3 .. b0 b2 ..: the bits at odd (0-based) indices, then the even."""
    level = "cs"

    def size(self, total):
        return (total - 2) // 2

    def make(self, rng, size):
        bits = self.draw(rng, size)
        return written(bits, np.concatenate([bits[1::2], bits[::2]]))


@register("task_binary_addition", "Deletang et al.'s binary addition (CS): two binary numbers "
          "of k symbols in all, least significant bit first; exact match")
class BinaryAddition(Chomsky):
    """BOS n + m SEP s END 0..0: n and m little-endian, of j (1..λ-2) and λ-1-j bits, each drawn
    from 1..2^bits - 1 (so it may end in 0s); s their sum little-endian without trailing 0s, then
    END and 0s to λ + 1 tokens. s and END are the answers. At λ <= 2 the input is one number of λ
    bits (0..2^λ - 2) and s is that number."""
    level = "cs"
    marks = ("END",)

    def size(self, total):
        return (total - 3) // 2

    def output_length(self, size: int) -> int:
        return size + 1

    def operator(self) -> int:
        return PLUS

    def combine(self, n: int, m: int) -> int:
        return n + m

    def alone(self, number: int, size: int) -> list:
        """The result's bits when the input is one number."""
        return binary(number)

    def make(self, rng, size):
        if size <= 2:
            number = int(rng.integers(0, 2 ** size - 1))
            inputs = [FIRST + b for b in binary(number, size)]
            result = self.alone(number, size)
        else:
            n = nonzero_bits(rng, int(rng.integers(1, size - 1)))
            m = nonzero_bits(rng, size - 1 - len(n))
            inputs = [*(FIRST + b for b in n), self.operator(), *(FIRST + b for b in m)]
            value = lambda bits: sum(b << i for i, b in enumerate(bits))
            result = binary(self.combine(value(n), value(m)))
        out = [FIRST + b for b in result] + [self.mark("END")]
        pad = [FIRST] * (self.output_length(size) - len(out))
        return written(inputs, out + pad, scored=len(out))


@register("task_binary_multiplication", "Deletang et al.'s binary multiplication (CS): two "
          "binary numbers of k symbols in all, least significant bit first; exact match")
class BinaryMultiplication(BinaryAddition):
    """BOS n * m SEP p END 0..0: as task_binary_addition with the product, 0s to λ tokens. At
    λ <= 2 the input is one number of λ bits and p is λ - 1 0s (the reference's)."""
    marks = ("*", "END")

    def output_length(self, size: int) -> int:
        return size

    def size(self, total):
        return (total - 2) // 2

    def operator(self) -> int:
        return self.mark("*")

    def combine(self, n: int, m: int) -> int:
        return n * m

    def alone(self, number: int, size: int) -> list:
        return [0] * (size - 1)


@register("task_compute_sqrt", "Deletang et al.'s compute sqrt (CS): the floor of the square "
          "root of a k-bit number, most significant bit first; exact match")
class ComputeSqrt(Chomsky):
    """BOS n SEP r: n drawn from 1..2^λ - 1, written in λ bits most significant first; r its
    integer square root in ceil(λ/2) bits, most significant first."""
    level = "cs"

    def size(self, total):
        return 2 * (total - 2) // 3  # the largest λ with λ + ceil(λ/2) + 2 <= total

    def make(self, rng, size):
        bits = nonzero_bits(rng, size)[::-1]
        root = math.isqrt(int("".join(map(str, bits)), 2))
        return written([FIRST + b for b in bits],
                       [FIRST + b for b in binary(root, (size + 1) // 2)[::-1]])


@register("task_bucket_sort", "Deletang et al.'s bucket sort (CS): k symbols of 5 sorted; exact "
          "match")
class BucketSort(Chomsky):
    """BOS x1..xλ SEP the xs sorted, from 5 symbols."""
    level = "cs"
    values = 5  # 'We use 5 in the paper'

    def size(self, total):
        return (total - 2) // 2

    def make(self, rng, size):
        x = self.draw(rng, size)
        return written(x, np.sort(x))
