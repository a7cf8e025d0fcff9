"""Which tokens a step trains on and which windows evaluation scores. Windows never cross a
document boundary, so a long window is really one long context."""
from __future__ import annotations

import math

import numpy as np
import torch

from posbench.config import ConfigError
from posbench.data.tokens import TokenData


def _starts_within(docs: np.ndarray, span: int) -> tuple:
    """Per document, how many windows of `span` tokens start inside it."""
    lengths = np.diff(docs)
    return docs[:-1], np.maximum(lengths - span + 1, 0)


def check_train_len(data: TokenData, seq_len: int) -> None:
    if data.longest("train") < seq_len + 1:
        raise ConfigError(f"train.seq_len={seq_len} is not accepted; the longest training "
                          f"document of {data.name} has {data.longest('train')} tokens, expected "
                          f"<= {data.longest('train') - 1}")


def train_batch(data: TokenData, seq_len: int, batch_size: int, seed: int, step: int):
    """Batch `step` of a seeded run: uniform over all windows inside training documents. It depends
    on (seed, step) alone, so a resumed run sees exactly the batches it would have seen."""
    rng = np.random.default_rng([seed, step])
    first, counts = _starts_within(data.train_docs, seq_len + 1)
    cum = np.cumsum(counts)
    picks = rng.integers(0, cum[-1], size=batch_size)
    doc = np.searchsorted(cum, picks, side="right")
    starts = first[doc] + picks - (cum[doc] - counts[doc])
    rows = np.stack([data.tokens[s:s + seq_len + 1] for s in starts]).astype(np.int64)
    rows = torch.from_numpy(rows)
    return rows[:, :-1], rows[:, 1:]


def eval_windows(data: TokenData, length: int, tokens: int) -> np.ndarray:
    """Start offsets of ceil(tokens/length) nonoverlapping validation windows of length+1 tokens,
    spread evenly over all that fit. Deterministic, so every encoding scores the same windows."""
    need = math.ceil(tokens / length)
    span = length + 1
    candidates = [start + span * np.arange(n // span)
                  for start, n in zip(data.val_docs[:-1], np.diff(data.val_docs))]
    candidates = np.concatenate(candidates) if candidates else np.zeros(0, dtype=np.int64)
    if len(candidates) < need:
        raise ConfigError(
            f"eval.lengths entry {length} is not accepted with eval.tokens={tokens}: the "
            f"validation documents of {data.name} hold {len(candidates)} windows of {span} tokens, "
            f"{need} are needed; lower the length or eval.tokens")
    return candidates[np.linspace(0, len(candidates) - 1, need).round().astype(np.int64)]
