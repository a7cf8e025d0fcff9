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
window of a document's piece. How many segments of each length training attended within is what
STRING's position frequency counts (posbench/reports/position_frequency.py): `window_steps` gives
it from the config under a schedule alone; the documents' cut depends on the data, so training
counts it (`SegmentCount`).
"""
from __future__ import annotations

from typing import Callable, Dict, Optional

import torch


def window_at(step: int, t) -> int:
    """The attention window of training step `step` (0-based): L without a schedule."""
    if t.get("length_schedule", "none") == "none":  # absent from runs saved before it existed
        return t.seq_len
    return min(t.seq_len, t.length_start + step // t.length_every)


def window_steps(steps: int, t) -> Dict[int, int]:
    """{window: how many of the steps 0..steps-1 train at it}, in the order of the steps (the
    window never shrinks): window_at's windows counted in closed form, one term per window.
    `t`: the train config, or results.json's config.train."""
    length = t["seq_len"]
    if t.get("length_schedule", "none") == "none":
        return {length: steps}
    first, every = t["length_start"], t["length_every"]
    # window w < L holds the steps (w - first) k .. (w - first + 1) k - 1; L all those after
    counts = {w: min(steps, (w - first + 1) * every) - (w - first) * every
              for w in range(first, length)}
    counts[length] = steps - (length - first) * every
    return {w: n for w, n in counts.items() if n > 0}


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


def segment_lengths(segments: torch.Tensor) -> torch.Tensor:
    """The length of every segment of every row of `segments` ((B, L), a label per token, each
    segment's labels contiguous), as one 1-D tensor."""
    starts = torch.ones_like(segments, dtype=torch.bool)
    starts[:, 1:] = segments[:, 1:] != segments[:, :-1]
    first = starts.flatten().nonzero().squeeze(1)  # a row's first token always starts one
    return torch.diff(first, append=torch.tensor([segments.numel()]))


class SegmentCount:
    """How many segments of each length 1..L training attended within, where the cut depends on
    the data (train.pack_documents): results.json's train.segment_lengths, kept in the checkpoint
    so that a resumed run counts exactly as an uninterrupted one."""

    def __init__(self, seq_len: int, saved: Optional[torch.Tensor] = None):
        self.counts = torch.zeros(seq_len + 1, dtype=torch.long) if saved is None else saved.clone()

    def add(self, segments: torch.Tensor) -> None:
        self.counts += torch.bincount(segment_lengths(segments), minlength=len(self.counts))

    def record(self) -> Dict[str, int]:
        """{length: count} with JSON's string keys, the lengths that occurred."""
        return {str(n): c for n, c in enumerate(self.counts.tolist()) if c}
