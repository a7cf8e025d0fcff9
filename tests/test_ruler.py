"""RULER's tasks (posbench/evaluations/ruler_tasks.py builds them, ruler.py scores them): each
preset's instances parsed back from their bytes and checked against its definition (needles,
distractors, counts, distinctness, depth, the answer and what is scored, the sequence without the
answer's needles), GPT-2 BPE draws, seeding, the refusals, both scores against per-token losses
computed here, and the CLI (train, re-score)."""
import collections
import copy
import dataclasses
import functools
import json
import math
import re

import numpy as np
import pytest
import torch
import torch.nn.functional as F

import posbench
from helpers import (Blind, Copier, posbench_cli, results, run_in_process, TOY,
                     wandb_file_summary, wandb_summary)
from posbench.data import prepare
from posbench.data.tokenize import _byte_chars
from posbench.evaluations.ruler import Ruler, answer_scores, build_task
from posbench.evaluations.ruler_tasks import DEFAULT_TASKS, Task, Vocabulary, instances

WORD, NUMBER, NAME = rb"[a-z]{3}", rb"[0-9]{4}", rb"[A-Z]{3}"
UUID = rb"[0-9a-f]{4}-[0-9a-f]{4}"
NEEDLE = re.compile(rb"key (%s|%s) is (%s|%s)\. " % (UUID, WORD, UUID, NUMBER))
STATEMENT = re.compile(rb"var (%s) = (%s|%s)\. " % (NAME, NAME, NUMBER))
NOISE = b"the hills are quiet and the river runs slow. "
# RULER's presets at the defaults: haystack, key and value forms, distinct keys of the needles
# planted, values per key, keys asked
SPEC = {
    "niah_single_1": ("noise", WORD, NUMBER, 1, 1, 1),
    "niah_single_2": ("text", WORD, NUMBER, 1, 1, 1),
    "niah_single_3": ("text", WORD, UUID, 1, 1, 1),
    "niah_multikey_1": ("text", WORD, NUMBER, 4, 1, 1),
    "niah_multikey_2": ("needle", WORD, NUMBER, 1, 1, 1),
    "niah_multikey_3": ("needle", UUID, UUID, 1, 1, 1),
    "niah_multivalue": ("text", WORD, NUMBER, 1, 4, 1),
    "niah_multiquery": ("text", WORD, NUMBER, 2, 1, 2),
    "niah_control": ("blank", WORD, NUMBER, 1, 1, 1),
}


@pytest.fixture(scope="module")
def vocab(stdlib_data):
    return Vocabulary(stdlib_data, posbench.compose([]).dataset)


@pytest.fixture(scope="module")
def val_text(stdlib_data):
    d = stdlib_data
    return bytes(np.asarray(d.tokens[d.val_docs[0]:d.val_docs[-1]], dtype=np.uint8))


@functools.lru_cache(maxsize=None)
def defaults():
    return Ruler.config(posbench.compose([]))


def config(**values):
    """eval.ruler's composed defaults with `values` in place."""
    return dataclasses.replace(defaults(), **values)


SPACE = b" \t\n\r\x0b\x0c"


def boundaries(hay: bytes, haystack: str, unit: int) -> set:
    """Where a needle may go in a haystack (its bytes, needles cut out): between whole units,
    counted back from its end, for noise and needles; between words and at the edges of text;
    anywhere in a blank one."""
    n = len(hay)
    if haystack == "text":
        return {0, n} | {b for b in range(1, n) if hay[b - 1] in SPACE or hay[b] in SPACE}
    return set(range(n % unit, n + 1, unit))


def at_depth(depth, bounds, n):
    """The boundary nearest depth x n, the lower at a tie."""
    return min(bounds, key=lambda b: (abs(b - depth * n), b))


def repeated_to_its_end(hay: bytes, unit: bytes) -> bool:
    """hay is copies of unit after the cut end of one: its last unit whole."""
    return hay == (unit * (len(hay) // len(unit) + 1))[len(unit) - len(hay) % len(unit):]


def parse(row):
    """A niah instance's context, asked keys, answer bytes, whole needles (start, end, key,
    value) in the context, and the values the answer gives per key."""
    text = bytes(np.asarray(row, dtype=np.uint8))
    ctx, _, rest = text.rpartition(b"\nwhat is key ")
    asked, _, answer = rest.partition(b"? ")
    needles = [(m.start(), m.end(), m.group(1), m.group(2)) for m in NEEDLE.finditer(ctx)]
    given = {}
    for segment in re.split(rb", (?=key )", answer):
        m = re.fullmatch(rb"key (\S+) is (.+)", segment)
        given[m.group(1)] = m.group(2).split(b", ")
    return ctx, asked.split(b", "), answer, needles, given


def scored_bytes(answer: bytes) -> np.ndarray:
    """The answer's value characters: not "key K is ", not ", ", not a uuid's hyphen."""
    mask = np.array([c not in b", -" for c in answer])
    for m in re.finditer(rb"key \S+ is ", answer):
        mask[m.start():m.end()] = False
    return mask


def without(ctx: bytes, spans) -> bytes:
    """ctx with the spans (start, end) cut out."""
    out, at = b"", 0
    for start, end in sorted(spans):
        out, at = out + ctx[at:start], end
    return out + ctx[at:]


def filler_before(start, spans) -> int:
    """Haystack bytes before `start`: those of the planted needles before it not counted."""
    return start - sum(e - s for s, e in spans if e <= start)


@pytest.mark.parametrize("name", list(SPEC))
@pytest.mark.parametrize("depth", [0.0, 0.3, 1.0])
def test_each_niah_preset_plants_its_needles_at_their_depth_and_asks_for_them(
        vocab, val_text, name, depth):
    haystack, key_form, value_form, n_keys, n_values, n_asked = SPEC[name]
    length = 200 if haystack != "needle" else 300
    for inst in instances(Task(name, config(), vocab), config(trials=3), length, depth):
        assert len(inst.row) == len(inst.removed) == length + 1
        ctx, asked, answer, needles, given = parse(inst.row)
        assert list(given) == asked and len(asked) == n_asked
        assert np.array_equal(inst.scored, scored_bytes(answer))
        keys = [k for _, _, k, _ in needles]
        values = [v for _, _, _, v in needles]
        assert all(re.fullmatch(key_form, k) for k in keys)
        assert all(re.fullmatch(value_form, v) for v in values)
        assert len(set(values)) == len(values) and not set(keys) & set(values)  # all distinct
        for key in asked:  # every value of an asked key, in the text's order
            assert given[key] == [v for _, _, k, v in needles if k == key]
        if haystack == "needle":  # the asked needle among needles of distinct other keys
            assert len(set(keys)) == len(keys) and asked[0] in keys
            planted = [(s, e) for s, e, k, _ in needles if k == asked[0]]
            unit = planted[0][1] - planted[0][0]
        else:
            assert len(needles) == n_keys * n_values and len(set(keys)) == n_keys
            assert all(keys.count(k) == n_values for k in keys) and set(asked) <= set(keys)
            planted = [(s, e) for s, e, _, _ in needles]
            unit = len(NOISE) if haystack == "noise" else 1
        hay = without(ctx, planted)
        if haystack == "noise":
            assert repeated_to_its_end(hay, NOISE)
        elif haystack == "blank":
            assert hay == b" " * len(hay)
        elif haystack == "text":
            assert hay in val_text  # one stretch of a validation document
        else:  # whole needles after the cut end of one: the one before the query whole
            cut = len(hay) % unit
            assert NEEDLE.sub(b"", hay[cut:]) == b"" and not NEEDLE.search(hay[:cut])
        # depth: the first answer's needle; every needle at a boundary (a multivalue key's after
        # the first): never inside a unit or a word
        bounds = boundaries(hay, haystack, unit)
        first = next(s for s, _, k, v in needles if k == asked[0] and v == given[asked[0]][0])
        assert filler_before(first, planted) == at_depth(depth, bounds, len(hay))
        for s, _ in planted:
            offset = filler_before(s, planted)
            assert offset in bounds
            if n_values > 1:
                assert offset >= filler_before(first, planted)

        # without the needles that hold the answer: the haystack runs on to the same length
        ctx_2, asked_2, answer_2, needles_2, _ = parse(inst.removed)
        assert (asked_2, answer_2) == (asked, answer)
        assert not {k for _, _, k, _ in needles_2} & set(asked)
        kept = [(s, e) for s, e, k, _ in needles if k not in asked]
        if haystack != "needle":
            assert [k for _, _, k, _ in needles_2] == [k for _, _, k, _ in needles
                                                       if k not in asked]
            spans_2 = [(s, e) for s, e, _, _ in needles_2]
            assert [filler_before(s, spans_2) for s, _ in spans_2] == \
                [filler_before(s, planted) for s, _ in kept]
            hay_2 = without(ctx_2, spans_2)
        else:
            hay_2 = ctx_2
        assert hay_2.startswith(hay) and len(hay_2) == len(hay) + sum(e - s for s, e in planted
                                                                       if (s, e) not in kept)


@pytest.mark.parametrize("chains", [1, 2])
@pytest.mark.parametrize("depth", [0.0, 0.6, 1.0])
def test_variable_tracking_asks_for_every_name_bound_to_the_value(vocab, chains, depth):
    cfg = config(chains=chains, trials=3)
    for inst in instances(Task("vt", cfg, vocab), cfg, 300, depth):
        text = bytes(inst.row.astype(np.uint8))
        ctx, _, rest = text.rpartition(b"\nwhich vars are ")
        value, _, answer = rest.partition(b"? ")
        names = answer.split(b", ")
        statements = [(m.start(), m.end(), m.group(1), m.group(2))
                      for m in STATEMENT.finditer(ctx)]
        assert len(statements) == chains * 5 and re.fullmatch(NUMBER, value)
        lhs = [x for _, _, x, _ in statements]
        assert len(set(lhs)) == len(lhs)
        bound, grew = {value}, True  # every name the value reaches, in any order of statements
        while grew:
            new = {x for _, _, x, y in statements if y in bound} - bound
            bound, grew = bound | new, bool(new)
        assert set(names) == bound - {value} and len(names) == 5
        chain = [x for _, _, x, y in statements if x in bound]
        assert chain == names  # in the chain's order, which is the text's
        assert [y for _, _, x, y in statements if x in bound] == [value] + names[:-1]
        spans = [(s, e) for s, e, _, _ in statements]
        hay = without(ctx, spans)
        assert repeated_to_its_end(hay, NOISE)
        bounds = boundaries(hay, "noise", len(NOISE))
        assert filler_before(statements[lhs.index(names[0])][0], spans) == \
            at_depth(depth, bounds, len(hay))
        assert all(filler_before(s, spans) in bounds for s, _ in spans)
        np.testing.assert_array_equal(
            inst.scored, [c not in b", " for c in answer])
        removed = bytes(inst.removed.astype(np.uint8))
        assert removed.endswith(text[len(ctx):])
        assert {m.group(1) for m in STATEMENT.finditer(removed)} == set(lhs) - set(names)


def test_the_same_sequences_for_every_run_and_others_for_another_seed_task_or_cell(
        stdlib_data, vocab):
    cfg = config(trials=2)
    np.random.seed(1), torch.manual_seed(1)
    a = instances(Task("niah_multikey_1", cfg, vocab), cfg, 256, 0.25)
    np.random.seed(2), torch.manual_seed(2)  # the global generators play no part
    again = Vocabulary(stdlib_data, posbench.compose([]).dataset)
    b = instances(Task("niah_multikey_1", cfg, again), cfg, 256, 0.25)
    rows = lambda made: np.stack([np.concatenate([m.row, m.removed]) for m in made])
    assert np.array_equal(rows(a), rows(b))
    others = [instances(Task("niah_multikey_1", config(seed=1), vocab), config(seed=1, trials=2),
                        256, 0.25),
              instances(Task("niah_single_2", cfg, vocab), cfg, 256, 0.25),
              instances(Task("niah_multikey_1", cfg, vocab), cfg, 256, 0.5),
              instances(Task("niah_multikey_1", cfg, vocab), cfg, 320, 0.25)]
    assert all(not np.array_equal(rows(a)[:, :257], rows(o)[:, :257]) for o in others)
    assert not np.array_equal(a[0].row, a[1].row)  # a sequence per trial


def test_under_bos_every_instance_starts_with_it_and_keeps_its_length():
    cfg = posbench.compose(["dataset.bos=true"])
    data = prepare(cfg.dataset)
    r = config(trials=1)
    task = Task("niah_single_2", r, Vocabulary(data, cfg.dataset))
    (inst,) = instances(task, r, 128, 0.5)
    assert inst.row[0] == inst.removed[0] == data.bos and len(inst.row) == 129
    ctx, asked, _, needles, given = parse(inst.row[1:])
    assert [k for _, _, k, _ in needles] == asked and len(ctx) == 128 - 50 + 17


# ---- GPT-2 BPE: keys and values are the tokenizer's own tokens ---------------------------------

MERGES = [("1", "2"), ("3", "4"), ("7", "7"), ("a", "b"), ("c", "d"), ("e", "f"), ("ab", "cd"),
          ("Q", "X"), ("t", "h"), ("th", "e"), ("Ġ", "the"), ("k", "e"), ("ke", "y")]


@pytest.fixture(scope="module")
def bpe_vocab(tmp_path_factory):
    """A corpus tokenized by a small GPT-2 BPE of the merges above, and its id -> bytes."""
    root = tmp_path_factory.mktemp("bpe")
    chars = _byte_chars()
    tokens = chars + [a + b for a, b in MERGES]
    (root / "bpe").mkdir()
    (root / "bpe" / "vocab.json").write_text(json.dumps({t: i for i, t in enumerate(tokens)}))
    (root / "bpe" / "merges.txt").write_text(
        "#version: 0.2\n" + "".join(f"{a} {b}\n" for a, b in MERGES))
    rng = np.random.default_rng(0)
    words = ["the", "12", "34", "77", "abcd", "ef", "QX", "key", "A", "B", "5", "9", "x", "is"]
    (root / "corpus").mkdir()
    for i in range(12):
        (root / "corpus" / f"doc{i}.txt").write_text(" ".join(rng.choice(words, size=1500)))
    cfg = posbench.compose(["dataset=text", f"dataset.path={root / 'corpus'}",
                            "dataset.tokenizer=gpt2", f"dataset.tokenizer_path={root / 'bpe'}",
                            "dataset.val_fraction=0.5"])
    byte_of = {c: b for b, c in enumerate(chars)}
    spelled = {i: bytes(byte_of[c] for c in t) for i, t in enumerate(tokens)}
    return Vocabulary(prepare(cfg.dataset), cfg.dataset), spelled


@pytest.mark.parametrize("name", ["niah_single_2", "niah_multikey_3", "vt"])
def test_bpe_keys_and_values_are_tokens_of_the_tokenizer_spelled_as_their_kind(bpe_vocab, name):
    vocab, spelled = bpe_vocab
    assert {spelled[int(i)] for i in vocab.alphabets["numbers"]} >= {b"12", b"34", b"77"}
    assert {spelled[int(i)] for i in vocab.alphabets["uuids"]} >= {b"abcd", b"ef", b"12"}
    assert spelled[int(vocab.alphabets["names"][-1])] == b"QX"
    cfg = config(trials=4)
    drawn = []
    for inst in instances(Task(name, cfg, vocab), cfg, 160, 0.5):
        assert len(inst.row) == 161  # tokens, not bytes
        text = b"".join(spelled[int(i)] for i in inst.row)
        answer = inst.row[-len(inst.scored):]
        drawn += [spelled[int(i)] for i in answer[inst.scored]]
        if name == "vt":
            names = text.rpartition(b"? ")[2].split(b", ")
            assert len(names) == 5 and all(re.fullmatch(rb"[A-Z]+", n) for n in names)
            assert b"var %s = " % names[1] + names[0] + b". " in text
            continue
        key = text.rpartition(b"\nwhat is key ")[2].partition(b"? ")[0]
        value = text.rpartition(b" is ")[2]
        assert text.count(b"key %s is %s. " % (key, value)) == 1
        form = rb"[0-9a-f]+-[0-9a-f]+" if name == "niah_multikey_3" else rb"[0-9]+"
        assert re.fullmatch(form, value) and re.fullmatch(
            form if name == "niah_multikey_3" else rb"[a-z]+", key)
    assert any(len(b) > 1 for b in drawn)  # a merged token, drawn as one


@pytest.mark.parametrize("name, ask", [("cwe", b"\nmost common words? "),
                                       ("fwe", b"\nmost frequent words? ")])
def test_bpe_lists_are_words_of_the_tokenizers_lowercase_tokens(bpe_vocab, name, ask):
    vocab, spelled = bpe_vocab
    cfg = config(trials=3)
    for inst in instances(build_task(name, cfg, vocab), cfg, 160, 0.5):
        assert len(inst.row) == 161  # tokens, not bytes
        pieces = [spelled[int(i)] for i in inst.row]
        query = next(i for i in range(len(pieces)) if b"".join(pieces[i:]).startswith(ask))
        items = []  # the list's items as token tuples, between single-space tokens
        for i in inst.row[:query]:
            if spelled[int(i)] == b" ":
                items.append(())
            else:
                items[-1] += (int(i),)
        items = [item for item in items if item]
        count = collections.Counter(items)
        noise = tuple(vocab.encode("..."))
        dots = count.pop(noise, 0)
        assert all(len(item) == 3 for item in count)
        if name == "cwe":  # 2 words 6 times, the others once
            assert dots == 0 and sorted(count.values())[-3:] == [1, 6, 6]
        else:  # the noise is the most frequent
            assert dots > max(count.values())
        words = [item for item in items if item != noise]
        assert all(re.fullmatch(rb"[a-z]+", spelled[t]) for item in words for t in item)
        top = sorted(count, key=count.get, reverse=True)[:2 if name == "cwe" else 3]
        assert min(count[w] for w in top) > max([count[w] for w in count if w not in top] + [0])
        answer = inst.row[-len(inst.scored):][inst.scored].tolist()
        assert answer == [t for w in dict.fromkeys(words) if w in top for t in w]
    assert any(len(spelled[t]) > 1 for t in answer)  # a merged token, drawn as one


# ---- refusals --------------------------------------------------------------------------------


@pytest.mark.parametrize("overrides, refusal", [
    (["eval.ruler.lengths=[64,128]"], "eval.ruler.tasks=niah_multikey_1 at length 64 is not "
     "accepted: its needles, query and answer take 101 tokens, more than the window's 65; "
     "expected eval.ruler.lengths of at least 100 for niah_multikey_1"),
    # needles "key abc is 1. " of 14 bytes; 1025 - 44 haystack bytes and the asked needle's
    # 14, which its sequence without it fills: 1 + ceil(995 / 14) = 73 numbers
    (["eval.ruler.lengths=[1024]", "eval.ruler.tasks=[niah_multikey_2]",
      "eval.ruler.number_tokens=1"], "eval.ruler.number_tokens=1 is not accepted: "
     "niah_multikey_2 at length 1024 draws 73 distinct numbers, and 1 token(s) of the 10 "
     "numbers tokens of the run's vocabulary make 10; expected a larger "
     "eval.ruler.number_tokens or shorter lengths"),
    (["eval.ruler.tasks=[niah_singel_1]"], "eval.ruler.tasks='niah_singel_1' is not accepted; "
     "expected one of niah_single_1"),
    (["eval.ruler.tasks=[vt,vt]"], "expected each task once"),
    (["eval.ruler.depths=[0,1.5]"], "eval.ruler.depths=1.5 is not accepted; expected depths "
     "in [0, 1]"),
    (["eval.ruler.hops=0"], "eval.ruler.hops=0 is not accepted; expected a positive integer"),
])
def test_what_cannot_be_drawn_is_refused_in_one_line_before_any_work(
        tmp_path, monkeypatch, capsys, overrides, refusal, stdlib_data):  # tokenized: no progress
    assert_refused_before_any_work(tmp_path, monkeypatch, capsys, overrides, refusal)


def assert_refused_before_any_work(tmp_path, monkeypatch, capsys, overrides, refusal):
    """A toy run with RULER and `overrides` exits 2 with one line holding `refusal`, nothing
    trained or written."""
    monkeypatch.chdir(tmp_path)
    proc = run_in_process(["train", *TOY, "eval.ruler.enabled=true", *overrides,
                           "hydra.run.dir=run"], monkeypatch, capsys)
    assert proc.returncode == 2
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and refusal in lines[0], proc.stderr
    assert not (tmp_path / "run" / "checkpoint.pt").exists()
    assert not (tmp_path / "run" / "results.json").exists()


# ---- scores ----------------------------------------------------------------------------------

def answer_positions(row: np.ndarray, vt: bool) -> np.ndarray:
    """Where in the row the scored answer tokens are, read from its bytes."""
    text = bytes(row.astype(np.uint8))
    start = text.rindex(b"? ") + 2
    answer = text[start:]
    mask = np.array([c not in b", " for c in answer]) if vt else scored_bytes(answer)
    return start + np.flatnonzero(mask)


def answer_items(row: np.ndarray, vt: bool) -> list:
    """The scored positions of each item of the answer (a value, a name), read from its bytes:
    the parts between ", ", less "key K is " and a uuid's hyphens."""
    text = bytes(row.astype(np.uint8))
    start = text.rindex(b"? ") + 2
    out, at = [], start
    for part in text[start:].split(b", "):
        mask = np.array([True] * len(part)) if vt else scored_bytes(part)
        out.append(at + np.flatnonzero(mask))
        at += len(part) + 2
    return out


def oracle_bits(model, row: np.ndarray, positions: np.ndarray):
    """Mean loss in bits of the tokens at `positions` from the model's float64 per-token losses
    over the whole row, and whether each is the argmax."""
    x = torch.from_numpy(row.astype(np.int64))
    with torch.no_grad():
        logits = model(x[None, :-1])[0]
    losses = F.cross_entropy(logits, x[1:], reduction="none") / math.log(2)
    at = torch.from_numpy(positions - 1)  # the input position that predicts each
    return losses[at].mean().item(), bool((logits[at].argmax(-1) == x[1:][at]).all())


def test_bits_saved_and_exact_match_are_the_per_token_losses_computed_here(stdlib_data):
    cfg = posbench.compose(["model.n_layer=2", "model.d_model=32", "model.n_head=2",
                            "eval.ruler.enabled=true", "eval.ruler.lengths=[128,160]",
                            "eval.ruler.depths=[0,1]", "eval.ruler.trials=3",
                            "eval.ruler.tasks=[niah_multivalue,vt,niah_single_3]",
                            "eval.batch_tokens=300"])
    torch.manual_seed(0)
    model = posbench.build_model(cfg, stdlib_data.vocab_size).eval()
    section = Ruler(Ruler.config(cfg), cfg, stdlib_data)
    result = section.run(model, torch.device("cpu"))
    exact = copy.deepcopy(model).double()
    assert list(result["tasks"]) == ["niah_multivalue", "vt", "niah_single_3"]
    for name, task in result["tasks"].items():
        assert [(c["length"], c["depth"]) for c in task["grid"]] == [
            (n, d) for n in (128, 160) for d in (0.0, 1.0)]
        for cell in task["grid"]:
            made = instances(section.tasks[name], section.cfg, cell["length"], cell["depth"])
            with_needles, without, hits, found = [], [], [], []
            for inst in made:
                at = answer_positions(inst.row, name == "vt")
                assert np.array_equal(at, answer_positions(inst.removed, name == "vt"))
                loss, hit = oracle_bits(exact, inst.row, at)
                with_needles.append(loss), hits.append(hit)
                without.append(oracle_bits(exact, inst.removed, at)[0])
                items = answer_items(inst.row, name == "vt")
                assert np.array_equal(np.concatenate(items), at)
                found.append(np.mean([oracle_bits(exact, inst.row, i)[1] for i in items]))
            assert cell["loss"] == pytest.approx(np.mean(with_needles), abs=1e-4)
            assert cell["loss_removed"] == pytest.approx(np.mean(without), abs=1e-4)
            assert cell["bits_saved"] == pytest.approx(np.mean(without) - np.mean(with_needles),
                                                       abs=1e-4)
            assert cell["exact_match"] == np.mean(hits)
            assert cell["recall"] == pytest.approx(np.mean(found), abs=1e-12)
        assert task["answer_tokens"] == {"niah_multivalue": 16, "vt": 15,
                                         "niah_single_3": 8}[name]
        for point in task["by_length"]:
            cells = [c for c in task["grid"] if c["length"] == point["length"]]
            assert point["bits_saved"] == pytest.approx(np.mean([c["bits_saved"] for c in cells]))
    for point in result["by_length"]:  # RULER's average over tasks
        for key in ("exact_match", "recall"):
            assert point[key] == pytest.approx(np.mean(
                [p[key] for t in result["tasks"].values() for p in t["by_length"]
                 if p["length"] == point["length"]]))
    metrics = Ruler.length_metrics(result)
    assert metrics[160]["eval/ruler_vt_bits_saved"] == result["tasks"]["vt"]["by_length"][1][
        "bits_saved"]
    assert metrics[128]["eval/ruler_bits_saved"] == result["by_length"][0]["bits_saved"]
    assert metrics[128]["eval/ruler_niah_multivalue_recall"] == result["tasks"][
        "niah_multivalue"]["by_length"][0]["recall"]


@pytest.mark.parametrize("name", ["niah_single_1", "niah_single_3", "niah_multikey_1",
                                  "niah_multikey_2", "niah_multikey_3", "niah_multiquery",
                                  "niah_control"])
def test_a_copier_retrieves_the_tasks_one_copy_solves_a_blind_model_saves_nothing(vocab, name):
    cfg = config(trials=2)
    made = instances(Task(name, cfg, vocab), cfg, 128, 0.5)
    rows = torch.from_numpy(np.stack([m.row for m in made] + [m.removed for m in made]))
    scored, item = torch.from_numpy(made[0].scored), torch.from_numpy(made[0].item)
    loss, hits, found = answer_scores(Copier(last=48), rows, scored, item)
    assert hits[:2].all() and not hits[2:].any() and torch.equal(found, hits.double())
    assert (loss[:2] < 0.1).all() and (loss[2:] - loss[:2] > 5).all()
    loss, hits, found = answer_scores(Blind(), rows, scored, item)
    assert not hits.any() and not found.any() and torch.equal(loss[:2], loss[2:])


def test_report_lines_table_each_task_by_group():
    def record(bits):
        point = {"length": 128, "exact_match": 0.5, "bits_saved": bits}
        task = {"ruler": "r", "by_length": [point], "grid": []}
        return {"eval": {"ruler": {"tasks": {"vt": task, "niah_single_1": task},
                                   "by_length": [point]}}}
    runs = [record(1.0), record(2.0), record(4.0), {"eval": {"ruler": None}}]
    lines = Ruler.report_lines(runs, {0: "rope", 1: "rope", 2: "alibi", 3: "nope"})
    text = "\n".join(lines)
    for name in ("average", "vt", "niah_single_1"):
        assert f"\n{name} (" in text
    assert lines.count("| rope | 1.50 (0.50) |") == 3  # the mean over the group's seeds
    assert lines.count("| alibi | 4.00 (0.50) |") == 3 and "nope" not in text


def test_the_report_tables_each_groups_effective_lengths_by_task_and_seed():
    def record(average, vt, single=None):
        tasks = {"vt": {"ruler": "r", "by_length": [], "grid": [],
                        "effective_length": vt[0], "relative_effective_length": vt[1]}}
        if single:
            tasks["niah_single_1"] = {"ruler": "r", "by_length": [], "grid": [],
                                      "effective_length": single[0],
                                      "relative_effective_length": single[1]}
        return {"eval": {"ruler": {"tasks": tasks, "by_length": [], "effective_length": average[0],
                                   "relative_effective_length": average[1]}}}
    runs = [record((256, 512), (None, 128), (512, 512)), record((256, 256), (None, 256), (512, 512)),
            record((None, None), (None, None))]
    lines = Ruler.report_lines(runs, {0: "rope", 1: "rope", 2: "nope"})
    at = lines.index("| encoding | average | vt | niah_single_1 |")
    assert lines[at + 1] == "|---|---:|---:|---:|"
    # seeds that agree give one value, seeds that differ each its own in seed order
    assert lines[at + 2] == "| rope | 256 / 512, 256 | none / 128, 256 | 512 / 512 |"
    # a task a group was not scored on is a dash; a length that never qualified is none
    assert lines[at + 3] == "| nope | none / none | none / none | — / — |"
    assert "RULER's effective length" in lines[at - 2]


def test_the_wandb_summary_names_every_tasks_effective_lengths():
    from posbench.runs.results import summary_metrics

    point = {"length": 128, "ppl": 3.0, "loss": math.log(3.0)}
    tasks = {name: {"effective_length": e, "relative_effective_length": r}
             for name, e, r in (("vt", 256, 512), ("cwe", None, 128))}
    record = {"eval": {"train_len_ppl": 3.0, "curve": [point], "retrieval": None,
                       "effective_length": {"ppl": 128, "ruler": 256, "ruler_relative": 512},
                       "ruler": {"tasks": tasks}}}
    assert summary_metrics(record) == {
        "train_len_ppl": 3.0, "effective_length/ppl": 128, "effective_length/ruler": 256,
        "effective_length/ruler_relative": 512, "effective_length/ruler_vt": 256,
        "effective_length/ruler_vt_relative": 512, "effective_length/ruler_cwe": None,
        "effective_length/ruler_cwe_relative": 128}


# ---- the command line --------------------------------------------------------------------------

RULER = ["eval.ruler.enabled=true", "eval.ruler.lengths=[128]", "eval.ruler.depths=[0,1]",
         "eval.ruler.trials=1"]


def test_train_scores_every_task_and_a_rescore_gives_the_same_cells(tmp_path):
    proc = posbench_cli("train", *TOY, *RULER, "logger=wandb", "hydra.run.dir=run", cwd=tmp_path)
    r = results(tmp_path / "run")["eval"]["ruler"]
    assert list(r["tasks"]) == DEFAULT_TASKS and r["format"] == 2
    assert r["units"] == "bits per answer token" and r["counts"]["queries"] == 2
    for task in r["tasks"].values():
        assert [(c["length"], c["depth"]) for c in task["grid"]] == [(128, 0.0), (128, 1.0)]
        for cell in task["grid"]:
            assert cell["bits_saved"] == pytest.approx(cell["loss_removed"] - cell["loss"])
    assert (tmp_path / "run" / "ruler_heatmap.png").stat().st_size > 0
    assert "niah_multikey_3 (one needle in a haystack of UUID -> UUID needles):" in proc.stdout
    vt = r["tasks"]["vt"]["by_length"][0]
    assert (f"| rope | {vt['bits_saved']:.2f} ({vt['exact_match']:.2f}, {vt['recall']:.2f}) |"
            in proc.stdout)
    # effective lengths per task and over the tasks' mean: one length here, so 128 or none
    record = results(tmp_path / "run")
    for scores in [r, *r["tasks"].values()]:
        (point,) = scores["by_length"]
        assert scores["effective_length"] == (128 if point["bits_saved"] >= 1.0 else None)
        assert scores["relative_effective_length"] == (128 if point["bits_saved"] > 0 else None)
    assert record["eval"]["effective_length"]["ruler"] == r["effective_length"]
    assert record["eval"]["effective_length"]["ruler_relative"] == r["relative_effective_length"]
    assert_wandb_summary_has_the_effective_lengths(wandb_summary(tmp_path / "run"), r)

    # a re-score with one depth more: the same sequences, so the same scores at the others
    posbench_cli("eval", "run", "eval.ruler.enabled=true", "eval.ruler.depths=[0,0.5,1]",
                 cwd=tmp_path)
    (path,) = (tmp_path / "run").glob("results.eval-*.json")
    again = json.loads(path.read_text())["eval"]["ruler"]
    for name, task in r["tasks"].items():
        cells = {c["depth"]: c for c in again["tasks"][name]["grid"]}
        assert sorted(cells) == [0.0, 0.5, 1.0]
        for cell in task["grid"]:
            assert cells[cell["depth"]] == pytest.approx(cell)
    assert list((tmp_path / "run").glob("ruler_heatmap.eval-*.png"))
    # the re-score is a wandb run of its own (the saved config's logger), with its own lengths
    (rescore,) = [f for f in (tmp_path / "run").glob("wandb/offline-run-*/run-*.wandb")
                  if (tmp_path / "run" / "wandb_run_id").read_text() not in f.name]
    assert_wandb_summary_has_the_effective_lengths(wandb_file_summary(rescore), again)


def assert_wandb_summary_has_the_effective_lengths(summary, ruler):
    assert summary["effective_length/ruler"] == ruler["effective_length"]
    assert summary["effective_length/ruler_relative"] == ruler["relative_effective_length"]
    for name, task in ruler["tasks"].items():
        assert summary[f"effective_length/ruler_{name}"] == task["effective_length"]
        assert summary[f"effective_length/ruler_{name}_relative"] == \
            task["relative_effective_length"]


@pytest.mark.parametrize("name", ["niah_single_2", "niah_single_1", "niah_multikey_2"])
def test_the_shortest_windows_that_fit_hold_a_haystack_of_zero_or_one_token(vocab, name):
    task = Task(name, config(), vocab)
    for length in (task.fixed() - 1, task.fixed()):  # haystacks of 0 and 1 tokens
        (inst,) = instances(task, config(trials=1), length, 1.0)
        assert len(inst.row) == len(inst.removed) == length + 1
        ctx, asked, _, needles, _ = parse(inst.row)
        assert [k for _, _, k, _ in needles][-1:] == asked  # the asked needle before the query
