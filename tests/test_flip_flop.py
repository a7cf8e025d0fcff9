"""Liu et al.'s flip-flop language (posbench/data/flip_flop.py): every instance read back and
replayed by an oracle written here (each read's bit found by looking back for the last write),
the answers exactly the bits after r, FFL(0.8)'s instruction frequencies and fair coins
elsewhere, and sizes in pairs (tests/test_tasks.py holds every task to the shared contract:
windows, seeding, fingerprints, training)."""
import numpy as np
import pytest
from omegaconf import OmegaConf

from posbench.data import prepare
from posbench.data.tasks import BOS, FIRST

BITS, W, R, I = (FIRST, FIRST + 1), FIRST + 2, FIRST + 3, FIRST + 4  # 0, 1, then w, r, i


def task():
    return prepare(OmegaConf.create({"name": "task_flip_flop"})).task


def replayed(seq):
    """Each (position, bit) a read must give: the bit of the nearest write before it."""
    pairs = list(zip(seq[1::2], seq[2::2]))
    out = []
    for k, (op, _) in enumerate(pairs):
        if op == R:
            written = next(bit for o, bit in reversed(pairs[:k]) if o == W)
            out.append((2 + 2 * k, written))
    return out


@pytest.mark.parametrize("size", [2, 3, 17, 200])
def test_every_read_gives_back_the_last_bit_written_and_is_the_answer(size):
    rng, t = np.random.default_rng(size), task()
    for _ in range(50):
        seq, answer = t.make(rng, size)
        assert len(seq) == 1 + 2 * size and seq[0] == BOS
        ops, bits = seq[1::2], seq[2::2]
        assert ops[0] == W and ops[-1] == R and set(ops) <= {W, R, I}
        assert set(bits) <= set(BITS)
        reads = replayed(seq)
        assert [int(seq[k]) for k, _ in reads] == [int(b) for _, b in reads]
        assert list(np.flatnonzero(answer)) == [k for k, _ in reads]


def test_the_middle_instructions_are_ffl_08_and_the_free_bits_fair_coins():
    """200 instances of 502 pairs: 100,000 middle instructions at (w, r, i) = (0.1, 0.1, 0.8),
    each share within 5 binomial standard errors; the bits after w and i half ones."""
    rng, t = np.random.default_rng(0), task()
    ops, free = [], []
    for _ in range(200):
        seq, _ = t.make(rng, 502)
        ops.append(seq[3:-2:2])  # the instructions between the first and the last
        free.append(seq[2::2][seq[1::2] != R])
    ops, free = np.concatenate(ops), np.concatenate(free)
    n = len(ops)
    for op, p in ((W, 0.1), (R, 0.1), (I, 0.8)):
        assert abs(np.mean(ops == op) - p) < 5 * np.sqrt(p * (1 - p) / n), op
    assert abs(np.mean(free == BITS[1]) - 0.5) < 5 * np.sqrt(0.25 / len(free))


def test_a_window_holds_whole_pairs_after_bos():
    t = task()
    assert [t.size(n) for n in (5, 6, 7, 129)] == [2, 2, 3, 64]
    assert t.fits(4) and not t.fits(5)
