"""train.ruler_mix (posbench/evaluations/ruler.py, training_mix): the planted rows are the instances
eval.ruler's builders make for their seeds, the share planted, the other rows untouched, no
evaluation sequence trained on, the batches a function of (seed, step) alone, the mix beside
train.retrieval_mix, the whole path through the command, and refusals in one line."""
import json

import numpy as np
import pytest
import torch

import posbench
from posbench.evaluations import ruler
from posbench.evaluations.retrieval import Passkeys, mixer
from posbench.evaluations.ruler import RulerConfig
from posbench.evaluations.ruler_tasks import DEFAULT_TASKS, Task, Vocabulary, instances
from helpers import run_in_process

L = 128  # every task fits at byte level (eval.ruler's default counts)


def mix(data, share, tasks=None):
    overrides = [f"train.ruler_mix={share}", f"train.seq_len={L}"]
    if tasks is not None:
        overrides.append(f"train.ruler_tasks=[{','.join(tasks)}]")
    return ruler.training_mix(posbench.compose(overrides), data)


@pytest.fixture(scope="module")
def tasks(stdlib_data):
    """The oracle's tasks, built apart from the mix's: train.ruler_tasks' default presets at
    eval.ruler's defaults."""
    vocab = Vocabulary(stdlib_data, posbench.compose([]).dataset)
    return [Task(name, RulerConfig(), vocab) for name in DEFAULT_TASKS]


def oracle(tasks, seed, step, batch, share):
    """Per planted row, the instance eval.ruler's builder makes for its seed: the batch's rows
    and their count from (seed, step, MIX_STREAM), each row's task, depth and instance from
    (seed, step, MIX_STREAM, row + 1), its text haystack from training documents."""
    rng = np.random.default_rng([seed, step, ruler.MIX_STREAM])
    count = int(share * batch) + int(rng.random() < share * batch - int(share * batch))
    out = {}
    for row in rng.choice(batch, size=count, replace=False):
        own = np.random.default_rng([seed, step, ruler.MIX_STREAM, int(row) + 1])
        task = tasks[int(own.integers(len(tasks)))]
        out[int(row)] = task.make(own, L, float(own.random()), split="train").row
    return out


def test_planted_rows_are_eval_rulers_instances_for_their_seeds_and_the_rest_unchanged(
        stdlib_data, tasks):
    plant = mix(stdlib_data, 0.35)
    seen = []
    for seed, step in [(0, s) for s in range(12)] + [(3, 5)]:
        x, y = stdlib_data.train_batch(L, 10, seed, step, plant)
        plain, plain_y = stdlib_data.train_batch(L, 10, seed, step)  # train.ruler_mix=0
        expected = oracle(tasks, seed, step, 10, 0.35)
        assert len(expected) in (3, 4)
        changed = {i for i in range(10) if not torch.equal(x[i], plain[i])}
        assert changed == set(expected)
        for i in range(10):
            if i in expected:  # the whole instance, the answer at its end: every token trained
                row = torch.from_numpy(expected[i])
                assert torch.equal(x[i], row[:-1]) and torch.equal(y[i], row[1:])
            else:  # bit for bit the batch without the mix
                assert torch.equal(x[i], plain[i]) and torch.equal(y[i], plain_y[i])
        seen += [bytes(np.asarray(x[i], dtype=np.uint8)) for i in expected]
    assert len(set(seen)) == len(seen)  # each row its own draw


def test_the_share_planted_is_the_mix(stdlib_data):
    plant = mix(stdlib_data, 0.35)
    rows = np.zeros((10, L + 1), dtype=np.int64)
    counts = [len(plant(rows.copy(), 0, step)) for step in range(300)]
    assert set(counts) == {3, 4}
    assert np.mean(counts) / 10 == pytest.approx(0.35, abs=0.02)
    assert ruler.training_mix(posbench.compose([]), stdlib_data) is None  # ruler_mix=0


def test_tasks_are_drawn_uniformly_from_train_ruler_tasks(stdlib_data):
    plant = mix(stdlib_data, 0.5, ["niah_single_1", "vt"])
    rows = np.zeros((8, L + 1), dtype=np.int64)
    asked = []
    for step in range(40):
        batch = rows.copy()
        for i in plant(batch, 0, step):
            text = bytes(batch[i].astype(np.uint8))
            asked.append("vt" if b"\nwhich vars are " in text else "niah_single_1")
            assert asked[-1] == "vt" or b"\nwhat is key " in text
    assert 0.35 < asked.count("vt") / len(asked) < 0.65


def test_no_evaluation_sequence_is_trained_on(stdlib_data, tasks):
    # eval.ruler's instances at the training length (the only length a training row has), at
    # its defaults and at other seeds
    evaluated = {bytes(i.row.astype(np.uint8)) for task in tasks for seed in (0, 1)
                 for depth in RulerConfig().depths
                 for i in instances(task, RulerConfig(seed=seed), L, depth)}
    plant = mix(stdlib_data, 0.5)
    rows = np.zeros((16, L + 1), dtype=np.int64)
    trained = set()
    for step in range(60):
        batch = rows.copy()
        trained |= {bytes(batch[i].astype(np.uint8)) for i in plant(batch, 0, step)}
    assert len(trained) > 400 and not trained & evaluated
    # a text haystack comes from training documents, the evaluation's from validation ones:
    # the same generator gives other text, and the same instance for every other haystack
    for task in tasks:
        made = [task.make(np.random.default_rng([0, 1, 2]), L, 0.5, split=split).row
                for split in ("val", "train")]
        assert np.array_equal(*made) == (task.preset.haystack != "text"), task.name


def test_a_batch_depends_on_seed_and_step_alone_so_a_resumed_run_sees_the_same(stdlib_data):
    first = mix(stdlib_data, 0.5)
    ahead = [stdlib_data.train_batch(L, 8, 0, step, first)[0] for step in range(6)]
    again = mix(stdlib_data, 0.5)  # a fresh process's planter, resumed at step 5
    assert torch.equal(stdlib_data.train_batch(L, 8, 0, 5, again)[0], ahead[5])
    assert torch.equal(stdlib_data.train_batch(L, 8, 0, 2, again)[0], ahead[2])
    assert not torch.equal(stdlib_data.train_batch(L, 8, 1, 5, again)[0], ahead[5])


def test_beside_retrieval_mix_each_plants_its_own_rows(stdlib_data):
    from posbench.evaluations.base import planting

    passkeys = mixer(Passkeys(stdlib_data, posbench.compose([]).dataset), 0.25)
    both = planting(passkeys, mix(stdlib_data, 0.5))
    for step in range(10):
        x = stdlib_data.train_batch(L, 8, 0, step, both)[0]
        alone = stdlib_data.train_batch(L, 8, 0, step, passkeys)[0]
        plain = stdlib_data.train_batch(L, 8, 0, step)[0]
        keys = [i for i in range(8) if not torch.equal(alone[i], plain[i])]
        tasks = [i for i in range(8) if not torch.equal(x[i], alone[i])]
        assert len(keys) == 2 and len(tasks) == 4 and not set(keys) & set(tasks)
        assert all(torch.equal(x[i], alone[i]) for i in keys)  # the passkeys as without it


def test_train_runs_with_the_mix_and_records_it(tmp_path, toy, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    run = ["train.seq_len=64", "eval.lengths=[64]", "train.ruler_mix=0.5",
           "train.ruler_tasks=[niah_single_1,niah_control]", "eval.ruler.enabled=true",
           "eval.ruler.tasks=[niah_single_1]", "eval.ruler.trials=1", "eval.ruler.depths=[0.5]"]
    proc = run_in_process(["train", *toy, *run, "hydra.run.dir=run"], monkeypatch, capsys)
    assert proc.returncode == 0, proc.stderr
    record = json.loads((tmp_path / "run" / "results.json").read_text())
    assert record["status"] == "ok"
    assert record["config"]["train"]["ruler_mix"] == 0.5
    assert record["config"]["train"]["ruler_tasks"] == ["niah_single_1", "niah_control"]
    assert list(record["eval"]["ruler"]["tasks"]) == ["niah_single_1"]


@pytest.mark.parametrize("override, refusal", [
    (["train.ruler_mix=1.0"],
     "train.ruler_mix=1.0 is not accepted; expected a fraction in [0, 1)"),
    (["train.ruler_mix=0.5", "train.ruler_tasks=[niah_singel_1]"],
     "train.ruler_tasks='niah_singel_1' is not accepted; expected one of niah_single_1, "),
    (["train.ruler_mix=0.5", "train.retrieval_mix=0.5"],
     "train.ruler_mix=0.5 is not accepted; expected less than 1 - train.retrieval_mix=0.5"),
    (["train.ruler_mix=0.5", "dataset=task_copy"],
     "train.ruler_mix=0.5 is not accepted; expected 0 for dataset=task_copy"),
    (["train.ruler_mix=0.5", "train.ruler_tasks=[niah_single_1]"],
     "train.ruler_tasks=niah_single_1 with train.seq_len=32 is not accepted: its needles, query "
     "and answer take 50 tokens, more than the window's 33; expected train.seq_len of at least "
     "49, or train.ruler_tasks without niah_single_1"),
])
def test_what_cannot_work_is_refused_in_one_line(tmp_path, toy, monkeypatch, capsys, override,
                                                 refusal):
    monkeypatch.chdir(tmp_path)
    proc = run_in_process(["train", *toy, *override, "hydra.run.dir=run"], monkeypatch, capsys)
    assert proc.returncode == 2
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and refusal in lines[0], proc.stderr
    if "singel" in refusal:
        assert "(did you mean 'niah_single_1'?)" in lines[0]
    assert not (tmp_path / "run" / "results.json").exists()
