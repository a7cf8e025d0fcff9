"""Synthetic length-generalization tasks, generated and seeded: copy, reverse, associative recall,
induction (look back N tokens) and multi-digit addition.

A task is a dataset (posbench/data/base.py) whose data is generated, not read: a new task is a
class deriving from Task, registered as `dataset=task_<name>`, that says how large an instance
fits a window (`size`) and makes one (`make`). An instance is a row of tokens and an answer mask:
the tokens to predict from what came before. Training draws fresh instances of every size up to
the training length (seeded by run seed and step; with `dataset.train_instances=N` it reads one
fixed set of N instead, as the references train on a finite set), each padded after its end: it
starts at position 0, as an instance fed alone does, and a causal model never sees its padding
(padding before it, as version 1 did, told the model the instance's size by the number of PAD
tokens, and an instance shorter than the window was scored without them). Evaluation scores
instances that fill each eval length, the same ones for every encoding and seed, on their answer
tokens only: loss, and exact-match accuracy.
"""
from __future__ import annotations

import functools
import hashlib
import math
from dataclasses import dataclass, field
from typing import ClassVar, Tuple

import numpy as np

import torch

from omegaconf import ListConfig, OmegaConf

from posbench.data.base import Dataset, DatasetConfig, build_dataset, register
from posbench.data.windows import IGNORE, EvalPlan
from posbench.core.errors import ConfigError, require

PAD, BOS, SEP, PLUS = 0, 1, 2, 3
FIRST = 4  # a task's symbols come after these
EVAL_SEED = 1729  # evaluation instances never depend on the run's seed
FIXED_SET = 4099  # in the seeds of a fixed training set (and, + 1, of its epochs' orders)
VERSION = 2  # bump when a generator changes: it names the data in results.json (2: padded after)


@dataclass
class TaskConfig(DatasetConfig):
    # 0: fresh instances at every step. N: one set of N instances drawn once from the run's seed,
    # read in a new shuffled order every epoch, as the references train (CoPE's counting: 10k
    # instances for 100 epochs); evaluation's instances are the same either way
    train_instances: int = 0


class Task(Dataset):
    """A generated task: its instances are made from `symbols` symbol tokens after the special
    ones; `min_size` is the smallest instance worth scoring."""
    Config = TaskConfig
    text = False
    symbols: ClassVar[int] = 16
    min_size: ClassVar[int] = 1

    @property
    def vocab_size(self) -> int:
        return FIRST + self.symbols

    def parameters(self) -> dict:
        """What the generator draws from: with the task's name and VERSION, they name its data."""
        return {"symbols": self.symbols}

    def prepare(self) -> TaskData:
        spec = ", ".join(f"{key}={value!r}" for key, value in self.parameters().items())
        identity = f"{self.cfg.name},{type(self).__name__}({spec}),version={VERSION}"
        digest = hashlib.sha256(identity.encode()).hexdigest()
        return TaskData(self, self.cfg.name, f"sha256:{digest}", self.vocab_size)

    @classmethod
    def check(cls, cfg, run_cfg) -> None:
        super().check(cfg, run_cfg)
        require(not cfg.bos, "dataset.bos", cfg.bos,
                f"false for dataset={cfg.name} (each instance starts with its own BOS token)")
        require(cfg.train_instances >= 0, "dataset.train_instances", cfg.train_instances,
                "an integer >= 0 (0: fresh instances at every step)")

    def size(self, total: int) -> int:
        """The largest size of an instance that fits `total` tokens."""
        raise NotImplementedError

    def make(self, rng: np.random.Generator, size: int) -> Tuple[np.ndarray, np.ndarray]:
        """One instance: its tokens and which of them are answers."""
        raise NotImplementedError

    def fits(self, total: int) -> str:
        """Why `total` tokens cannot hold an instance; empty when they can."""
        return "" if self.size(total) >= self.min_size else "too short for one instance"

    def draw(self, rng: np.random.Generator, n: int) -> np.ndarray:
        return rng.integers(FIRST, FIRST + self.symbols, size=n)

    def batch(self, rng: np.random.Generator, count: int, total: int, fill: bool):
        """`count` rows of `total` tokens, each an instance from position 0 and PAD after it:
        instances of the largest size that fits (fill) or of sizes drawn uniformly up to it."""
        top = self.size(total)
        tokens = np.full((count, total), PAD, dtype=np.int64)
        answers = np.zeros((count, total), dtype=bool)
        for row in range(count):
            seq, answer = self.make(rng, top if fill else int(rng.integers(self.min_size, top + 1)))
            tokens[row, :len(seq)] = seq
            answers[row, :len(seq)] = answer
        return tokens, answers


def marked(parts, answer_from: int) -> Tuple[np.ndarray, np.ndarray]:
    """The parts joined into one instance, its tokens from `answer_from` on the answers."""
    seq = np.concatenate([np.atleast_1d(p) for p in parts]).astype(np.int64)
    answer = np.zeros(len(seq), dtype=bool)
    answer[answer_from:] = True
    return seq, answer


@register("task_copy", "copy k random symbols after a separator; exact-match accuracy by length")
class Copy(Task):
    """BOS x1..xk SEP x1..xk: the second copy is the answer."""

    def size(self, total):
        return (total - 2) // 2

    def make(self, rng, size):
        x = self.draw(rng, size)
        return marked([BOS, x, SEP, x], size + 2)


@register("task_reverse", "write k random symbols in reverse after a separator; exact-match "
          "accuracy by length")
class Reverse(Task):
    """BOS x1..xk SEP xk..x1."""

    def size(self, total):
        return (total - 2) // 2

    def make(self, rng, size):
        x = self.draw(rng, size)
        return marked([BOS, x, SEP, x[::-1]], size + 2)


@register("task_recall", "associative recall of every key's value, keys queried in a new order; "
          "exact match")
class Recall(Task):
    """Associative recall: BOS k1 v1 .. kp vp SEP then every key again, in a new order, each
    followed by its value (the answers). Values are the symbols; keys, distinct within an
    instance, have tokens of their own, and their number bounds the length."""
    keys: ClassVar[int] = 1024

    @property
    def vocab_size(self) -> int:
        return FIRST + self.symbols + self.keys

    def parameters(self) -> dict:
        return {**super().parameters(), "keys": self.keys}

    def size(self, total):
        return (total - 2) // 4

    def fits(self, total):
        if self.size(total) > self.keys:
            return f"more than the {4 * self.keys + 5} that {self.keys} distinct keys fill"
        return super().fits(total)

    def make(self, rng, size):
        keys = rng.choice(self.keys, size, replace=False) + FIRST + self.symbols
        values = self.draw(rng, size)
        order = rng.permutation(size)
        seq = np.concatenate([[BOS], np.stack([keys, values], 1).ravel(), [SEP],
                              np.stack([keys[order], values[order]], 1).ravel()])
        answer = np.zeros(len(seq), dtype=bool)
        answer[2 * size + 3::2] = True  # the values after the separator
        return seq.astype(np.int64), answer


@register("task_induction", "a random block repeated, each token equal to the one N back (N per "
          "example); exact match")
class Induction(Task):
    """Look back N: BOS then a random block of N tokens repeated; every token after the first
    block is an answer, equal to the token N back. N is drawn per instance, up to half of it."""
    min_size = 2

    def size(self, total):
        return total - 1

    def make(self, rng, size):
        lag = int(rng.integers(1, size // 2 + 1))
        return marked([BOS, np.resize(self.draw(rng, lag), size)], 1 + lag)


@register("task_addition", "multi-digit addition, digits least significant first; exact-match "
          "accuracy by length")
class Addition(Task):
    """BOS a PLUS b SEP c with c = a + b, all d-digit numbers written least significant digit
    first (so a carry flows left to right, the order the model writes in); c has d+1 digits."""
    symbols = 10

    def size(self, total):
        return (total - 4) // 3

    def make(self, rng, size):
        a, b = rng.integers(0, 10, size), rng.integers(0, 10, size)
        digits, carry = [], 0
        for x, y in zip(a.tolist(), b.tolist()):
            carry, digit = divmod(x + y + carry, 10)
            digits.append(digit)
        digits.append(carry)
        return marked([BOS, a + FIRST, PLUS, b + FIRST, SEP, np.array(digits) + FIRST],
                      2 * size + 3)


def window_for(task: Task, size: int) -> int:
    """The length n whose windows (n + 1 tokens, inputs and targets) hold instances of `size`
    exactly: the shortest with task.size(n + 1) >= size."""
    n = 1
    while task.size(n + 1) < size:
        n += 1
        if n > 1 << 20:
            raise ConfigError(f"posbench.task_window:{size} is not accepted: no window of up to "
                              f"2^20 tokens holds an instance of that size; expected a smaller "
                              f"size")
    return n


def _task_window(sizes, *, _root_):
    """`${posbench.task_window:20}` (or a list of sizes): the length whose windows hold instances
    of that size of the run's task, so that a task's lengths can be given in its own size."""
    task = build_dataset(_root_.dataset)
    if not isinstance(task, Task):
        raise ConfigError(f"posbench.task_window is not accepted for dataset="
                          f"{_root_.dataset.name}; expected a task dataset (dataset=task_...)")
    if isinstance(sizes, (list, ListConfig)):
        return [window_for(task, int(s)) for s in sizes]
    return window_for(task, int(sizes))


OmegaConf.register_new_resolver("posbench.task_window", _task_window, replace=True)


@functools.lru_cache(maxsize=4)
def _epoch_order(count: int, seed: int, epoch: int) -> np.ndarray:
    """The order in which epoch `epoch` reads a fixed set of `count` instances."""
    return np.random.default_rng([seed, FIXED_SET + 1, epoch]).permutation(count)


@dataclass
class TaskData:
    """A task dataset: no token file, instances are generated when asked for."""
    task: Task
    name: str
    fingerprint: str
    vocab_size: int
    _sets: dict = field(default_factory=dict, repr=False)  # the fixed training sets, by window

    def check(self, total: int, key: str) -> None:
        why = self.task.fits(total)
        if why:
            raise ConfigError(f"{key} is not accepted for dataset={self.name}: a window of {total} "
                              f"tokens is {why}; expected another length")

    def check_train_len(self, seq_len: int, packed: bool = False) -> None:
        # packed: refused for tasks before this (posbench/config.py)
        self.check(seq_len + 1, f"train.seq_len={seq_len}")

    def train_batch(self, seq_len: int, batch_size: int, seed: int, step: int, plant=None):
        """Instances of every size up to the window: fresh ones seeded by (seed, step), or rows
        of the fixed set (dataset.train_instances); no passkeys are planted in a task
        (train.retrieval_mix and ruler_mix are refused for it)."""
        assert plant is None
        count = self.task.cfg.train_instances
        if count:
            tokens, answers = self._fixed_set(seq_len, seed, count)
            rows = [_epoch_order(count, seed, epoch)[i] for epoch, i in
                    (divmod(p, count) for p in range(step * batch_size, (step + 1) * batch_size))]
            tokens, answers = tokens[rows], answers[rows]
        else:
            rng = np.random.default_rng([seed, step])
            tokens, answers = self.task.batch(rng, batch_size, seq_len + 1, fill=False)
        # train on the answers alone, the tokens evaluation scores: the inputs are random
        targets = np.where(answers[:, 1:], tokens[:, 1:], IGNORE)
        return torch.from_numpy(tokens[:, :-1]), torch.from_numpy(targets)

    def _fixed_set(self, seq_len: int, seed: int, count: int):
        """The run's set of `count` training instances for windows of seq_len + 1 tokens, drawn
        once (a length schedule gets a set per window)."""
        key = (seq_len, seed, count)
        if key not in self._sets:
            rng = np.random.default_rng([seed, FIXED_SET, seq_len])
            self._sets[key] = self.task.batch(rng, count, seq_len + 1, fill=False)
        return self._sets[key]

    def eval_instances(self, length: int, tokens: int):
        """ceil(tokens / length) instances filling length + 1 tokens (inputs and targets)."""
        rng = np.random.default_rng([EVAL_SEED, length])
        return self.task.batch(rng, math.ceil(tokens / length), length + 1, fill=True)

    def eval_plan(self, length: int, eval_cfg, protocol) -> EvalPlan:
        """One instance per window, every answer scored (the protocol scores whole windows: the
        others are refused for a task)."""
        self.check(length + 1, f"eval.lengths entry {length}")
        instances, answers = self.eval_instances(length, eval_cfg.tokens)
        return EvalPlan(length, len(instances), 0,
                        lambda i, j: (instances[i:j], answers[i:j, 1:]))
