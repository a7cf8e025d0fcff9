"""Windows of token documents: which tokens a step trains on and which windows evaluation scores
(TokenData's methods, posbench/data/tokens.py; the evaluation protocols choose the starts,
posbench/evaluations/). Windows never cross a document boundary, so a long window is really one
long context (dataset.val_stream joins the validation documents into one). Under dataset.bos
every window's first token is the BOS token (data.bos), and the prediction made at it, of the
window's second token from BOS alone, is neither trained (its target is IGNORE) nor scored
(EvalPlan.first >= 1)."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Optional, Tuple

import numpy as np

from posbench.core.errors import ConfigError

IGNORE = -100  # cross_entropy's ignore_index: a target that is not trained on


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


def starts_within(docs: np.ndarray, span: int) -> tuple:
    """Per document, its first offset and how many windows of `span` tokens start inside it."""
    lengths = np.diff(docs)
    return docs[:-1], np.maximum(lengths - span + 1, 0)


def spread(candidates: list, need: int, what: str, data, length: int, tokens: int) -> np.ndarray:
    """`need` of the candidate start offsets, spread evenly over all of them. Deterministic, so
    every encoding scores the same windows."""
    candidates = np.concatenate(candidates) if candidates else np.zeros(0, dtype=np.int64)
    if len(candidates) < need:
        raise ConfigError(
            f"eval.lengths entry {length} is not accepted with eval.tokens={tokens}: the "
            f"validation documents of {data.name} hold {len(candidates)} {what}, {need} are "
            "needed; lower the length or eval.tokens")
    return candidates[np.linspace(0, len(candidates) - 1, need).round().astype(np.int64)]


def share_tokens(starts, span: int, windows) -> np.ndarray:
    """For each window of `span` tokens at `starts`, whether it shares a token with one of
    `windows`, (starts, span) pairs of other windows."""
    other = np.concatenate([np.asarray(s, dtype=np.int64) for s, _ in windows])
    ends = other + np.concatenate([np.full(len(s), n, dtype=np.int64) for s, n in windows])
    starts = np.asarray(starts, dtype=np.int64)[:, None]
    return ((starts < ends) & (other < starts + span)).any(1)


def with_bos(rows: np.ndarray, bos: Optional[int]) -> np.ndarray:
    """Windows (B, n+1) with their first token replaced by `bos` under dataset.bos (as int64:
    BOS is one id past the token file's dtype)."""
    if bos is not None:
        rows = rows.astype(np.int64, copy=False)
        rows[:, 0] = bos
    return rows
