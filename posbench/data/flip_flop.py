"""Flip-flop language modeling (Liu, Ash, Goel, Krishnamurthy and Zhang 2023, "Exposing Attention
Glitches with Flip-Flop Language Modeling", NeurIPS 2023, arXiv 2306.00946): remember one bit
across a stretch of instructions that do not touch it.

A flip-flop string is a run of (instruction, bit) pairs over the instructions w (write), r (read)
and i (ignore): `w b` sets the memory to b, `r b` must give b equal to the memory, and the bit
after `i` is noise. The paper's FFL(T, p) draws T/2 pairs: the first instruction is w, the last
r, those between i.i.d. with probability p_i for i and (1 - p_i)/2 for each of w and r; the bits
after w and i are fair coins, a bit after r the last bit written. Its canonical distribution is
p_i = 0.8, where a read's write stands a geometric distance back, ten pairs on average and often
many more; the only deterministic tokens, and the only ones it scores, are the bits after r.

Here an instance is BOS then λ pairs; its answers are the bits after r (every read right is an
exact match; the answer-token accuracy is one minus the paper's read error rate). λ counts pairs,
so longer windows hold longer strings with the same p_i: the distances between a read and its
write grow, as in the paper's sparse test, but by length rather than by p_i. What differs: the
paper trains its models as language models on whole strings, whose other tokens are coin flips
or drawn instructions; a posbench task trains on its answers alone.
"""
from __future__ import annotations

import numpy as np

from posbench.data.algorithmic import Written
from posbench.data.base import register
from posbench.data.tasks import BOS

IGNORE = 0.8  # p_i of the paper's canonical FFL(0.8)


@register("task_flip_flop", "flip-flop language (Liu et al. 2023): write, read and ignore a bit, "
          "p_i = 0.8; the read bits scored")
class FlipFlop(Written):
    """BOS σ1 b1 .. σλ bλ: σ1 = w, σλ = r, the others w, r or i; each b after r is an answer."""
    values = 2  # the bits
    marks = ("w", "r", "i")
    min_size = 2  # one write, one read

    def parameters(self):
        return {**super().parameters(), "ignore": IGNORE}

    def size(self, total):
        return (total - 1) // 2

    def make(self, rng, size):
        write, read, ignore = (self.mark(m) for m in self.marks)
        middle = rng.choice([write, read, ignore], size=size - 2,
                            p=[(1 - IGNORE) / 2, (1 - IGNORE) / 2, IGNORE])
        instructions = np.array([write, *middle, read], dtype=np.int64)
        bits = self.draw(rng, size)
        memory = bits[0]
        for k in range(1, size):
            if instructions[k] == read:
                bits[k] = memory
            elif instructions[k] == write:
                memory = bits[k]
        seq = np.empty(1 + 2 * size, dtype=np.int64)
        seq[0], seq[1::2], seq[2::2] = BOS, instructions, bits
        answer = np.zeros(len(seq), dtype=bool)
        answer[2::2] = instructions == read
        return seq, answer
