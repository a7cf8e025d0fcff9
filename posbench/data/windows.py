"""Which tokens a step trains on and which windows evaluation scores. Windows never cross a
document boundary, so a long window is really one long context (dataset.val_stream joins the
validation documents into one). A task dataset generates its instances instead
(posbench/data/tasks.py): one window, one instance. Under dataset.bos every window's first token
is the BOS token (data.bos), and the prediction made at it, of the window's second token from BOS
alone, is neither trained (its target is IGNORE) nor scored (EvalPlan.first >= 1)."""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable, Optional, Tuple

import numpy as np
import torch

from posbench.errors import ConfigError
from posbench.data.tasks import IGNORE, TaskData


def _starts_within(docs: np.ndarray, span: int) -> tuple:
    """Per document, how many windows of `span` tokens start inside it."""
    lengths = np.diff(docs)
    return docs[:-1], np.maximum(lengths - span + 1, 0)


def check_train_len(data, seq_len: int) -> None:
    if isinstance(data, TaskData):
        return data.check(seq_len + 1, f"train.seq_len={seq_len}")
    if data.longest("train") < seq_len + 1:
        raise ConfigError(f"train.seq_len={seq_len} is not accepted; the longest training "
                          f"document of {data.name} has {data.longest('train')} tokens, expected "
                          f"<= {data.longest('train') - 1}")


def train_batch(data, seq_len: int, batch_size: int, seed: int, step: int,
                plant: Optional[Callable[[np.ndarray, int, int], None]] = None):
    """Batch `step` of a seeded run: uniform over all windows inside training documents. It depends
    on (seed, step) alone, so a resumed run sees exactly the batches it would have seen. `plant`
    (train.retrieval_mix: posbench/retrieval.py, mix_rows) replaces some rows in place, from its
    own generator of (seed, step)."""
    if isinstance(data, TaskData):
        x, y = data.train_batch(seq_len, batch_size, seed, step)
        return torch.from_numpy(x), torch.from_numpy(y)
    rng = np.random.default_rng([seed, step])
    first, counts = _starts_within(data.train_docs, seq_len + 1)
    cum = np.cumsum(counts)
    picks = rng.integers(0, cum[-1], size=batch_size)
    doc = np.searchsorted(cum, picks, side="right")
    starts = first[doc] + picks - (cum[doc] - counts[doc])
    rows = np.stack([data.tokens[s:s + seq_len + 1] for s in starts]).astype(np.int64)
    if plant is not None:
        plant(rows, seed, step)
    rows = torch.from_numpy(with_bos(rows, data))
    x, y = rows[:, :-1], rows[:, 1:]
    if data.bos is not None:
        y = y.clone()
        y[:, 0] = IGNORE  # the prediction made at BOS
    return x, y


def with_bos(rows: np.ndarray, data) -> np.ndarray:
    """Windows (B, n+1) with their first token replaced by data.bos under dataset.bos (as int64:
    BOS is one id past the token file's dtype)."""
    if data.bos is not None:
        rows = rows.astype(np.int64, copy=False)
        rows[:, 0] = data.bos
    return rows


def _spread(candidates: list, need: int, what: str, data, length: int, tokens: int) -> np.ndarray:
    """`need` of the candidate start offsets, spread evenly over all of them. Deterministic, so
    every encoding scores the same windows."""
    candidates = np.concatenate(candidates) if candidates else np.zeros(0, dtype=np.int64)
    if len(candidates) < need:
        raise ConfigError(
            f"eval.lengths entry {length} is not accepted with eval.tokens={tokens}: the "
            f"validation documents of {data.name} hold {len(candidates)} {what}, {need} are "
            "needed; lower the length or eval.tokens")
    return candidates[np.linspace(0, len(candidates) - 1, need).round().astype(np.int64)]


def eval_windows(data, length: int, tokens: int) -> np.ndarray:
    """Start offsets of ceil(tokens/length) nonoverlapping validation windows of length+1 tokens,
    spread evenly over all that fit."""
    if isinstance(data, TaskData):
        data.check(length + 1, f"eval.lengths entry {length}")
        return np.arange(math.ceil(tokens / length))
    span = length + 1
    candidates = [start + span * np.arange(n // span)
                  for start, n in zip(data.val_docs[:-1], np.diff(data.val_docs))]
    return _spread(candidates, math.ceil(tokens / length), f"windows of {span} tokens", data,
                   length, tokens)


def scored_block(eval_cfg) -> Optional[int]:
    """Tokens scored at the end of each window, None for all of them."""
    if eval_cfg.protocol == "nonoverlapping":
        return None
    return eval_cfg.stride or min(eval_cfg.lengths)


@dataclass
class EvalPlan:
    """What evaluation scores at one length: `count` windows of length+1 tokens (inputs, then
    targets shifted by one); in each, the targets from position `first` on are scored, and of a
    task's windows only the answers."""
    length: int
    count: int
    first: int
    rows: Callable[[int, int], Tuple[np.ndarray, Optional[np.ndarray]]]  # windows i..j
    starts: Optional[np.ndarray] = None  # where each window starts in data.tokens (not tasks)


def eval_plan(data, length: int, eval_cfg) -> EvalPlan:
    """Per protocol (the same windows for every encoding):
    nonoverlapping: ceil(tokens/length) disjoint windows, every target scored;
    sliding: windows every `stride` tokens, each scoring its last `stride` targets, which so get
      at least length-stride tokens of context; ceil(tokens/stride) windows;
    growing_context: the same final blocks of `stride` (default min(lengths)) targets at every
      length, with `length` tokens of context: only the context grows."""
    protocol, tokens = eval_cfg.protocol, eval_cfg.tokens
    if isinstance(data, TaskData):
        data.check(length + 1, f"eval.lengths entry {length}")
        instances, answers = data.eval_instances(length, tokens)
        return EvalPlan(length, len(instances), 0,
                        lambda i, j: (instances[i:j], answers[i:j, 1:]))
    block = scored_block(eval_cfg)
    docs = zip(data.val_docs[:-1], np.diff(data.val_docs))
    if protocol == "nonoverlapping":
        starts = eval_windows(data, length, tokens)
    elif protocol == "sliding":
        starts = _spread([s + block * np.arange((n - length - 1) // block + 1)
                          for s, n in docs if n > length], math.ceil(tokens / block),
                         f"windows of {length + 1} tokens every {block}", data, length, tokens)
    else:  # growing_context: block ends placed where the longest context fits
        longest = max(eval_cfg.lengths)
        ends = _spread([s + longest + 1 + block * np.arange((n - longest - 1) // block + 1)
                        for s, n in docs if n > longest], math.ceil(tokens / block),
                       f"blocks of {block} tokens after {longest} of context", data, length,
                       tokens)
        starts = ends - length - 1
    first = 0 if block is None else length - block
    if data.bos is not None:
        first = max(first, 1)  # the prediction made at BOS is not scored
    return EvalPlan(length, len(starts), first, lambda i, j: (with_bos(
        np.stack([data.tokens[s:s + length + 1] for s in starts[i:j]]), data), None), starts)
