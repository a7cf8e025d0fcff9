"""Gu and Dao's selective copying (posbench/data/selective_copy.py), as the S4 repository's
generator makes it: every instance read back by an oracle written here (the stretch's content in
order is the answer, 16 tokens of the 14 symbols, blanks elsewhere), the content's positions
uniform over the stretch and its symbols uniform, sizes counting the stretch, and the task
trained and scored through the CLI."""
import json

import numpy as np
import pytest
from omegaconf import OmegaConf

from helpers import posbench_cli
from posbench.data import prepare
from posbench.data.tasks import BOS, FIRST, SEP

SYMBOLS, M = 14, 16
BLANK = FIRST + SYMBOLS  # after the symbols


def task():
    return prepare(OmegaConf.create({"name": "task_selective_copy"})).task


@pytest.mark.parametrize("size", [16, 17, 40, 300])
def test_the_answer_is_the_stretchs_content_in_order(size):
    rng = np.random.default_rng(size)
    for _ in range(50):
        seq, answer = task().make(rng, size)
        assert len(seq) == size + 2 + M and seq[0] == BOS and seq[size + 1] == SEP
        stretch, copied = seq[1:size + 1], seq[size + 2:]
        content = [int(t) for t in stretch if t != BLANK]
        assert content == [int(t) for t in copied] and len(content) == M
        assert all(FIRST <= t < FIRST + SYMBOLS for t in content)
        assert list(np.flatnonzero(answer)) == list(range(size + 2, size + 2 + M))


def test_content_stands_anywhere_in_the_stretch_and_draws_every_symbol_alike():
    """4000 stretches of 64: each position holds content with probability 16/64, within 5
    binomial standard errors; the 64,000 content tokens spread over the 14 symbols alike."""
    rng = np.random.default_rng(0)
    size, n = 64, 4000
    held, symbols = np.zeros(size), []
    for _ in range(n):
        seq, _ = task().make(rng, size)
        held += seq[1:size + 1] != BLANK
        symbols.append(seq[size + 2:])
    p = M / size
    assert np.abs(held / n - p).max() < 5 * np.sqrt(p * (1 - p) / n)
    counts = np.bincount(np.concatenate(symbols) - FIRST, minlength=SYMBOLS)
    assert len(counts) == SYMBOLS
    q = 1 / SYMBOLS
    assert np.abs(counts / counts.sum() - q).max() < 5 * np.sqrt(q * (1 - q) / counts.sum())


def test_a_window_holds_bos_the_stretch_sep_and_the_copy():
    t = task()
    assert [t.size(n) for n in (34, 35, 129)] == [16, 17, 111]
    assert t.fits(33) and not t.fits(34)


def test_the_task_trains_and_is_scored_on_the_copy_through_the_cli(tmp_path):
    posbench_cli("train", "dataset=task_selective_copy", "encoding=alibi", "model.n_layer=1",
                 "model.d_model=32", "model.n_head=2", "train.seq_len=48", "train.steps=3",
                 "train.batch_size=4", "train.warmup_steps=1", "eval.lengths=[48,96]",
                 "eval.tokens=384", f"hydra.run.dir={tmp_path}", cwd=tmp_path, in_process=True)
    record = json.loads((tmp_path / "results.json").read_text())
    assert record["dataset"]["name"] == "task_selective_copy"
    assert [p["length"] for p in record["eval"]["curve"]] == [48, 96]
    assert all(0 <= p["accuracy"] <= 1 for p in record["eval"]["curve"])
