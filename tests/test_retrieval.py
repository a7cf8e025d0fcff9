"""Passkey retrieval (posbench/evaluations/retrieval.py): the sequences, both scores against oracles, the
effective lengths, train.retrieval_mix, and the whole path through the installed command."""
import json

import numpy as np
import pytest
import torch

import posbench
from posbench.evaluations.base import effective_length, relative_effective_length
from posbench.evaluations.perplexity import ppl_effective_length
from posbench.evaluations.retrieval import Passkeys, Retrieval, key_scores, mixer, sequences
from helpers import Blind, Copier, posbench_cli, run_in_process

QUESTION = b"\nwhat is the key? the key is "


@pytest.fixture(scope="module")
def passkeys(stdlib_data):
    return Passkeys(stdlib_data, posbench.compose([]).dataset)


def config(**values):
    r = Retrieval.config(posbench.compose([]))
    for key, value in values.items():
        setattr(r, key, value)
    return r


def text(row) -> bytes:
    return bytes(np.asarray(row, dtype=np.uint8))


@pytest.mark.parametrize("depth", [0.0, 0.5, 1.0])
def test_the_key_sits_at_its_depth_and_is_asked_again_at_the_end(passkeys, depth):
    r = config(key_tokens=6, trials=3)
    rows, first, second = sequences(passkeys, r, 128, depth)
    assert rows.shape == (3, 129)
    filler = 129 - len(b"the key is ") - 6 - len(b". ") - len(QUESTION) - 6
    for row, a, b in zip(rows, first, second):
        key = text(row[a:a + 6])
        assert key.isalnum() and text(row[b:]) == key and b == 129 - 6
        assert text(row[:b]).endswith(QUESTION)
        assert text(row[a - 11:a + 8]) == b"the key is " + key + b". "
        assert a - 11 == round(depth * filler)  # filler tokens before the needle
    assert len({text(row[a:a + 6]) for row, a in zip(rows, first)}) == 3  # a key per trial


def test_the_same_sequences_for_every_run_and_others_for_another_seed(passkeys):
    r = config(trials=4)
    np.random.seed(1), torch.manual_seed(1)
    a = sequences(passkeys, r, 256, 0.25)[0]
    np.random.seed(2), torch.manual_seed(2)  # the global generators play no part
    assert np.array_equal(a, sequences(passkeys, r, 256, 0.25)[0])
    assert not np.array_equal(a, sequences(passkeys, config(trials=4, seed=1), 256, 0.25)[0])
    assert not np.array_equal(a, sequences(passkeys, r, 256, 0.5)[0])


def test_several_keys_are_planted_and_one_is_asked(passkeys):
    rows, first, second = sequences(passkeys, config(keys=3, key_tokens=5, trials=6), 256, 0.5)
    for row, a, b in zip(rows, first, second):
        line = text(row)
        asked = line[line.rindex(b"what is the key ") + 16:][:1]
        assert text(row[a - 13:a]) == b"the key " + asked + b" is "
        assert all(b"the key %d is " % i in line for i in (1, 2, 3))
        assert np.array_equal(row[a:a + 5], row[b:])


def test_a_copier_scores_exact_match_and_saves_bits_a_blind_model_saves_none(passkeys):
    rows, first, second = (torch.from_numpy(a) for a in
                           sequences(passkeys, config(key_tokens=4, trials=2), 96, 0.5))
    loss_1, loss_2, hits = key_scores(Copier(), rows, first, second, 4)
    assert hits.all() and (loss_2 < 0.1).all() and (loss_1 - loss_2 > 3).all()
    loss_1, loss_2, hits = key_scores(Blind(), rows, first, second, 4)
    assert not hits.any() and torch.allclose(loss_1, loss_2)


def test_effective_lengths_of_hand_made_curves():
    assert effective_length([(64, 2.0), (128, 1.5), (256, 0.5), (512, 1.2)], 1.0) == 128
    assert effective_length([(128, 1.0), (64, 1.0)], 1.0) == 128
    assert effective_length([(64, 0.9), (128, 2.0)], 1.0) is None
    assert effective_length([(64, 2.0), (128, None), (256, 2.0)], 1.0) == 64  # oom stops it


def test_relative_effective_lengths_keep_85_percent_of_the_shortest_lengths_score():
    # base 4.0 at 64: a length counts while its score is >= 3.4
    assert relative_effective_length([(128, 3.4), (64, 4.0), (256, 3.39), (512, 4.0)]) == 128
    assert relative_effective_length([(64, 0.2), (128, 0.18), (256, 0.1)]) == 128
    assert relative_effective_length([(64, 0.0), (128, 1.0)]) is None  # nothing to keep
    assert relative_effective_length([(64, None), (128, 1.0)]) is None
    assert relative_effective_length([]) is None
    curve = [{"length": 32, "ppl": 9.0}, {"length": 64, "ppl": 4.0},
             {"length": 128, "ppl": 4.3}, {"length": 256, "ppl": 4.5},
             {"length": 512, "ppl": 4.2}]
    assert ppl_effective_length(curve, 64, 0.1) == 128  # 32 is shorter than L: not counted
    assert ppl_effective_length(curve, 64, 0.2) == 512
    assert ppl_effective_length(curve[:2] + [{"length": 128, "status": "oom"}], 64, 1.0) == 64
    assert ppl_effective_length([{"length": 128, "ppl": 4.0}], 64, 0.1) is None


def planted(rows) -> np.ndarray:
    return np.array([QUESTION in text(row) for row in rows.numpy()])


def test_the_training_mix_replaces_its_share_of_rows_per_seed_and_step(stdlib_data, passkeys):
    plant = mixer(passkeys, 0.3)
    shares = []
    for step in range(40):
        x, y = stdlib_data.train_batch(64, 10, 0, step, plant)
        plain, _ = stdlib_data.train_batch(64, 10, 0, step)
        mask = planted(x)
        assert mask.sum() == 3
        assert torch.equal(x[~torch.from_numpy(mask)], plain[~torch.from_numpy(mask)])
        assert torch.equal(x[:, 1:], y[:, :-1])
        shares.append(mask.mean())
    assert np.mean(shares) == pytest.approx(0.3)
    again, _ = stdlib_data.train_batch(64, 10, 0, 7, plant)
    assert torch.equal(again, stdlib_data.train_batch(64, 10, 0, 7, plant)[0])
    assert not torch.equal(again, stdlib_data.train_batch(64, 10, 1, 7, plant)[0])
    odd = [planted(stdlib_data.train_batch(64, 4, 0, step, mixer(passkeys, 0.3))[0]).sum()
           for step in range(200)]
    assert set(odd) == {1, 2} and np.mean(odd) == pytest.approx(1.2, abs=0.15)
    assert mixer(passkeys, 0.0) is None


def test_train_writes_the_grid_the_heatmap_and_effective_lengths(tmp_path, toy):
    run = ["train.seq_len=64", "eval.lengths=[64,128]", "eval.retrieval.enabled=true",
           "eval.retrieval.trials=2", "eval.retrieval.key_tokens=4",
           "eval.retrieval.depths=[0,0.5,1]", "train.retrieval_mix=0.5"]
    posbench_cli("train", *toy, *run, "hydra.run.dir=run", cwd=tmp_path, in_process=True)
    record = json.loads((tmp_path / "run" / "results.json").read_text())
    r = record["eval"]["retrieval"]
    assert [(c["length"], c["depth"]) for c in r["grid"]] == [
        (n, d) for n in (64, 128) for d in (0.0, 0.5, 1.0)]
    for cell in r["grid"]:
        assert cell["bits_saved"] == pytest.approx(cell["loss_first"] - cell["loss_second"])
        assert 0 <= cell["exact_match"] <= 1
    assert [p["length"] for p in r["by_length"]] == [64, 128]
    effective = record["eval"]["effective_length"]
    assert effective["retrieval"] == r["effective_length"]
    assert effective["retrieval_relative"] == r["relative_effective_length"] == \
        relative_effective_length([(p["length"], p["bits_saved"]) for p in r["by_length"]])
    assert effective["ppl"] in (64, 128) and record["eval"]["ppl_tolerance"] == 0.1
    assert record["config"]["train"]["retrieval_mix"] == 0.5
    assert (tmp_path / "run" / "retrieval_heatmap.png").stat().st_size > 0

    proc = posbench_cli("report", "run", cwd=tmp_path, in_process=True)
    summary = (tmp_path / "run" / "summary.md").read_text()
    assert "| encoding | by ppl | by retrieval | by retrieval, relative |" in summary
    assert "bits saved per key token by length" in summary
    assert (tmp_path / "run" / "retrieval_grid.png").stat().st_size > 0
    assert "retrieval_grid.png" in proc.stdout


@pytest.mark.parametrize("override, refusal", [
    ("eval.retrieval.depths=[0,1.5]", "eval.retrieval.depths=1.5 is not accepted; expected depths in [0, 1]"),
    ("eval.retrieval.key_tokens=40",
     "eval.retrieval.key_tokens=40 at length 64 is not accepted: 1 key(s) of 40 tokens"),
    ("train.retrieval_mix=1.0", "train.retrieval_mix=1.0 is not accepted; expected a fraction in [0, 1)"),
])
def test_impossible_requests_are_refused_in_one_line(tmp_path, toy, monkeypatch, capsys,
                                                     override, refusal):
    monkeypatch.chdir(tmp_path)
    proc = run_in_process(["train", *toy, "train.seq_len=64", "eval.lengths=[64]",
                           "eval.retrieval.enabled=true", override, "hydra.run.dir=run"],
                          monkeypatch, capsys)
    assert proc.returncode == 2
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and refusal in lines[0], proc.stderr
    assert not (tmp_path / "run" / "results.json").exists()


def test_a_retrieval_rescore_prints_and_reports_retrieval_not_a_copied_perplexity(tmp_path,
                                                                                  toy_run_copy):
    asked = ["eval.retrieval.enabled=true", "eval.retrieval.trials=1",
             "eval.retrieval.key_tokens=4", "eval.retrieval.lengths=[64]",
             "eval.retrieval.depths=[0.5]"]
    proc = posbench_cli("eval", "run", *asked, cwd=tmp_path, in_process=True)
    (path,) = (tmp_path / "run").glob("results.eval-*.json")
    record = json.loads(path.read_text())
    label = f"rope ({record['rescore']['label']})"
    bits = record["eval"]["retrieval"]["by_length"][0]["bits_saved"]
    # its final table: the retrieval tables a sweep's report prints
    assert "Passkey retrieval: bits saved per key token by length" in proc.stdout
    assert f"| {label} | {bits:.3f} |" in proc.stdout

    posbench_cli("report", "run", cwd=tmp_path, in_process=True)
    summary = (tmp_path / "run" / "summary.md").read_text()
    assert f"| {label} | {bits:.3f} |" in summary  # a retrieval row
    assert "1 runs, 1 re-scores" in summary
    ppl_table = summary.split("\n\n")[2]
    assert ppl_table.startswith("| group |") and label not in ppl_table
    # no perplexity group of its own: not in the csv (nor, so, the perplexity plot)
    assert {row.split(",")[0] for row in
            (tmp_path / "run" / "summary.csv").read_text().splitlines()[1:]} == {"rope"}
