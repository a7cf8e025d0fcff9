"""RULER's common- and frequent-word extraction (posbench/evaluations/ruler_words.py): instances
parsed back from their bytes against oracles written here (cwe's repeats and the window it fills,
fwe's Zeta counts from scipy and the largest N that fits and ranks the asked words), the answer
and what is scored, the sequence without the asked words, seeding, both scores on a hand-built
solver, the training mix, and the refusals and a run through the command."""
import collections
import dataclasses
import functools
import json
import re

import numpy as np
import pytest
import torch
from scipy.special import zeta as scipy_zeta

import posbench
from helpers import run_in_process, TOY
from test_ruler import assert_refused_before_any_work
from posbench.evaluations import ruler
from posbench.evaluations.ruler import Ruler, answer_scores, build_task
from posbench.evaluations.ruler_tasks import Vocabulary, instances
from posbench.evaluations.ruler_words import zeta

ASKS = {"cwe": b"\nmost common words? ", "fwe": b"\nmost frequent words? "}
WORD = rb"[a-z]{3}"


@pytest.fixture(scope="module")
def vocab(stdlib_data):
    return Vocabulary(stdlib_data, posbench.compose([]).dataset)


@functools.lru_cache(maxsize=None)
def defaults():
    return Ruler.config(posbench.compose([]))


def config(**values):
    return dataclasses.replace(defaults(), **values)


def parse(row, name):
    """An instance's list (its padding and separators dropped), the padding's length, and the
    answer's words."""
    text = bytes(np.asarray(row, dtype=np.uint8))
    ctx, ask, answer = text.rpartition(ASKS[name])
    assert ask and ctx.strip(b" ") == b" ".join(ctx.split())  # single spaces between words
    return ctx.split(), len(ctx) - len(ctx.lstrip(b" ")), ctx, answer.split(b", ")


def budget(name, length, asked):
    """Bytes the list and its padding have at byte level: the window less query and answer."""
    return length + 1 - len(ASKS[name]) - (3 * asked + 2 * (asked - 1))


def check_answer_and_removal(inst, name, words, answer, asked):
    """The answer: the asked words in their first occurrence's order, every letter scored;
    without them, each of their occurrences replaced by a word found once, the rest in place."""
    order = [w for w in dict.fromkeys(words) if w in asked]
    assert answer == order
    text = bytes(inst.row.astype(np.uint8))
    tail = text[text.rindex(ASKS[name]) + len(ASKS[name]):]
    np.testing.assert_array_equal(inst.scored, [c not in b", " for c in tail])
    # each asked word is one item: its letters numbered in the answer's order, separators -1
    items = np.cumsum([0] + [c == ord(",") for c in tail[:-1]])
    np.testing.assert_array_equal(inst.item, np.where(inst.scored, items, -1))
    removed, pad, _, answer_2 = parse(inst.removed, name)
    assert answer_2 == answer and bytes(inst.removed[-len(tail):].astype(np.uint8)) == tail
    assert len(removed) == len(words) and pad == parse(inst.row, name)[1]
    count = collections.Counter(removed)
    for mine, theirs in zip(words, removed):
        if mine in asked:
            assert count[theirs] == 1 and theirs not in words and re.fullmatch(WORD, theirs)
        else:
            assert theirs == mine


@pytest.mark.parametrize("counts, length", [({}, 128), ({}, 700),
                                            ({"common": 3, "common_repeats": 4,
                                              "uncommon_repeats": 2}, 300)])
def test_cwe_repeats_its_common_words_among_uncommon_ones_that_fill_the_window(
        vocab, counts, length):
    cfg = config(trials=3, **counts)
    common, often, rarely = cfg.common, cfg.common_repeats, cfg.uncommon_repeats
    room = budget("cwe", length, common)
    # RULER grows the uncommon words until the list fills the window: the most that fit
    uncommon = max(u for u in range(1, 1000) if 4 * (common * often + u * rarely) - 1 <= room)
    made = instances(build_task("cwe", cfg, vocab), cfg, length, 0.5)
    for inst in made:
        assert len(inst.row) == len(inst.removed) == length + 1
        words, pad, ctx, answer = parse(inst.row, "cwe")
        assert len(ctx) == room and pad == room - (4 * len(words) - 1)
        assert all(re.fullmatch(WORD, w) for w in words)
        count = collections.Counter(words)
        top = [w for w, n in count.items() if n == often]
        assert len(top) == common and len(count) == common + uncommon
        assert all(n == rarely for w, n in count.items() if w not in top)
        check_answer_and_removal(inst, "cwe", words, answer, set(top))
    assert len({bytes(m.row.astype(np.uint8)) for m in made}) == len(made)


def zipf_oracle(length, asked, alpha):
    """fwe's counts by rank from scipy's zeta at the largest N whose list (3-byte words and
    "...", one space apart) fits and whose asked ranks 2 .. asked + 1 each occur more often
    than the rank after them."""
    room, best, n = budget("fwe", length, asked), None, 1
    while True:
        counts = np.floor(n * np.arange(1, 5000.0) ** -alpha / scipy_zeta(alpha)).astype(int)
        counts = counts[counts > 0]
        if 4 * counts.sum() - 1 > room:
            return best
        padded = np.append(counts, [0] * (asked + 2))
        if padded[asked] > padded[asked + 1]:
            best = counts
        n += 1


@pytest.mark.parametrize("alpha, asked, length", [(2.0, 3, 128), (2.0, 3, 200), (2.0, 3, 1000),
                                                  (1.5, 2, 300), (2.0, 1, 64)])
def test_fwe_counts_are_the_zeta_law_and_the_asked_words_its_most_frequent(
        vocab, alpha, asked, length):
    cfg = config(trials=3, alpha=alpha, frequent=asked)
    expected = zipf_oracle(length, asked, alpha)
    for inst in instances(build_task("fwe", cfg, vocab), cfg, length, 0.0):
        assert len(inst.row) == len(inst.removed) == length + 1
        words, pad, ctx, answer = parse(inst.row, "fwe")
        count = collections.Counter(words)
        assert count.pop(b"...") == expected[0]  # the noise: rank 1
        assert all(re.fullmatch(WORD, w) for w in count)
        ranked = sorted(count, key=count.get, reverse=True)
        assert [count[w] for w in ranked] == list(expected[1:])
        top = set(ranked[:asked])
        assert min(count[w] for w in top) > max([count[w] for w in ranked[asked:]] + [0])
        assert pad == budget("fwe", length, asked) - (4 * len(words) - 1)
        check_answer_and_removal(inst, "fwe", words, answer, top)


def test_fwe_steps_n_down_where_the_asked_words_would_tie_with_the_next(vocab):
    # at 200 bytes the largest N that fits ranks 4 and 5 alike: the instance takes a smaller one
    counts = lambda n: np.floor(n * np.arange(1, 50.0) ** -2 / scipy_zeta(2.0))
    largest = max(n for n in range(1, 200) if 4 * counts(n).sum() - 1 <= budget("fwe", 200, 3))
    assert counts(largest)[3] == counts(largest)[4] == 1
    words = parse(instances(build_task("fwe", config(), vocab), config(trials=1), 200, 0)[0].row,
                  "fwe")[0]
    assert len(words) == zipf_oracle(200, 3, 2.0).sum() < counts(largest).sum()


@pytest.mark.parametrize("alpha", [1.05, 1.5, 2.0, 3.0, 7.5])
def test_zeta_is_riemanns(alpha):
    assert zeta(alpha) == pytest.approx(scipy_zeta(alpha), rel=1e-13)


def test_the_same_sequences_for_every_run_and_others_for_another_seed_or_cell(stdlib_data,
                                                                               vocab):
    cfg = config(trials=2)
    rows = lambda made: np.stack([np.concatenate([m.row, m.removed]) for m in made])
    for name in ("cwe", "fwe"):
        np.random.seed(1)
        a = rows(instances(build_task(name, cfg, vocab), cfg, 256, 0.25))
        np.random.seed(2)  # the global generator plays no part
        again = Vocabulary(stdlib_data, posbench.compose([]).dataset)
        assert np.array_equal(a, rows(instances(build_task(name, cfg, again), cfg, 256, 0.25)))
        other_seed = config(trials=2, seed=1)
        for other in (instances(build_task(name, other_seed, vocab), other_seed, 256, 0.25),
                      instances(build_task(name, cfg, vocab), cfg, 256, 0.5)):
            assert not np.array_equal(a, rows(other))
        assert not np.array_equal(a[0], a[1])


# ---- scores on a hand-built solver -------------------------------------------------------------

class Counter(torch.nn.Module):
    """A solver written from the task's definition: in the answer, each next byte of the asked
    words (the k most frequent words of the list other than "...", k from the query, in the
    order of their first occurrence) with probability 0.99; `hidden` returns the logits over
    256 byte tokens."""
    head = torch.nn.Identity()

    def __init__(self, asked):
        super().__init__()
        self.asked = asked

    def hidden(self, x):
        B, T = x.shape
        logits = torch.zeros(B, T, 256)
        for b, row in enumerate(x.tolist()):
            text = bytes(row)
            name = next(n for n, ask in ASKS.items() if ask in text)
            ctx, ask, _ = text.rpartition(ASKS[name])
            words = [w for w in ctx.split() if w != b"..."]
            count = collections.Counter(words)
            top = set(sorted(count, key=lambda w: (-count[w], words.index(w)))[:self.asked])
            answer = b", ".join(w for w in dict.fromkeys(words) if w in top)
            start = len(ctx) + len(ask)
            for t in range(start - 1, T):
                if t + 1 - start < len(answer):
                    logits[b, t, answer[t + 1 - start]] = float(np.log(99 * 255))
        return logits


@pytest.mark.parametrize("name", ["cwe", "fwe"])
def test_the_solver_retrieves_both_a_context_free_model_saves_nothing(vocab, name):
    cfg = config(trials=2)
    task = build_task(name, cfg, vocab)
    for length in (128, 400):
        made = instances(task, cfg, length, 0.5)
        rows = torch.from_numpy(np.stack([m.row for m in made] + [m.removed for m in made]))
        scored, item = torch.from_numpy(made[0].scored), torch.from_numpy(made[0].item)
        assert int(scored.sum()) == 3 * task.n_asked
        loss, hits, found = answer_scores(Counter(task.n_asked), rows, scored, item)
        assert hits[:2].all() and not hits[2:].any() and torch.equal(found, hits.double())
        assert loss[:2].double() == pytest.approx(-np.log2(0.99), abs=1e-6)
        assert (loss[2:] - loss[:2] > 5).all()  # the asked words are nowhere to be counted
        flat = torch.zeros(len(rows), length, 256)  # one distribution everywhere
        model = type("Flat", (), {"hidden": lambda self, x: flat[:, :x.shape[1]],
                                  "head": torch.nn.Identity()})()
        loss, hits, _ = answer_scores(model, rows, scored, item)
        assert torch.equal(loss[:2], loss[2:]) and loss[0].item() == pytest.approx(8.0)


# ---- the training mix, refusals and the command line -------------------------------------------

def test_the_training_mix_plants_cwe_and_fwe_rows_at_the_training_length(stdlib_data, vocab):
    cfg = posbench.compose(["train.ruler_mix=0.5", "train.seq_len=128",
                            "train.ruler_tasks=[cwe,fwe]"])
    plant = ruler.training_mix(cfg, stdlib_data)
    tasks = [build_task(name, ruler.RulerConfig(), vocab) for name in ("cwe", "fwe")]
    seen = collections.Counter()
    for step in range(20):
        rows = np.zeros((8, 129), dtype=np.int64)
        for i in plant(rows, 0, step):
            own = np.random.default_rng([0, step, ruler.MIX_STREAM, i + 1])
            task = tasks[int(own.integers(2))]
            assert np.array_equal(rows[i], task.make(own, 128, float(own.random())).row)
            seen[task.name] += 1
            parse(rows[i], task.name)
    assert seen["cwe"] > 10 and seen["fwe"] > 10



@pytest.mark.parametrize("overrides, refusal", [
    # cwe's shortest list: 13 words of 3 bytes and their 12 spaces, with the query's 20 bytes
    # and the answer "abc, def"
    (["eval.ruler.tasks=[cwe]"], "eval.ruler.tasks=cwe at length 32 is not accepted: its "
     "shortest list (2 words 6 times each and one 1 time(s)), query and answer take 79 tokens, "
     "more than the window's 33; expected eval.ruler.lengths of at least 78 for cwe"),
    # fwe's: N = 27, "..." 16 times and 3 words 4, 1 and 1 times, 87 bytes with their spaces, a
    # 22-byte query and the 13-byte answer
    (["eval.ruler.tasks=[cwe,fwe]", "eval.ruler.lengths=[120]"], "eval.ruler.tasks=fwe at length "
     "120 is not accepted: its shortest list (N = 27: '...' and 3 words at Zeta(2.0) counts, the "
     "3 asked above the rest), query and answer take 122 tokens, more than the window's 121; "
     "expected eval.ruler.lengths of at least 121 for fwe"),
    # one-letter words at 256: 2 common, (257 - 20 - 4 + 1) // 2 - 12 = 105 uncommon and the 12
    # that stand in for the common words' occurrences
    (["eval.ruler.tasks=[cwe]", "eval.ruler.lengths=[256]", "eval.ruler.key_tokens=1"],
     "eval.ruler.key_tokens=1 is not accepted: cwe at length 256 draws 119 distinct words, and "
     "1 token(s) of the 26 words tokens of the run's vocabulary make 26"),
    (["eval.ruler.common_repeats=2", "eval.ruler.uncommon_repeats=2"],
     "eval.ruler.common_repeats=2 is not accepted; expected more than "
     "eval.ruler.uncommon_repeats=2"),
    (["eval.ruler.alpha=1.0"], "eval.ruler.alpha=1.0 is not accepted; expected a number above 1"),
    (["eval.ruler.frequent=0"], "eval.ruler.frequent=0 is not accepted; expected a positive"),
    (["eval.ruler.enabled=false", "train.ruler_mix=0.5", "train.ruler_tasks=[fwe]"],
     "train.ruler_tasks=fwe with "
     "train.seq_len=32 is not accepted: its shortest list"),
])
def test_what_cannot_be_built_is_refused_in_one_line_before_any_work(
        tmp_path, monkeypatch, capsys, overrides, refusal, stdlib_data):  # tokenized: no progress
    assert_refused_before_any_work(tmp_path, monkeypatch, capsys, overrides, refusal)


def test_a_run_trains_on_both_and_scores_them(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    run = ["train.seq_len=128", "eval.lengths=[128]", "train.ruler_mix=0.5",
           "train.ruler_tasks=[cwe,fwe]", "eval.ruler.enabled=true", "eval.ruler.tasks=[fwe,cwe]",
           "eval.ruler.trials=2", "eval.ruler.depths=[0.5]", "eval.ruler.lengths=[128,256]"]
    proc = run_in_process(["train", *TOY, *run, "hydra.run.dir=run"], monkeypatch, capsys)
    assert proc.returncode == 0, proc.stderr
    record = json.loads((tmp_path / "run" / "results.json").read_text())
    r = record["eval"]["ruler"]
    assert list(r["tasks"]) == ["fwe", "cwe"]
    assert {name: t["answer_tokens"] for name, t in r["tasks"].items()} == {"fwe": 9, "cwe": 6}
    assert {name: t["haystack"] for name, t in r["tasks"].items()} == {"fwe": "list",
                                                                       "cwe": "list"}
    assert (r["counts"]["common"], r["counts"]["alpha"]) == (2, 2.0)
    for task in r["tasks"].values():
        assert [c["length"] for c in task["grid"]] == [128, 256]
        for cell in task["grid"]:
            assert cell["bits_saved"] == pytest.approx(cell["loss_removed"] - cell["loss"])
    assert record["config"]["train"]["ruler_tasks"] == ["cwe", "fwe"]
