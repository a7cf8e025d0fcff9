"""Gu and Dao's selective copying (posbench/data/selective_copy.py), as the S4 repository's
generator makes it: every instance read back by an oracle written here (the stretch's content in
order is the answer, 16 tokens of the 14 symbols, blanks elsewhere), the content's positions
uniform over the stretch and its symbols uniform, and sizes counting the stretch
(tests/test_tasks.py holds every task to the shared contract: windows, seeding, fingerprints,
training)."""
import numpy as np
import pytest
from omegaconf import OmegaConf

from posbench.data import prepare
from posbench.data.tasks import BOS, FIRST, SEP

SYMBOLS, M = 14, 16
BLANK = FIRST + SYMBOLS  # after the symbols


def task():
    return prepare(OmegaConf.create({"name": "task_selective_copy"})).task


@pytest.mark.parametrize("size", [16, 17, 40, 300])
def test_the_answer_is_the_stretchs_content_in_order(size):
    rng, t = np.random.default_rng(size), task()
    for _ in range(50):
        seq, answer = t.make(rng, size)
        assert len(seq) == size + 2 + M and seq[0] == BOS and seq[size + 1] == SEP
        stretch, copied = seq[1:size + 1], seq[size + 2:]
        content = [int(t) for t in stretch if t != BLANK]
        assert content == [int(t) for t in copied] and len(content) == M
        assert all(FIRST <= t < FIRST + SYMBOLS for t in content)
        assert list(np.flatnonzero(answer)) == list(range(size + 2, size + 2 + M))


def test_content_stands_anywhere_in_the_stretch_and_draws_every_symbol_alike():
    """4000 stretches of 64: each position holds content with probability 16/64, within 5
    binomial standard errors; the 64,000 content tokens spread over the 14 symbols alike."""
    rng, t = np.random.default_rng(0), task()
    size, n = 64, 4000
    held, symbols = np.zeros(size), []
    for _ in range(n):
        seq, _ = t.make(rng, size)
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
