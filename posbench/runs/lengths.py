"""Length schedules in training (docs/design.md#length-schedules): which tokens of a training
sequence attend to each other, and at which positions.

- train.length_schedule=skyladder (Zhu et al. 2025, SkyLadder): at step t each sequence is cut
  into windows of w(t) = min(L, length_start + floor(t / length_every)) tokens, from its first
  token on (the last window may be shorter), and attention stays within a window. Positions stay
  0..L-1 and every target is trained: only the attention is cut, as SkyLadder's reference code
  does. w is a function of the step alone, so a resumed run cuts exactly as an uninterrupted one.
- train.pack_documents: rows of the training documents back to back
  (posbench/data/tokens.py: TokenData.document_batch); attention stays within each document's
  piece of the row, whose positions restart at 0.

Both cut a row into segments (posbench/attention/span.py: Segmented); together, a segment is a
window of a document's piece.
"""
from __future__ import annotations

from typing import Callable, Optional

import torch

def window_at(step: int, t) -> int:
    """The attention window of training step `step` (0-based): L without a schedule."""
    if t.get("length_schedule", "none") == "none":  # absent from runs saved before it existed
        return t.seq_len
    return min(t.seq_len, t.length_start + step // t.length_every)


def training_batch(data, cfg, step: int, plant: Optional[Callable] = None):
    """Inputs, targets, positions and segments (each (B, L); positions None: 0..L-1, segments
    None: no cut) of training step `step`, a function of (seed, step) alone."""
    t = cfg.train
    if t.get("pack_documents", False):
        x, y, pos, segments = data.document_batch(t.seq_len, t.batch_size, cfg.seed, step)
    else:
        x, y = data.train_batch(t.seq_len, t.batch_size, cfg.seed, step, plant)
        pos = segments = None
    window = window_at(step, t)
    if window < t.seq_len:
        windows = torch.arange(t.seq_len) // window
        # (document piece, window) pairs, numbered in order along the row
        segments = (windows.expand(x.shape[0], -1) if segments is None
                    else segments * -(-t.seq_len // window) + windows)
    return x, y, pos, segments
