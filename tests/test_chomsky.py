"""Delétang et al.'s Chomsky-hierarchy tasks (posbench/data/chomsky.py): every instance against an
oracle written here (the answer recomputed from the input with plain Python: eval, int(.., 2),
math.isqrt, a list as a stack), the reference generators' output lengths, alphabets, degenerate
small sizes and distributions, sizes against instance lengths counted here, seeding, and configs
that compose with training and test lengths given in instance sizes (1..40, 41..500)."""
import math
from collections import Counter

import numpy as np
import pytest
from omegaconf import OmegaConf

import posbench
from posbench.data import prepare, registry
from posbench.data.tasks import BOS, FIRST, PAD, PLUS, SEP


def task(name):
    return prepare(OmegaConf.create({"name": name})).task


def bits(tokens) -> list:
    assert all(FIRST <= t <= FIRST + 1 for t in tokens), tokens
    return [t - FIRST for t in tokens]


def tokens_of(bit_string: str) -> list:
    return [FIRST + int(c) for c in bit_string]


def text(tokens, marks) -> str:
    """A residue expression as a Python string: residues are FIRST + 0..4, PLUS is '+', and
    `marks` names the tokens from FIRST + 5 on."""
    table = {PLUS: "+", **{FIRST + d: str(d) for d in range(5)},
             **{FIRST + 5 + i: m for i, m in enumerate(marks)}}
    return "".join(table[t] for t in tokens)


def value(expression: str) -> int:
    return eval(expression, {"__builtins__": {}})  # digits, + - *, brackets: plain arithmetic


def classify(oracle):
    """An oracle for one class token."""
    return lambda x, k: ([FIRST + oracle(x, k)], 1)


def even_pairs(x, k):
    b = bits(x)
    assert len(b) == k
    return sum(p != q for p, q in zip(b, b[1:])) % 2


def parity_check(x, k):
    b = bits(x)
    assert len(b) == k
    return sum(b) % 2


def cycle_navigation(x, k):
    moves = [t - (FIRST + 6) for t in x]  # -1, 0, +1 after the 5 positions
    assert len(moves) == k and set(moves) <= {-1, 0, 1}
    return sum(moves) % 5


def modular_arithmetic(x, k):
    s = text(x, "-*")
    assert len(s) == (k if k % 2 else k - 1)
    assert all(c.isdigit() for c in s[::2]) and all(c in "+-*" for c in s[1::2])
    return value(s) % 5


def modular_arithmetic_brackets(x, k):
    s = text(x, "-*()")
    assert len(s) == k and (k < 5 or (s[0], s[-1]) == ("(", ")"))
    return value(s) % 5


def solve_equation(x, k):
    if k < 3:
        assert x == [FIRST] * k
        return 0
    s = text(x, "-()x=")
    assert len(s) == k and s.count("x") == 1 and "*" not in s and s[-2] == "="
    left, right = s[:-2], int(s[-1])
    solutions = [d for d in range(5) if value(left.replace("x", str(d))) % 5 == right]
    assert len(solutions) == 1
    return solutions[0]


def missing_duplicate_string(x, k):
    missing, empty = FIRST + 2, FIRST + 3
    if k == 1:
        assert x == [FIRST + 1]
        return 1
    h = k // 2
    body, tail = x[:2 * h], x[2 * h:]
    assert tail == [empty] * (k % 2) and body.count(missing) == 1
    at = body.index(missing)
    assert all(body[j] == body[(j + h) % (2 * h)] for j in range(2 * h) if j % h != at % h)
    return bits([body[(at + h) % (2 * h)]])[0]


END_STACK = FIRST + 5  # after the bits, POP, PUSH 0, PUSH 1


def stack_manipulation(x, k):
    """The leading bits are the stack, bottom first; then actions only."""
    pop, push0, push1 = FIRST + 2, FIRST + 3, FIRST + 4
    j = next((i for i, t in enumerate(x) if t >= pop), len(x))
    stack = bits(x[:j])
    assert len(x) == k and (k == 1 and j == 1 or 1 <= j <= k - 1)
    for action in x[j:]:
        assert action in (pop, push0, push1)
        if action == pop:
            stack = stack[:-1]
        else:
            stack.append(action - push0)
    out = tokens_of("".join(map(str, reversed(stack)))) + [END_STACK]
    return out + [FIRST] * (k + 1 - len(out)), len(out)


def little_endian(tokens) -> int:
    return int("".join(str(b) for b in reversed(bits(tokens))), 2)


def binary_op(op, operator, end, output_length, alone):
    def oracle(x, k):
        if k <= 2:
            assert operator not in x and len(x) == k and little_endian(x) <= 2 ** k - 2
            result = alone(little_endian(x), k)
        else:
            assert x.count(operator) == 1 and len(x) == k
            at = x.index(operator)
            n, m = little_endian(x[:at]), little_endian(x[at + 1:])
            assert n >= 1 and m >= 1 and 1 <= at <= k - 2
            result = tokens_of(format(op(n, m), "b")[::-1])
        out = result + [end]
        return out + [FIRST] * (output_length(k) - len(out)), len(out)
    return oracle


binary_addition = binary_op(lambda n, m: n + m, PLUS, FIRST + 2, lambda k: k + 1,
                            lambda n, k: tokens_of(format(n, "b")[::-1]))
binary_multiplication = binary_op(lambda n, m: n * m, FIRST + 2, FIRST + 3, lambda k: k,
                                  lambda n, k: [FIRST] * (k - 1))


def compute_sqrt(x, k):
    n = int("".join(map(str, bits(x))), 2)  # most significant first
    assert len(x) == k and 1 <= n
    return tokens_of(format(math.isqrt(n), f"0{math.ceil(k / 2)}b")), math.ceil(k / 2)


def whole(oracle):
    """An oracle whose output is all answers."""
    def full(x, k):
        out = oracle(x, k)
        return out, len(out)
    return full


def of_bits(transform):
    """An oracle for a task of k bits whose output, all answers, is `transform` of them."""
    def oracle(x, k):
        assert len(bits(x)) == k
        out = transform(x)
        return out, len(out)
    return oracle


def bucket_sort(x, k):
    assert len(x) == k and all(FIRST <= t < FIRST + 5 for t in x)
    return sorted(x)


ORACLES = {
    "task_even_pairs": classify(even_pairs), "task_parity_check": classify(parity_check),
    "task_cycle_navigation": classify(cycle_navigation),
    "task_modular_arithmetic": classify(modular_arithmetic),
    "task_modular_arithmetic_brackets": classify(modular_arithmetic_brackets),
    "task_solve_equation": classify(solve_equation),
    "task_reverse_string": of_bits(lambda x: x[::-1]),
    "task_stack_manipulation": stack_manipulation,
    "task_duplicate_string": of_bits(lambda x: x + x),
    "task_missing_duplicate_string": classify(missing_duplicate_string),
    "task_odds_first": of_bits(lambda x: x[1::2] + x[::2]),
    "task_binary_addition": binary_addition, "task_binary_multiplication": binary_multiplication,
    "task_compute_sqrt": compute_sqrt, "task_bucket_sort": whole(bucket_sort),
}
NAMES = sorted(ORACLES)
# the reference's output_length(length): 1 for a class
OUTPUT_LENGTH = {name: lambda k: 1 for name in NAMES}
OUTPUT_LENGTH.update({
    "task_reverse_string": lambda k: k, "task_stack_manipulation": lambda k: k + 1,
    "task_duplicate_string": lambda k: 2 * k, "task_odds_first": lambda k: k,
    "task_binary_addition": lambda k: k + 1, "task_binary_multiplication": lambda k: k,
    "task_compute_sqrt": lambda k: math.ceil(k / 2), "task_bucket_sort": lambda k: k})
# symbols: the reference's input and output alphabets, one token per meaning ('+' is PLUS)
SYMBOLS = {"task_even_pairs": 2, "task_parity_check": 2, "task_cycle_navigation": 5 + 3,
           "task_modular_arithmetic": 5 + 2, "task_modular_arithmetic_brackets": 5 + 4,
           "task_solve_equation": 5 + 5, "task_reverse_string": 2, "task_stack_manipulation": 6,
           "task_duplicate_string": 2, "task_missing_duplicate_string": 4, "task_odds_first": 2,
           "task_binary_addition": 3, "task_binary_multiplication": 4, "task_compute_sqrt": 2,
           "task_bucket_sort": 5}


def longest(name, k):
    """BOS, the input of k symbols, SEP, the output."""
    return k + 2 + OUTPUT_LENGTH[name](k)


def split(seq, answer):
    """The input, the output and how many of the output's first tokens are answers."""
    seq = seq.tolist()
    assert seq[0] == BOS and seq.count(SEP) == 1 and PAD not in seq
    sep = seq.index(SEP)
    scored = int(answer.sum())
    assert np.array_equal(np.flatnonzero(answer), np.arange(sep + 1, sep + 1 + scored))
    return seq[1:sep], seq[sep + 1:], scored


def test_the_module_registers_the_reference_tasks():
    mine = sorted(name for name, entry in registry().items()
                  if entry.cls.__module__ == "posbench.data.chomsky")
    assert mine == NAMES and len(NAMES) == 15  # every task of the reference's TASK_BUILDERS


@pytest.mark.parametrize("name", NAMES)
def test_each_instance_answers_what_the_oracle_says(name):
    t = task(name)
    assert t.min_size == 1 and t.vocab_size == FIRST + SYMBOLS[name]
    sizes = [(k, 4) for k in range(1, 41)] + [(k, 2) for k in (41, 64, 100, 500)]
    for k, seeds in sizes:
        for seed in range(seeds):
            seq, answer = t.make(np.random.default_rng([seed, k]), k)
            assert seq.dtype == np.int64 and max(seq) < t.vocab_size
            x, out, scored = split(seq, answer)
            assert (out, scored) == ORACLES[name](x, k), (k, seed)
            assert len(out) == OUTPUT_LENGTH[name](k)
            short = name == "task_modular_arithmetic" and k % 2 == 0  # λ - 1 symbols
            assert len(seq) == longest(name, k) - short


@pytest.mark.parametrize("name", NAMES)
def test_size_is_the_largest_that_fits_and_instances_are_seeded(name):
    t = task(name)
    for total in range(longest(name, 1), 300):
        k = t.size(total)
        assert longest(name, k) <= total < longest(name, k + 1)
    seq = t.make(np.random.default_rng(7), 12)[0]
    assert np.array_equal(seq, t.make(np.random.default_rng(7), 12)[0])
    assert any(not np.array_equal(seq, t.make(np.random.default_rng(s), 12)[0])
               for s in range(8, 12))
    data = prepare(OmegaConf.create({"name": name}))
    x, y = data.train_batch(40, 8, seed=3, step=2)
    assert x.equal(data.train_batch(40, 8, seed=3, step=2)[0])
    assert not x.equal(data.train_batch(40, 8, seed=4, step=2)[0])
    assert np.array_equal(data.eval_instances(60, 120)[0], data.eval_instances(60, 120)[0])


@pytest.mark.parametrize("name", NAMES)
def test_the_config_composes_with_lengths_in_instance_sizes(name):
    """Training on sizes up to 40 and testing on 41..500, the paper's, given as sizes."""
    cfg = posbench.compose([f"dataset={name}", "train.seq_len=${posbench.task_window:40}",
                            "eval.lengths=${posbench.task_window:[41,500]}"])
    data = prepare(cfg.dataset)
    assert data.vocab_size == FIRST + SYMBOLS[name]
    assert data.task.size(cfg.train.seq_len + 1) == 40
    assert [data.task.size(n + 1) for n in cfg.eval.lengths] == [41, 500]
    assert cfg.train.seq_len + 1 == longest(name, 40)  # an instance of 40 fills the window
    tokens, answers = data.eval_instances(cfg.eval.lengths[0], 2 * cfg.eval.lengths[0])
    for seq, answer in zip(tokens, answers):
        x, out, scored = split(seq, answer)
        assert (out, scored) == ORACLES[name](x, 41)


def draws(name, k, count=600):
    t = task(name)
    for seed in range(count):
        yield split(*t.make(np.random.default_rng([5, seed]), k))


def roughly_uniform(counts: Counter, support) -> bool:
    expected = sum(counts.values()) / len(support)
    return set(counts) == set(support) and all(0.6 < counts[s] / expected < 1.4 for s in support)


def test_classes_and_alphabets_span_the_reference_ranges():
    for name, classes in (("task_even_pairs", 2), ("task_parity_check", 2),
                          ("task_missing_duplicate_string", 2), ("task_cycle_navigation", 5),
                          ("task_modular_arithmetic", 5), ("task_modular_arithmetic_brackets", 5),
                          ("task_solve_equation", 5)):
        answers = Counter(out[0] - FIRST for _, out, _ in draws(name, 15))
        assert set(answers) == set(range(classes)), name
        assert classes > 2 or roughly_uniform(answers, range(2)), name
    inputs = lambda name, k: set().union(*(x for x, _, _ in draws(name, k, 100)))
    assert inputs("task_cycle_navigation", 10) == {FIRST + 5, FIRST + 6, FIRST + 7}
    assert inputs("task_modular_arithmetic", 9) == {*range(FIRST, FIRST + 5), PLUS, FIRST + 5,
                                                   FIRST + 6}
    # mult=True in the reference's TASK_BUILDERS: '*' appears; solve_equation has no '*'
    assert inputs("task_modular_arithmetic_brackets", 12) == {*range(FIRST, FIRST + 9), PLUS}
    assert inputs("task_solve_equation", 12) == {*range(FIRST, FIRST + 10), PLUS}
    assert inputs("task_stack_manipulation", 8) == set(range(FIRST, FIRST + 5))
    assert inputs("task_bucket_sort", 8) == set(range(FIRST, FIRST + 5))
    assert inputs("task_missing_duplicate_string", 7) == set(range(FIRST, FIRST + 4))


def test_lengths_are_drawn_as_the_reference_draws_them():
    # binary addition and multiplication: the first operand 1..λ-2 bits, uniformly
    for name, operator in (("task_binary_addition", PLUS), ("task_binary_multiplication",
                                                            FIRST + 2)):
        firsts = Counter(x.index(operator) for x, _, _ in draws(name, 8))
        assert roughly_uniform(firsts, range(1, 7))
        # each drawn from 1..2^bits - 1: zero-filled, so some end in a 0
        assert any(x[x.index(operator) - 1] == FIRST for x, _, _ in draws(name, 8, 100))
    # stack manipulation: the initial stack 1..λ-1 bits, uniformly; every action
    stacks = Counter(next(i for i, t in enumerate(x) if t >= FIRST + 2)
                     for x, _, _ in draws("task_stack_manipulation", 8))
    assert roughly_uniform(stacks, range(1, 8))
    # an empty final stack is END alone, a long one all but fills the output
    scored = Counter(s for _, _, s in draws("task_stack_manipulation", 8))
    assert 1 in scored and max(scored) >= 8
    # modular arithmetic with brackets: (left op right), left 1..λ-4 symbols, uniformly
    def left(x):
        """The left operand's length: the first binary operator outside brackets in (..)."""
        inner, depth = x[1:-1], 0
        for i, t in enumerate(inner):
            depth += {FIRST + 7: 1, FIRST + 8: -1}.get(t, 0)
            operand_ends = inner[i - 1] == FIRST + 8 or FIRST <= inner[i - 1] < FIRST + 5
            if depth == 0 and i > 0 and t in (PLUS, FIRST + 5, FIRST + 6) and operand_ends:
                return i
    lefts = Counter(left(x) for x, _, _ in draws("task_modular_arithmetic_brackets", 10))
    assert roughly_uniform(lefts, range(1, 7))
    # missing duplicate string: any of the 2 (λ // 2) positions
    assert set(x.index(FIRST + 2) for x, _, _ in draws("task_missing_duplicate_string", 9)) == \
        set(range(8))
    # compute sqrt: 1..2^λ - 1
    numbers = [int("".join(str(t - FIRST) for t in x), 2)
               for x, _, _ in draws("task_compute_sqrt", 6)]
    assert min(numbers) <= 2 and max(numbers) == 63 and 0 not in numbers


def test_small_sizes_are_the_references_degenerate_instances():
    first = lambda name, k: next(draws(name, k, 1))
    assert first("task_missing_duplicate_string", 1) == ([FIRST + 1], [FIRST + 1], 1)
    assert first("task_solve_equation", 1) == ([FIRST], [FIRST], 1)
    assert first("task_solve_equation", 2) == ([FIRST] * 2, [FIRST], 1)
    # binary addition at λ = 1: np.random.randint(0, 2**1 - 1) is 0
    assert {tuple(x + out) for x, out, _ in draws("task_binary_addition", 1, 20)} == \
        {(FIRST, FIRST, FIRST + 2)}
    assert {tuple(out) for _, out, _ in draws("task_binary_multiplication", 1, 20)} == \
        {(FIRST + 3,)}
    assert {tuple(out) for _, out, _ in draws("task_binary_multiplication", 2, 20)} == \
        {(FIRST, FIRST + 3)}
    assert {len(x) for x, _, _ in draws("task_modular_arithmetic", 2, 20)} == {1}
    assert {tuple(out) for _, out, _ in draws("task_compute_sqrt", 1, 20)} == {(FIRST + 1,)}
