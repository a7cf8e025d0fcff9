"""Golovneva et al.'s counting task (posbench/data/counting.py): every instance against an oracle
written here (the tokens read back as the reference's words, the program run as Python, the
question's variable evaluated), the reference generator's distribution (statement weights 1 : 50
: 7 where nothing is refused, variables drawn uniformly, values capped at 10, at least 3
statements and a variable set), sizes in program tokens, seeding, and configs that compose."""
from collections import Counter

import numpy as np
import pytest
from omegaconf import OmegaConf

import posbench
from posbench.core.errors import ConfigError
from posbench.data import prepare, registry
from posbench.data.tasks import BOS, FIRST, PAD, SEP

NAMES = {"task_counting_1": 1, "task_counting_3": 3, "task_counting_5": 5}


def task(name):
    return prepare(OmegaConf.create({"name": name})).task


def words(nvars):
    """The reference's words in token order after the special tokens: the values, the variables,
    then its other words."""
    return [str(v) for v in range(11)] + list("abcde"[:nvars]) + ["=", ";", "pass;", "++;",
                                                                   "print"]


def read(seq, nvars):
    """An instance as the reference's text: (program words, the question's variable, the
    answer)."""
    seq = list(seq)
    assert seq[0] == BOS and seq[-2] == SEP and PAD not in seq
    table = dict(enumerate(words(nvars), FIRST))
    text = [table[t] for t in seq[1:-2]]
    assert text[-2] == "print" and text[-1] in "abcde"[:nvars]
    return text[:-2], text[-1], int(table[seq[-1]])


def statements(program):
    """The program's statements, in the reference's spelling, split from its words."""
    out, i = [], 0
    while i < len(program):
        if program[i] == "pass;":
            out.append(("pass;",))
            i += 1
        elif program[i + 1] == "=":
            assert program[i + 2:i + 4] == ["0", ";"], program[i:i + 4]
            out.append(tuple(program[i:i + 4]))
            i += 4
        else:
            assert program[i + 1] == "++;", program[i:i + 2]
            out.append(tuple(program[i:i + 2]))
            i += 2
    return out


def python(statement) -> str:
    """A statement as Python: `a = 0 ;` -> a = 0, `a ++;` -> a += 1, `pass;` -> pass."""
    if statement == ("pass;",):
        return "pass"
    if statement[1] == "=":
        return f"{statement[0]} = 0"
    return f"{statement[0]} += 1"


def run(program):
    """Steps through the program with a dict of values; yields (statement, tokens left before
    it, the values before it)."""
    values, left = {}, len(program)
    for statement in statements(program):
        yield statement, left, dict(values)
        if statement[1:2] == ("=",):
            values[statement[0]] = 0
        elif statement != ("pass;",):
            assert statement[0] in values  # only a variable set before is incremented
            values[statement[0]] += 1
            assert values[statement[0]] <= 10
        left -= len(statement)


def oracle(seq, nvars):
    program, variable, answer = read(seq, nvars)
    namespace = {}
    for statement in statements(program):
        exec(python(statement), namespace)
    return eval(variable, namespace), answer


def instances(name, sizes, seeds):
    t = task(name)
    for size in sizes:
        for seed in seeds:
            yield size, t.make(np.random.default_rng([seed, size]), size)


def test_the_module_registers_the_three_tables_columns():
    mine = sorted(name for name, entry in registry().items()
                  if entry.cls.__module__ == "posbench.data.counting")
    assert mine == sorted(NAMES)
    for name, nvars in NAMES.items():
        data = prepare(OmegaConf.create({"name": name}))
        assert data.vocab_size == FIRST + len(words(nvars)) == FIRST + 16 + nvars


@pytest.mark.parametrize("name", sorted(NAMES))
def test_each_instance_answers_what_the_program_computes(name):
    nvars = NAMES[name]
    for size, (seq, answer) in instances(name, [6, 7, 8, 9, 12, 20, 40, 123, 300], range(12)):
        assert len(seq) == size + 5 and max(seq) < FIRST + len(words(nvars))
        assert np.flatnonzero(answer).tolist() == [len(seq) - 1]  # the answer alone is scored
        computed, written = oracle(seq, nvars)
        assert computed == written and 0 <= written <= 10
        program = read(seq, nvars)[0]
        assert len(program) == size and len(statements(program)) >= 3
        assert any(s[1:2] == ("=",) for s in statements(program))


def test_the_smallest_programs_are_the_references_three_statements():
    t = task("task_counting_3")
    assert t.min_size == 6 and t.fits(11) == "" and t.fits(10)
    seen = set()
    for seed in range(40):
        program = read(t.make(np.random.default_rng(seed), 6)[0], 3)[0]
        shape = tuple("set" if s[1:2] == ("=",) else s[0] for s in statements(program))
        assert sorted(shape) == ["pass;", "pass;", "set"]  # `v ++;` after a set is 2 statements
        seen.add(shape)
    assert len(seen) == 3  # the set first, second or third
    with pytest.raises(ValueError, match="smallest .* has 6"):
        t.make(np.random.default_rng(0), 5)
    with pytest.raises(ConfigError, match="too short for one instance"):
        prepare(OmegaConf.create({"name": "task_counting_3"})).check(10, "eval.lengths entry 9")


def kinds(name, count=250, size=120):
    """(kind, tokens left, values before) of every statement of `count` programs."""
    out = []
    for _, (seq, _) in instances(name, [size], range(count)):
        for statement, left, before in run(read(seq, NAMES[name])[0]):
            kind = "set" if statement[1:2] == ("=",) else "inc" if len(statement) == 2 else "pass"
            out.append((kind, statement[0], left, before))
    return out


def within(count, total, p, sigmas=4.5):
    return abs(count - total * p) <= sigmas * (total * p * (1 - p)) ** 0.5


def test_statements_are_drawn_with_the_references_weights():
    drawn = kinds("task_counting_3")
    # with room for any statement and nothing refused (a variable set, none at 10): 1 : 50 : 7
    free = Counter(k for k, _, left, before in drawn
                   if left >= 4 and before and max(before.values()) < 10)
    total = sum(free.values())
    assert total > 15000
    for kind, weight in (("set", 1), ("pass", 50), ("inc", 7)):
        assert within(free[kind], total, weight / 58), (kind, free, total)
    # before any variable exists an increment is refused and drawn again: 1 : 50 (programs
    # long enough that one without a set, drawn again, is too rare to tilt the count)
    empty = Counter(k for k, _, left, before in kinds("task_counting_3", count=60, size=1500)
                    if left >= 4 and not before)
    assert empty["inc"] == 0 and sum(empty.values()) > 2000
    assert within(empty["set"], sum(empty.values()), 1 / 51), empty
    # the last tokens hold only what fits
    assert all(k == "pass" for k, _, left, _ in drawn if left == 1)
    assert all(k != "set" for k, _, left, _ in drawn if left < 4)


def test_variables_are_drawn_uniformly_and_values_capped_at_ten():
    drawn = kinds("task_counting_5", count=250, size=300)
    sets = Counter(v for k, v, _, _ in drawn if k == "set")
    assert set(sets) == set("abcde")
    assert all(within(n, sum(sets.values()), 1 / 5) for n in sets.values()), sets
    # an increment goes to one of the variables set so far, uniformly, never past 10
    two = [(v, sorted(before)) for k, v, _, before in drawn
           if k == "inc" and len(before) == 2 and max(before.values()) < 10]
    assert all(v in names for v, names in two)
    first = sum(v == names[0] for v, names in two)
    assert len(two) > 1000 and within(first, len(two), 1 / 2)
    values = [max(before.values()) for _, _, _, before in drawn if before]
    assert max(values) == 10
    # a variable at 10 is never incremented (run() would see 11), and the answers reach 10
    answers = Counter(read(seq, 5)[2] for _, (seq, _) in instances("task_counting_5", [300],
                                                                     range(300)))
    assert set(answers) == set(range(11))


def test_the_question_asks_about_a_variable_set_uniformly():
    asked = Counter()
    for _, (seq, _) in instances("task_counting_3", [400], range(300)):
        program, variable, _ = read(seq, 3)
        names = {s[0] for s in statements(program) if s[1:2] == ("=",)}
        assert variable in names
        if names == {"a", "b", "c"}:
            asked[variable] += 1
    total = sum(asked.values())
    assert total > 100 and all(within(asked[v], total, 1 / 3) for v in "abc"), asked


def test_sizes_count_the_programs_tokens_and_training_draws_them_all():
    data = prepare(OmegaConf.create({"name": "task_counting_1"}))
    for total in range(11, 80):
        assert data.task.size(total) == total - 5
    x, y = data.train_batch(40, 512, seed=3, step=7)  # windows of 41 tokens: programs 6..36
    answers = (y != -100).numpy()
    assert (answers.sum(1) == 1).all()
    # the answer is the instance's last token, the target at its index - 1
    programs = answers.argmax(1) + 2 - 5
    assert programs.min() == 6 and programs.max() == 36
    assert len(set(programs.tolist())) > 25  # drawn uniformly over the sizes that fit
    tokens, answer = data.eval_instances(64, 640)
    assert tokens.shape == (10, 65) and (tokens != PAD).all() and answer.sum(1).tolist() == [1] * 10


def test_instances_are_seeded():
    t = task("task_counting_5")
    rng = lambda seed: np.random.default_rng(seed)
    seq = t.make(rng(7), 100)[0]
    assert np.array_equal(seq, t.make(rng(7), 100)[0])
    assert all(not np.array_equal(seq, t.make(rng(s), 100)[0]) for s in range(8, 12))
    data = prepare(OmegaConf.create({"name": "task_counting_5"}))
    assert np.array_equal(data.eval_instances(128, 1024)[0], data.eval_instances(128, 1024)[0])
    a, b = data.train_batch(64, 8, seed=0, step=1), data.train_batch(64, 8, seed=0, step=1)
    assert all(np.array_equal(p, q) for p, q in zip(a, b))
    assert not np.array_equal(a[0], data.train_batch(64, 8, seed=1, step=1)[0])


@pytest.mark.parametrize("name", sorted(NAMES))
def test_the_config_composes(name):
    cfg = posbench.compose([f"dataset={name}", "train.seq_len=128", "eval.lengths=[64,128]"])
    assert cfg.dataset.name == name
    data = prepare(cfg.dataset)
    assert data.vocab_size == FIRST + 16 + NAMES[name]
    assert data.task.size(cfg.train.seq_len + 1) == 124
    # an instance of size s fills a window of s + 4: `${posbench.task_window:s}`
    cfg = posbench.compose([f"dataset={name}", "train.seq_len=${posbench.task_window:123}"])
    assert cfg.train.seq_len == 127
    with pytest.raises(ConfigError, match="dataset.bos"):
        posbench.config.check(posbench.compose([f"dataset={name}", "dataset.bos=true"]))
