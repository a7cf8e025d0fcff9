"""`posbench reproduce ruoss2023`: five of Delétang et al.'s tasks trained on sizes 1..40 and scored
by token accuracy to 100, three bases each plain and randomized; the abstract's gain past L (the
MeanGain claim, re-derived here by hand) judged on numbers written here, runs grouped by task and
row, the experiment composed for every task and row, and the entry's dry run through the CLI."""
from fractions import Fraction

from omegaconf import OmegaConf

import posbench
from posbench.core.composing import composer
from helpers import posbench_cli
from posbench.data import build_dataset
from posbench.data.tasks import window_for
from posbench.reproduce import NOT_COMPARABLE, NOT_REPRODUCED, REPRODUCED, Measured, registry
from posbench.reproduce.claims import MeanGain

ENTRY = registry()["ruoss2023"].cls
TASKS = ("even_pairs", "reverse_string", "duplicate_string", "missing_duplicate_string",
         "odds_first")
BASES = ("sinusoidal", "rope", "alibi")
ROWS = ("sinusoidal", "randomized_sinusoidal", "rope", "randomized_rope", "alibi",
        "randomized_alibi")
INSIDE = (10, 20, 30, 40)  # instance sizes up to L = 40
PAST = (41, 50, 60, 70, 80, 90, 100)  # past L, to the reference example's 100
GAINS = ("mean_gain", "gain_sinusoidal", "gain_rope", "gain_alibi")


def accuracies(past, at_l=None):
    """Token accuracy of every task/row: 1.0 up to L (at L: at_l's value where it names the
    group), and past L `past(task, row)`, the same at every size."""
    at_l = at_l or {}
    return Measured({f"{t}/{r}": {**{k / 40: 1.0 for k in INSIDE}, 1.0: at_l.get(f"{t}/{r}", 1.0),
                                  **{k / 40: past(t, r) for k in PAST}}
                     for t in TASKS for r in ROWS}, at_paper_scale=False)


def gaining(by_base, plain=0.3):
    """Plain rows at `plain` past L, each randomized row `by_base[base]` above it."""
    return accuracies(lambda t, r: plain + (by_base[r.removeprefix("randomized_")]
                                            if r.startswith("randomized_") else 0.0))


def verdicts(measured):
    return {c.name: c.judge(measured) for c in ENTRY.claims}


def test_the_entry_runs_three_bases_plain_and_randomized_on_all_three_classes():
    ENTRY.check()
    assert ENTRY.metric == "token_accuracy" and ENTRY.axis == "score"
    assert ENTRY.paper_train_length == 40 and not ENTRY.at_paper_scale()
    assert ENTRY.groups == tuple(f"{t}/{r}" for t in TASKS for r in ROWS)
    # the abstract's one number, beside each randomized row
    assert ENTRY.published == {f"randomized_{b}": {"abstract: mean gain past L": 0.12}
                               for b in BASES}
    assert "Table 1" in ENTRY.source and "not quoted" in ENTRY.source
    levels = {build_dataset(OmegaConf.create({"name": f"task_{t}"})).level for t in TASKS}
    assert levels == {"regular", "dcf", "cs"}
    assert [c.name for c in ENTRY.claims] == ["in_distribution", *GAINS]


def test_the_experiment_composes_every_task_at_its_windows_and_sweeps_the_entry():
    for task in TASKS:
        cfg = posbench.compose(["+experiment=ruoss2023", f"dataset=task_{task}"])
        data = build_dataset(cfg.dataset)
        assert cfg.dataset.name == f"task_{task}"
        # the training window is the shortest that holds an instance of 40, and each eval
        # length the one that holds its size
        assert cfg.train.seq_len == window_for(data, 40)
        assert data.size(cfg.train.seq_len + 1) == 40
        assert [data.size(n + 1) for n in cfg.eval.lengths] == [*INSIDE, *PAST]
        assert list(cfg.eval.lengths) == [window_for(data, k) for k in (*INSIDE, *PAST)]
        assert (cfg.train.steps, cfg.train.batch_size, cfg.device) == (10000, 128, "cpu")
        assert (cfg.model.n_layer, cfg.model.d_model, cfg.model.n_head) == (5, 64, 8)
        assert cfg.eval.randomized_positions == "random"
    for row in ROWS:
        enc = posbench.compose(["+experiment=ruoss2023", f"ruoss2023={row}"]).encoding
        if row.startswith("randomized_"):
            assert (enc.name, enc.base, enc.max_len) == ("randomized", row[11:], 2048)
        else:
            assert enc.name == row
    with composer() as compose:
        params = compose(["+experiment=ruoss2023"], hydra=True).hydra.sweeper.params
    assert params.dataset.split(",") == [f"task_{t}" for t in TASKS]
    assert params.ruoss2023.split(",") == list(ROWS)
    assert params.seed.split(",") == ["0", "1", "2"]


def test_mean_gain_averages_each_tasks_gain_past_l_over_tasks_and_pairs():
    # two tasks, two pairs; task b's randomized row measured at one size past L only
    values = {"a/p": {1.0: 1.0, 1.5: 0.2, 2.0: 0.0}, "a/r": {1.0: 1.0, 1.5: 0.5, 2.0: 0.4},
              "b/p": {1.0: 1.0, 1.5: 0.6, 2.0: 0.6}, "b/r": {1.0: 0.96, 2.0: 0.7},
              "a/q": {1.0: 1.0, 1.5: 0.1, 2.0: 0.1}, "a/s": {1.0: 1.0, 1.5: 0.1, 2.0: 0.0},
              "b/q": {1.0: 1.0, 1.5: 0.3, 2.0: 0.3}, "b/s": {1.0: 1.0, 1.5: 0.3, 2.0: 0.3}}
    # by hand: a (p, r) (0.3 + 0.4) / 2 = 0.35, b (p, r) 0.1 at 2L alone; a (q, s) -0.05, b 0
    by_hand = (Fraction(35, 100) + Fraction(1, 10) - Fraction(5, 100) + 0) / 4
    claim = MeanGain("gain", "r above p", 0.05, "why", tasks=("a", "b"),
                     pairs=(("p", "r"), ("q", "s")), least=0.14, min_tasks=2)
    verdict, detail = claim.judge(Measured(values, at_paper_scale=False))
    assert verdict == REPRODUCED, detail  # 0.1 >= 0.14 - 0.05
    assert f"over 4 gains (tasks by pairs): {float(by_hand):+.3f}" in detail
    assert "r - p: +0.225 (a +0.350, b +0.100)" in detail and "s - q: -0.025" in detail
    # one pair alone: a gain at or below 0 is not reproduced, one inside the noise is neither
    alone = MeanGain("gain", "s above q", 0.05, "why", tasks=("a", "b"), pairs=(("q", "s"),),
                     least=0.14, min_tasks=2)
    assert alone.judge(Measured(values, False))[0] == NOT_REPRODUCED
    values["a/s"] = {1.0: 1.0, 1.5: 0.2, 2.0: 0.2}  # +0.1 and 0: a mean of +0.05 < 0.09
    verdict, detail = alone.judge(Measured(values, False))
    assert verdict == NOT_COMPARABLE and "inside the noise" in detail
    # a task not learned at L is left out; too few tasks left is not comparable
    values["b/r"][1.0] = 0.9
    verdict, detail = claim.judge(Measured(values, False))
    assert verdict == NOT_COMPARABLE and "left out: b/r 0.900" in detail
    assert "fewer than 2 tasks counted: r - p on 1" in detail


def test_the_abstracts_gain_reproduces_and_no_gain_does_not():
    # the abstract's +12 points on every task and base, every model perfect up to L
    judged = verdicts(gaining({"sinusoidal": 0.12, "rope": 0.12, "alibi": 0.12}))
    assert {name: v for name, (v, _) in judged.items()} == dict.fromkeys(
        ("in_distribution", *GAINS), REPRODUCED)
    assert "mean gain past 1L over 15 gains (tasks by pairs): +0.120" in judged["mean_gain"][1]

    # no gain, and a loss: not reproduced
    for gain in (0.0, -0.2):
        judged = verdicts(gaining(dict.fromkeys(BASES, gain)))
        assert {n: judged[n][0] for n in GAINS} == dict.fromkeys(GAINS, NOT_REPRODUCED)
    # a gain smaller than the noise the tolerance allows: not comparable
    judged = verdicts(gaining(dict.fromkeys(BASES, 0.03)))
    assert {n: judged[n][0] for n in GAINS} == dict.fromkeys(GAINS, NOT_COMPARABLE)

    # one base carries the average: the mean holds, each base is judged on its own
    judged = verdicts(gaining({"sinusoidal": 0.3, "rope": 0.0, "alibi": 0.0}))
    assert judged["mean_gain"][0] == judged["gain_sinusoidal"][0] == REPRODUCED
    assert judged["gain_rope"][0] == judged["gain_alibi"][0] == NOT_REPRODUCED
    assert "+0.100" in judged["mean_gain"][1]


def test_a_task_not_learned_at_l_is_left_out_and_fails_the_premise():
    measured = gaining(dict.fromkeys(BASES, 0.12))
    measured.values["odds_first/randomized_rope"][1.0] = 0.7
    judged = verdicts(measured)
    assert judged["in_distribution"][0] == NOT_REPRODUCED
    assert "odds_first/randomized_rope 0.700 at 1L" in judged["in_distribution"][1]
    # rope is judged on the four other tasks; the other bases on all five
    assert judged["gain_rope"][0] == REPRODUCED
    assert "over 4 tasks" in judged["gain_rope"][1]
    assert "left out: odds_first/randomized_rope 0.700" in judged["gain_rope"][1]
    assert "over 5 tasks" in judged["gain_alibi"][1]
    # three of five unlearned: under the three tasks a base is judged on
    for task in ("even_pairs", "reverse_string"):
        measured.values[f"{task}/rope"][1.0] = 0.5
    assert verdicts(measured)["gain_rope"][0] == NOT_COMPARABLE
    # a sweep of part of the tasks is shown, not judged
    part = Measured({g: row for g, row in gaining(dict.fromkeys(BASES, 0.12)).values.items()
                     if g.startswith("even_pairs/")}, at_paper_scale=False)
    verdict, detail = verdicts(part)["gain_rope"]
    assert verdict == NOT_COMPARABLE
    assert ("not both measured past 1L: rope and randomized_rope on reverse_string, "
            "duplicate_string, missing_duplicate_string, odds_first") in detail
    assert verdicts(Measured({}, False))["mean_gain"][0] == NOT_COMPARABLE


def record(task, encoding, seed, seq_len, curve):
    return {"encoding": encoding["name"], "seed": seed, "dataset": {"name": f"task_{task}"},
            "config": {"encoding": encoding}, "train": {"seq_len": seq_len},
            "model": {"params": 1, "n_layer": 5, "n_head": 8, "d_model": 64},
            "eval": {"curve": [{"length": n, "ppl": 1.0, "accuracy": 0.0, "token_accuracy": a}
                               for n, a in curve]}}


def test_runs_are_grouped_by_task_and_row_at_their_instance_size():
    randomized = {"name": "randomized", "base": "alibi", "max_len": 2048}
    # even_pairs of size k fills k + 3 tokens (a window of k + 2); duplicate_string 3k + 2 (3k + 1)
    runs = [record("even_pairs", {"name": "alibi"}, 0, 42, [(42, 1.0), (102, 0.5)]),
            record("even_pairs", {"name": "alibi"}, 1, 42, [(42, 0.9), (102, 0.25)]),
            record("even_pairs", randomized, 0, 42, [(42, 1.0), (102, 0.75)]),
            record("duplicate_string", {"name": "rope", "base": 1e4}, 0, 121,
                   [(121, 0.98), (301, 0.4)])]
    measured = ENTRY.measure(runs)
    assert measured.values == {"even_pairs/alibi": {1.0: 0.95, 2.5: 0.375},
                               "even_pairs/randomized_alibi": {1.0: 1.0, 2.5: 0.75},
                               "duplicate_string/rope": {1.0: 0.98, 2.5: 0.4}}
    assert measured.score == "token accuracy"  # as the verdicts and the figure name it
    assert ENTRY.owns(runs) == []
    assert ENTRY.owns([record("even_pairs", {"name": "randomized", "base": "t5"}, 0, 42,
                              [(42, 1.0)])]) == ["even_pairs/randomized_t5"]
    lines = "\n".join(ENTRY.tables(measured, 42))
    assert "| alibi | +0.375 | — | — | — | — | +0.375 | +0.120 |" in lines
    assert "| randomized_alibi | 1.000 | 0.750 |" in lines


def test_the_entry_dry_runs_through_the_cli(tmp_path):
    done = posbench_cli("reproduce", "ruoss2023", "dataset=task_even_pairs",
                        "ruoss2023=rope,randomized_rope", "seed=0", "train.steps=10",
                        "--dry-run", cwd=tmp_path, in_process=True)
    assert "posbench train -m +experiment=ruoss2023" in done.stdout
    for row in ("rope", "randomized_rope"):
        assert f"  dataset-task_even_pairs_ruoss2023-{row}_seed-0: " in done.stdout
    assert "2 jobs: " in done.stdout and "declared wall time: 90 jobs" in done.stdout
    assert list(tmp_path.iterdir()) == []
