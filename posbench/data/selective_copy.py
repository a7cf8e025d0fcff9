"""Selective copying (Gu and Dao 2023, "Mamba: Linear-Time Sequence Modeling with Selective State
Spaces", arXiv 2312.00752, Section 4.1.1 and Appendix E.1), as the copying generator of the S4
repository makes it (github.com/state-spaces/s4 at d27bdf9, src/dataloaders/datasets/copying.py,
torch_copying_data with variable=True): copy the few content tokens of a stretch of noise, in
order, wherever they stand.

The reference draws M tokens to memorize uniformly from an alphabet of A - 2 symbols (token 0 is
the noise, A - 1 the marker), puts them, in the order drawn, at M positions drawn uniformly
without repetition among L + M and sorted, noise everywhere else, and then M markers, at which
its model must output the M tokens. Mamba states a vocabulary of 16 and 16 tokens to memorize
in sequences of 4096; posbench reads that vocabulary as the generator's A, noise and marker
included, so 14 symbols.

Here an instance is BOS, the stretch of λ = L + M tokens (M = 16 of the 14 symbols, placed as
the reference places them, the blank token elsewhere), SEP, then the M tokens in order, the
answers. λ counts the stretch, so a longer window holds more noise around the same 16 tokens.
What differs: the reference feeds M markers and reads all M outputs at once; a causal decoder
here writes them one after another, each seeing the ones before it (teacher-forced), as in
posbench's copy task.
"""
from __future__ import annotations

import numpy as np

from posbench.data.algorithmic import Written
from posbench.data.base import register
from posbench.data.tasks import BOS, SEP, marked

MEMORIZE = 16  # M, Mamba's tokens to memorize


@register("task_selective_copy", "selective copying (Gu and Dao 2023): 16 tokens among blanks, "
          "copied in order; exact match")
class SelectiveCopy(Written):
    """BOS s1 .. sλ SEP t1 .. t16: the t in order at 16 sorted random positions of s, blank
    elsewhere."""
    values = 14  # A - 2 symbols, A = 16
    marks = ("blank",)
    min_size = MEMORIZE

    def parameters(self):
        return {**super().parameters(), "memorize": MEMORIZE}

    def size(self, total):
        return total - 2 - MEMORIZE  # BOS, SEP, the answers

    def make(self, rng, size):
        tokens = self.draw(rng, MEMORIZE)
        stretch = np.full(size, self.mark("blank"), dtype=np.int64)
        stretch[np.sort(rng.permutation(size)[:MEMORIZE])] = tokens
        return marked([BOS, stretch, SEP, tokens], size + 2)
