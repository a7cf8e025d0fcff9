"""Kazemnejad et al.'s algorithmic tasks (posbench/data/algorithmic.py): every instance against an
oracle written here from the reference generators' description (the answer recomputed from the
prompt with plain Python), sizes against instance lengths counted here, seeding, the reference's
value ranges, and one training run."""
import numpy as np
import pytest
from omegaconf import OmegaConf

from posbench.data import prepare
from posbench.data.tasks import BOS, FIRST, PAD, PLUS, SEP
from helpers import posbench_cli, results


def task(name):
    return prepare(OmegaConf.create({"name": name})).task


def number(tokens) -> int:
    return int("".join(str(t - FIRST) for t in tokens))


def unlist(tokens, base, width=1):
    """The items of '[ a , b , c ]', whose marks are base, base + 1, base + 2 ([ ] ,)."""
    assert tokens[0] == base and tokens[-1] == base + 1
    inner = tokens[1:-1]
    items = [inner[i:i + width] for i in range(0, len(inner), width + 1)]
    assert all(t == base + 2 for t in inner[width::width + 1])
    return items


def relist(items, base):
    out = [base]
    for i, item in enumerate(items):
        out += ([base + 2] if i else []) + list(item)
    return out + [base + 1]


ITEM = range(FIRST, FIRST + 100)  # the copy and reverse tasks' 100 symbols
NEXT = FIRST + 100


def copy_repeat(p, k):
    assert len(p) == k and len(set(p)) == 1 and p[0] in ITEM
    return p


def copy_replace(p, k):
    s, t, rest = p[0], p[1], p[2:]
    assert s != t and rest == [s] * k and {s, t} <= set(ITEM)
    return [t] * k


def copy_repeat_2x(p, k):
    return copy_repeat(p, k) * 2


def twice(first, second):
    def oracle(p, k):
        assert len(p) == k and set(p) <= set(ITEM)
        return first(p) + [NEXT] + second(p)
    return oracle


def sort_single(p, k):
    items = unlist(p, FIRST + 50)
    assert len(items) == k and all(FIRST <= i < FIRST + 50 for [i] in items)
    return relist(sorted(items), FIRST + 50)


def sort_multi(p, k):
    numbers = [number(item) for item in unlist(p, FIRST + 10, width=4)]
    assert len(numbers) == k and all(10 <= n <= 9999 for n in numbers)
    return relist([[FIRST + int(c) for c in f"{n:04d}"] for n in sorted(numbers)], FIRST + 10)


def sum_mod(p, k):
    values = [v - FIRST for v in p[::2]]
    assert p[1::2] == [PLUS] * (k - 1) and len(values) == k and set(values) <= set(range(1, 10))
    return [FIRST + sum(values) % 10]


def parity(p, k):
    bits = [b - FIRST for [b] in unlist(p, FIRST + 2)]
    assert len(bits) == k and set(bits) <= {0, 1}
    return [FIRST + 5 if sum(bits) % 2 == 0 else FIRST + 6]  # Yes: an even number of 1s


MINUS, X, EQ = FIRST + 10, FIRST + 11, FIRST + 12  # the polynomial's marks


def signed(sign, digit):
    assert sign in (PLUS, MINUS)
    return (digit - FIRST) * (1 if sign == PLUS else -1)


def poly(p, k):
    assert p[:2] == [X, EQ] and len(p) == 4 + 4 * k
    x = signed(*p[2:4])
    total = 0
    for sign, c, x_, d in zip(*[iter(p[4:])] * 4):
        assert x_ == X and -3 <= signed(sign, c) <= 3 and 0 <= d - FIRST <= 3
        total += signed(sign, c) * x ** (d - FIRST)
    assert -2 <= x <= 2
    return [FIRST + total % 10]


def addition_msb(p, k):
    a, b = p[:k], p[k + 1:]
    assert p[k] == PLUS and len(b) == k
    assert k == 1 or FIRST not in (a[0], b[0])  # no leading zeros
    return [FIRST + int(c) for c in str(number(a) + number(b))]


def lego(p, k):
    """Follows each variable's chain back to the '+1' or '-1' it starts from."""
    minus, one, query = FIRST + 26, FIRST + 27, FIRST + 28
    clauses = {v: (s, o) for v, s, o in zip(*[iter(p[:3 * k])] * 3)}
    assert len(clauses) == k and p[3 * k] == query and len(p) == 3 * k + 2

    def value(v):
        """v's value and its index in the chain."""
        s, o = clauses[v]
        sign = 1 if s == PLUS else -1
        if o == one:
            return sign, 0
        w, i = value(o)
        return sign * w, i + 1

    assert sorted(value(v)[1] for v in clauses) == list(range(k))  # one chain
    val, index = value(p[-1])
    assert (k + 1) // 2 <= index < k  # the query is in the chain's later half
    return [PLUS if val == 1 else minus, one]


ORACLES = {
    "task_copy_repeat": copy_repeat, "task_copy_replace": copy_replace,
    "task_copy_repeat_2x": copy_repeat_2x,
    "task_copy_2x": twice(lambda x: x, lambda x: x),
    "task_reverse_2x": twice(lambda x: x[::-1], lambda x: x[::-1]),
    "task_reverse_copy": twice(lambda x: x[::-1], lambda x: x),
    "task_sort_single": sort_single, "task_sort_multi": sort_multi, "task_sum_mod": sum_mod,
    "task_parity": parity, "task_poly": poly, "task_addition_msb": addition_msb,
    "task_lego": lego, "task_lego_perm": lego,
}
# the longest instance of size k, counted from the formats above
LONGEST = {
    "task_copy_repeat": lambda k: 2 * k + 2, "task_copy_replace": lambda k: 2 * k + 4,
    "task_copy_repeat_2x": lambda k: 3 * k + 2, "task_copy_2x": lambda k: 3 * k + 3,
    "task_reverse_2x": lambda k: 3 * k + 3, "task_reverse_copy": lambda k: 3 * k + 3,
    "task_sort_single": lambda k: 4 * k + 4, "task_sort_multi": lambda k: 10 * k + 4,
    "task_sum_mod": lambda k: 2 * k + 2, "task_parity": lambda k: 2 * k + 4,
    "task_poly": lambda k: 4 * k + 7, "task_addition_msb": lambda k: 3 * k + 4,
    "task_lego": lambda k: 3 * k + 6, "task_lego_perm": lambda k: 3 * k + 6,
}
NAMES = sorted(ORACLES)


def test_the_module_registers_these_tasks():
    from posbench.data import registry
    mine = sorted(name for name, entry in registry().items()
                  if entry.cls.__module__ == "posbench.data.algorithmic")
    assert mine == NAMES


@pytest.mark.parametrize("name", NAMES)
def test_each_instance_answers_what_the_oracle_says(name):
    t = task(name)
    for size in [*range(t.min_size, 9), 20, 40 if "lego" not in name else 26]:
        for seed in range(6):
            seq, answer = t.make(np.random.default_rng([seed, size]), size)
            seq = seq.tolist()
            assert seq[0] == BOS and SEP in seq and max(seq) < t.vocab_size and PAD not in seq
            sep = seq.index(SEP)
            assert np.array_equal(np.flatnonzero(answer), np.arange(sep + 1, len(seq)))
            assert seq[sep + 1:] == ORACLES[name](seq[1:sep], size)
            assert len(seq) <= LONGEST[name](size)


@pytest.mark.parametrize("name", NAMES)
def test_size_is_the_largest_that_fits_and_instances_are_seeded(name):
    t = task(name)
    for total in range(LONGEST[name](t.min_size), 200):
        k = t.size(total)
        if t.fits(total):  # LEGO: no more than 26 variables
            assert "lego" in name and k > 26
            continue
        assert LONGEST[name](k) <= total < LONGEST[name](k + 1)
    rng = lambda seed: np.random.default_rng(seed)
    seq = t.make(rng(7), 10)[0]
    assert np.array_equal(seq, t.make(rng(7), 10)[0])
    assert any(not np.array_equal(seq, t.make(rng(s), 10)[0]) for s in range(8, 12))


def prompts(name, size, count=300):
    t = task(name)
    for seed in range(count):
        seq = t.make(np.random.default_rng([1, seed]), size)[0].tolist()
        yield seq[1:seq.index(SEP)]


def test_values_span_the_reference_ranges():
    sums = set().union(*(p[::2] for p in prompts("task_sum_mod", 8)))
    assert sums == {FIRST + v for v in range(1, 10)}  # randint(1, 10)
    coefficients, degrees, points = set(), set(), set()
    for p in prompts("task_poly", 6):
        points.add(signed(*p[2:4]))
        for sign, c, _, d in zip(*[iter(p[4:])] * 4):
            coefficients.add(signed(sign, c))
            degrees.add(d - FIRST)
    assert (coefficients, degrees, points) == (set(range(-3, 4)), set(range(4)), set(range(-2, 3)))
    numbers = [number(item) for p in prompts("task_sort_multi", 6)
               for item in unlist(p, FIRST + 10, width=4)]
    assert min(numbers) < 1000 and max(numbers) > 9000  # randint(10, 10000), 2 to 4 digits
    leads = {p[0] for p in prompts("task_addition_msb", 5)}
    assert leads == {FIRST + d for d in range(1, 10)}
    assert {p[0] for p in prompts("task_addition_msb", 1)} == {FIRST + d for d in range(10)}
    assert len({p[0] for p in prompts("task_copy_repeat", 3)}) > 90  # 100 symbols


def test_lego_clauses_are_in_chain_order_unless_permuted():
    def in_order(p):
        clauses = list(zip(*[iter(p[:-2])] * 3))
        return all(o == prev[0] for prev, (_, _, o) in zip(clauses, clauses[1:]))
    assert all(in_order(p) for p in prompts("task_lego", 8))
    assert not all(in_order(p) for p in prompts("task_lego_perm", 8, count=20))
    queries = {lego_index(p) for p in prompts("task_lego", 8)}
    assert queries == {4, 5, 6, 7}  # every index of the later half of 8


def lego_index(p):
    """The query's index in the chain: how many clauses back its value starts."""
    clauses = {v: o for v, _, o in zip(*[iter(p[:-2])] * 3)}
    index, v = 0, p[-1]
    while clauses[v] != FIRST + 27:
        v, index = clauses[v], index + 1
    return index


def test_lego_refuses_windows_past_26_variables():
    data = prepare(OmegaConf.create({"name": "task_lego"}))
    data.check(86, "eval")
    with pytest.raises(Exception, match="86 tokens that 26 variables"):
        data.check(87, "eval")


def test_train_on_summation_reports_exact_match(tmp_path):
    # windows of 41 tokens hold 20 numbers to add, of 81 tokens 40
    posbench_cli("train", "dataset=task_sum_mod", "encoding=nope", "model=tiny", "train.steps=5",
                 "train.batch_size=4", "train.seq_len=40", "train.warmup_steps=1",
                 "eval.lengths=[40,80]", "eval.tokens=160", "device=cpu", "hydra.run.dir=run",
                 cwd=tmp_path, in_process=True)
    record = results(tmp_path / "run")
    assert record["dataset"]["name"] == "task_sum_mod"
    curve = record["eval"]["curve"]
    assert [p["length"] for p in curve] == [40, 80]
    assert all(0 <= p["accuracy"] <= 1 for p in curve)
