"""Synthetic tasks: what each instance means, seeding, and exact-match accuracy in evaluate()."""
import hashlib

import numpy as np
import pytest
import torch
from omegaconf import OmegaConf

import posbench
from posbench.core.errors import ConfigError
from posbench.data import prepare, registry, vocab_size
from posbench.data.tasks import BOS, FIRST, PAD, PLUS, SEP, Task
from posbench.data.windows import IGNORE
from posbench.evaluations.perplexity import evaluate
from helpers import posbench_cli, results, window_starts


TASKS = [name for name, entry in registry().items() if issubclass(entry.cls, Task)]


def task_data(name):
    return prepare(OmegaConf.create({"name": name}))


def instance(tokens, answers):
    """The instance at the start of a row padded after it, and the positions of its answers."""
    end = int(np.flatnonzero(tokens != PAD)[-1]) + 1
    assert not (tokens[:end] == PAD).any() and not answers[end:].any()
    return tokens[:end], np.flatnonzero(answers[:end])


def test_every_task_is_registered_and_keeps_its_fingerprint():
    """The data's name in results.json, which a resume and a re-score compare: the task's name,
    its generator and its parameters, and the generators' version (2: padded after the
    instance)."""
    assert TASKS == ["task_addition", "task_addition_msb", "task_binary_addition",
                     "task_binary_multiplication", "task_bucket_sort", "task_compute_sqrt",
                     "task_copy", "task_copy_2x",
                     "task_copy_repeat", "task_copy_repeat_2x", "task_copy_replace",
                     "task_counting_1", "task_counting_3", "task_counting_5",
                     "task_cycle_navigation", "task_duplicate_string", "task_even_pairs",
                     "task_flip_flop", "task_induction", "task_lego", "task_lego_perm",
                     "task_missing_duplicate_string", "task_modular_arithmetic",
                     "task_modular_arithmetic_brackets", "task_odds_first", "task_parity",
                     "task_parity_check", "task_poly",
                     "task_recall", "task_reverse", "task_reverse_2x", "task_reverse_copy",
                     "task_reverse_string", "task_selective_copy", "task_solve_equation",
                     "task_sort_multi", "task_sort_single", "task_stack_manipulation",
                     "task_sum_mod"]
    spec = {"task_addition": "Addition(symbols=10)", "task_copy": "Copy(symbols=16)",
            "task_induction": "Induction(symbols=16)", "task_recall": "Recall(symbols=16, keys=1024)",
            "task_reverse": "Reverse(symbols=16)",
            # Kazemnejad et al.'s tasks (posbench/data/algorithmic.py)
            "task_addition_msb": "AdditionMSB(symbols=10)", "task_copy_2x": "Copy2x(symbols=101)",
            "task_copy_repeat": "CopyRepeat(symbols=100)",
            "task_copy_repeat_2x": "CopyRepeat2x(symbols=100)",
            "task_copy_replace": "CopyReplace(symbols=100)", "task_lego": "Lego(symbols=29)",
            "task_lego_perm": "LegoPerm(symbols=29)", "task_parity": "Parity(symbols=7)",
            "task_poly": "Poly(symbols=13, coefficients=(-3, 3), degrees=(0, 3), points=(-2, 2), "
                         "modulus=10)",
            "task_reverse_2x": "Reverse2x(symbols=101)",
            "task_reverse_copy": "ReverseCopy(symbols=101)",
            "task_sort_multi": "SortMulti(symbols=13, low=10, high=9999)",
            "task_sort_single": "SortSingle(symbols=53)",
            "task_sum_mod": "SumMod(symbols=10, low=1, high=9, modulus=10)",
            # Deletang et al.'s tasks (posbench/data/chomsky.py)
            "task_binary_addition": "BinaryAddition(symbols=3)",
            "task_binary_multiplication": "BinaryMultiplication(symbols=4)",
            "task_bucket_sort": "BucketSort(symbols=5)",
            "task_compute_sqrt": "ComputeSqrt(symbols=2)",
            "task_cycle_navigation": "CycleNavigation(symbols=8)",
            "task_duplicate_string": "DuplicateString(symbols=2)",
            "task_even_pairs": "EvenPairs(symbols=2)",
            "task_missing_duplicate_string": "MissingDuplicateString(symbols=4)",
            "task_modular_arithmetic": "ModularArithmetic(symbols=7, modulus=5)",
            "task_modular_arithmetic_brackets": "ModularArithmeticBrackets(symbols=9, modulus=5)",
            "task_odds_first": "OddsFirst(symbols=2)",
            "task_parity_check": "ParityCheck(symbols=2)",
            "task_reverse_string": "ReverseString(symbols=2)",
            "task_solve_equation": "SolveEquation(symbols=10, modulus=5)",
            "task_stack_manipulation": "StackManipulation(symbols=6)",
            # Golovneva et al.'s counting (posbench/data/counting.py)
            "task_counting_1": "Counting1(symbols=17, nvars=1, weights=(1, 50, 7), max_value=10)",
            "task_counting_3": "Counting3(symbols=19, nvars=3, weights=(1, 50, 7), max_value=10)",
            "task_counting_5": "Counting5(symbols=21, nvars=5, weights=(1, 50, 7), max_value=10)",
            # Liu et al.'s flip-flop and Gu and Dao's selective copying
            "task_flip_flop": "FlipFlop(symbols=5, ignore=0.8)",
            "task_selective_copy": "SelectiveCopy(symbols=15, memorize=16)"}
    for name in TASKS:
        digest = hashlib.sha256(f"{name},{spec[name]},version=2".encode()).hexdigest()
        assert task_data(name).fingerprint == f"sha256:{digest}"


@pytest.mark.parametrize("name", TASKS)
def test_eval_instances_fill_the_length_and_are_the_same_for_every_run(name):
    data = task_data(name)
    tokens, answers = data.eval_instances(64, 640)
    assert tokens.shape == answers.shape == (10, 65)
    assert np.array_equal(tokens, data.eval_instances(64, 640)[0])
    assert tokens.max() < data.vocab_size == vocab_size(posbench.compose([f"dataset={name}"]).dataset)
    for row, answer in zip(tokens, answers):
        seq, _ = instance(row, answer)
        assert len(seq) >= 65 - 3 and seq[0] == BOS and answer.any()


def test_each_task_answers_what_it_says():
    rows = lambda name: zip(*task_data(name).eval_instances(96, 960))
    for tokens, answers in rows("task_copy"):
        seq, ans = instance(tokens, answers)
        k = len(ans)
        assert np.array_equal(seq[1:1 + k], seq[ans]) and seq[k + 1] == SEP
    for tokens, answers in rows("task_reverse"):
        seq, ans = instance(tokens, answers)
        assert np.array_equal(seq[1:1 + len(ans)][::-1], seq[ans])
    for tokens, answers in rows("task_recall"):
        seq, ans = instance(tokens, answers)
        sep = int(np.flatnonzero(seq == SEP)[0])
        bound = dict(zip(seq[1:sep:2], seq[2:sep:2]))
        assert len(bound) == (sep - 1) // 2  # distinct keys
        assert all(bound[seq[a - 1]] == seq[a] for a in ans) and len(ans) == len(bound)
    lags = set()
    for tokens, answers in rows("task_induction"):
        seq, ans = instance(tokens, answers)
        lag = ans[0] - 1
        lags.add(lag)
        assert all(seq[a] == seq[a - lag] for a in ans)
    assert len(lags) > 3  # N varies per example
    for tokens, answers in rows("task_addition"):
        seq, ans = instance(tokens, answers)
        plus, sep = int(np.flatnonzero(seq == PLUS)[0]), int(np.flatnonzero(seq == SEP)[0])
        number = lambda digits: int("".join(str(d - FIRST) for d in digits[::-1]))
        assert number(seq[1:plus]) + number(seq[plus + 1:sep]) == number(seq[ans])


def test_train_batches_are_seeded_and_draw_every_size_up_to_the_length():
    data = task_data("task_copy")
    x, y = data.train_batch(32, 64, seed=1, step=5)
    assert x.shape == y.shape == (64, 32) and x.dtype == torch.int64
    assert x.equal(data.train_batch(32, 64, seed=1, step=5)[0])
    assert not x.equal(data.train_batch(32, 64, seed=1, step=6)[0])
    trained = y[:, :-1] != IGNORE  # only answer tokens are training targets
    assert 0 < trained.float().mean() < 1
    assert x[:, 1:][trained].equal(y[:, :-1][trained])
    pads = (x == PAD).sum(1)
    assert pads.min() <= 1 and pads.max() > 20  # short and full-size instances
    assert (x[:, 0] == BOS).all()  # every instance starts at position 0, its padding after it


def rows_of(x):
    return sorted(row.numpy().tobytes() for row in x)


def test_a_fixed_training_set_is_read_whole_every_epoch_in_a_new_order():
    """dataset.train_instances=N: the references' finite training set. Each epoch (N / batch
    steps) reads the same N instances, in a new order; the fresh default draws others."""
    node = OmegaConf.create({"name": "task_counting_3", "train_instances": 48})
    data = prepare(node)
    epochs = [[data.train_batch(64, 16, seed=3, step=step)[0] for step in range(first, first + 3)]
              for first in (0, 3, 6)]
    assert rows_of(torch.cat(epochs[0])) == rows_of(torch.cat(epochs[1])) == \
        rows_of(torch.cat(epochs[2]))
    assert not torch.cat(epochs[0]).equal(torch.cat(epochs[1]))  # another order
    # 40 instances in batches of 16: step 2 ends epoch 0 with its first 8 rows and starts
    # epoch 1 with the other 8; epochs 0 and 1 (steps 0..4) each read the 40 once
    across = prepare(OmegaConf.create({"name": "task_counting_3", "train_instances": 40}))
    rows = torch.cat([across.train_batch(64, 16, seed=3, step=s)[0] for s in range(5)])
    assert rows_of(rows[:40]) == rows_of(rows[40:])
    x, y = data.train_batch(64, 16, seed=3, step=4)  # a function of (seed, step): resumable
    assert x.equal(prepare(node).train_batch(64, 16, seed=3, step=4)[0])
    assert (y[:, :-1] != IGNORE).any() and (x[:, 0] == BOS).all()
    assert not set(rows_of(data.train_batch(64, 16, seed=4, step=0)[0])) <= \
        set(rows_of(torch.cat(epochs[0])))  # another seed, another set
    fresh = task_data("task_counting_3")
    seen = rows_of(torch.cat([fresh.train_batch(64, 16, seed=3, step=s)[0] for s in range(9)]))
    assert len(set(seen)) > 48


def test_a_negative_training_set_is_refused_in_one_line():
    with pytest.raises(ConfigError, match=r"dataset.train_instances=-1.*>= 0"):
        posbench.compose(["dataset=task_copy", "dataset.train_instances=-1"])


def test_task_lengths_out_of_reach_are_refused_with_the_key():
    with pytest.raises(ConfigError, match="eval.lengths entry 5000"):
        window_starts(task_data("task_recall"), 5000, 5000)
    with pytest.raises(ConfigError, match="train.seq_len=2"):
        task_data("task_addition").check_train_len(2)
    with pytest.raises(ConfigError, match="eval.protocol"):
        posbench.compose(["dataset=task_copy", "eval.protocol=sliding", "eval.stride=8"])


class Oracle(torch.nn.Module):
    """Predicts each target of the instances it was given (or 0 where `wrong`)."""

    def __init__(self, data, length, count, wrong=()):
        super().__init__()
        tokens, _ = data.eval_instances(length, length * count)
        rows = tokens.astype(np.int64)
        self.targets = {row[:-1].tobytes(): (i, row[1:]) for i, row in enumerate(rows)}
        self.wrong, self.vocab = set(wrong), data.vocab_size
        self.encoding = type("NoEncoding", (), {"set_eval_options": lambda *a: None})()
        self.blocks = torch.nn.ModuleList()  # no attention layer to set eval options on

    def forward(self, x):
        logits = torch.zeros(*x.shape, self.vocab)
        for i, row in enumerate(x.numpy()):
            index, target = self.targets[row.tobytes()]
            logits[i, torch.arange(x.shape[1]), torch.as_tensor(target)] = 30.0
            if index in self.wrong:
                logits[i, :, 0] = 60.0
        return logits


def test_accuracy_is_exact_match_over_answer_tokens_only():
    data = task_data("task_copy")
    eval_cfg = OmegaConf.create({"lengths": [40], "tokens": 400, "batch_tokens": 120,
                                 "protocol": "nonoverlapping"})
    perfect = evaluate(Oracle(data, 40, 10), data, eval_cfg, torch.device("cpu"))[0]
    assert perfect["accuracy"] == perfect["token_accuracy"] == 1.0 and perfect["loss"] < 1e-6
    tokens, answers = data.eval_instances(40, 400)
    assert perfect["tokens"] == answers[:, 1:].sum()  # answers only: the inputs are noise
    half = evaluate(Oracle(data, 40, 10, wrong=range(5)), data, eval_cfg, torch.device("cpu"))[0]
    assert half["accuracy"] == 0.5 and half["token_accuracy"] == 0.5
    bins = half["per_position"]
    assert sum(bins["tokens"]) == half["tokens"] and bins["start"][0] >= 20


def test_train_on_a_task_writes_accuracy_curves(tmp_path, toy):
    proc = posbench_cli("train", *toy, "dataset=task_copy", "eval.lengths=[32,64]",
                        "hydra.run.dir=run", cwd=tmp_path, in_process=True)
    run = tmp_path / "run"
    record = results(run)
    assert record["dataset"]["name"] == "task_copy"
    assert all(0 <= p["accuracy"] <= 1 for p in record["eval"]["curve"])
    assert "accuracy" in (run / "curve.csv").read_text().splitlines()[0]
    assert (run / "accuracy_vs_length.png").stat().st_size > 0
    assert "exact" in proc.stdout
    assert prepare(posbench.compose(["dataset=task_copy"]).dataset).fingerprint == \
        record["dataset"]["fingerprint"]


@pytest.mark.parametrize("name", TASKS)
def test_task_window_is_the_shortest_length_whose_windows_hold_an_instance_of_a_size(name):
    """`${posbench.task_window:S}` in a config: the length n (windows of n + 1 tokens) that the
    task's instances of size S fill, the shortest that holds one."""
    task = task_data(name).task
    a, b = max(2, task.min_size), max(3, task.min_size + 1)  # sizes it makes (counting: 6 up)
    cfg = OmegaConf.create({"dataset": {"name": name}, "one": f"${{posbench.task_window:{b}}}",
                            "many": f"${{posbench.task_window:[{a},{b}]}}"})
    for size, n in ((b, cfg.one), *zip((a, b), cfg.many)):
        assert task.size(n + 1) >= size > task.size(n)
        seq, _ = task.make(np.random.default_rng(0), size)
        assert len(seq) <= n + 1


def test_task_window_refuses_a_dataset_that_is_not_a_task():
    cfg = OmegaConf.create({"dataset": {"name": "pystdlib"}, "n": "${posbench.task_window:20}"})
    with pytest.raises(Exception, match="posbench.task_window is not accepted for "
                                        "dataset=pystdlib; expected a task dataset"):
        cfg.n
