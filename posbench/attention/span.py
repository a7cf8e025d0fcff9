"""Which keys a query sees: a layer's attention span (model.attention, or per layer kind in a
`layers` pattern; docs/design.md#the-encoding-contract).

- global: the causal prefix, j <= i;
- sliding: the w most recent keys, i - w < j <= i (Mistral's and Cohere's sliding window);
- chunked: the keys of the query's own chunk of w tokens, j // w == i // w and j <= i (Llama 4's
  chunked attention);
- lambda, at evaluation only (eval.attention): the first n keys and the w most recent,
  (j < n or i - j < w) and j <= i, StreamingLLM's attention sinks and window and LM-Infinite's
  Lambda-shaped mask, in place of a global layer's causal prefix (lambda_span).

i and j are sequence indices, never position ids, as for the causal mask: a span is the same for
every encoding and every position offset.

In training, a sequence may be cut into segments (train.pack_documents' documents,
train.length_schedule's windows; posbench/runs/lengths.py): `Segmented` narrows a layer's span to
the keys of the query's own segment.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch

ATTENTIONS = ("global", "sliding", "chunked")
# model.attention_window=null: a local span is a quarter of the training length L, so that local
# layers are trained at their span (four spans per training window) and see no distance past it
# at any evaluated length (docs/design.md#the-encoding-contract says why)
DEFAULT_WIDTH_FRACTION = 4
# eval.attention: each global layer's span at evaluation
EVAL_ATTENTIONS = ("global", "lambda")
# eval.lambda_sinks=null: StreamingLLM's 4 initial tokens (run_streaming_llama.py's start_size;
# LM-Infinite's global branch is 10 to 100 tokens, "generally similar effect" in its README)
LAMBDA_SINKS = 4


def default_width(train_len: int) -> int:
    return max(1, train_len // DEFAULT_WIDTH_FRACTION)


@dataclass(frozen=True)
class Span:
    kind: str = "global"
    width: Optional[int] = None  # w, for sliding, chunked and lambda
    sinks: int = 0  # lambda's first keys, which every query sees

    @property
    def bounded(self) -> bool:
        """Whether each query's keys lie within the last w indices (sliding, chunked)."""
        return self.kind in ("sliding", "chunked")

    @property
    def is_global(self) -> bool:
        return self.kind == "global"

    def visible(self, q_idx, kv_idx):
        """Whether query q_idx sees key kv_idx: elementwise on broadcastable index tensors, or on
        FlexAttention's scalars (its mask_mod)."""
        causal = q_idx >= kv_idx
        if self.kind == "sliding":
            return causal & (q_idx - kv_idx < self.width)
        if self.kind == "chunked":
            return causal & (q_idx // self.width == kv_idx // self.width)
        if self.kind == "lambda":
            return causal & ((q_idx - kv_idx < self.width) | (kv_idx < self.sinks))
        return causal

    def hidden(self, q_idx, kv_idx):
        """The keys masked for each query: future keys and keys outside the span."""
        return ~self.visible(q_idx, kv_idx)

    def first_key(self, q: int) -> int:
        """The first key index that query q (and every later query) can see."""
        if self.kind == "sliding":
            return max(0, q - self.width + 1)
        if self.kind == "chunked":
            return q // self.width * self.width
        return 0

    def visible_keys(self, n: int, device=None) -> torch.Tensor:
        """(n,) float64: how many keys each query index 0..n-1 sees."""
        i = torch.arange(n, dtype=torch.float64, device=device)
        if self.kind == "sliding":
            return (i + 1).clamp(max=self.width)
        if self.kind == "chunked":
            return i % self.width + 1
        if self.kind == "lambda":  # the window, and the sinks that lie before it
            return (i + 1).clamp(max=self.width) + (i + 1 - self.width).clamp(0, self.sinks)
        return i + 1

    def mask_mod(self):
        """FlexAttention's mask_mod (a plain function: it counts the arguments)."""
        return lambda b, h, q_idx, kv_idx: self.visible(q_idx, kv_idx)

    # FlexAttention's block mask: one for the whole batch (None), cached by the span
    rows = None


GLOBAL = Span()


@dataclass(frozen=True, eq=False)
class Segmented:
    """`span` within segments: query i of sequence b sees key j where the span shows it and
    segments[b, i] == segments[b, j]. segments (B, T) long, nondecreasing along each row. It
    keeps the span's bounds on which keys a block of queries needs (a segment only hides more),
    and is never global: the paths that assume the causal prefix do not take it."""
    span: Span
    segments: torch.Tensor

    is_global = False

    @property
    def bounded(self) -> bool:
        return self.span.bounded

    @property
    def width(self) -> Optional[int]:
        return self.span.width

    @property
    def rows(self) -> int:  # a block mask per sequence
        return self.segments.shape[0]

    def first_key(self, q: int) -> int:
        return self.span.first_key(q)

    def visible(self, q_idx, kv_idx):
        """On the blockwise path's index tensors (1, 1, Tq, 1) and (1, 1, 1, Tk): (B, 1, Tq, Tk)."""
        B = self.segments.shape[0]
        same = (self.segments[:, q_idx.reshape(-1)].view(B, 1, -1, 1)
                == self.segments[:, kv_idx.reshape(-1)].view(B, 1, 1, -1))
        return self.span.visible(q_idx, kv_idx) & same

    def hidden(self, q_idx, kv_idx):
        return ~self.visible(q_idx, kv_idx)

    def mask_mod(self):
        segments, span = self.segments, self.span
        return lambda b, h, q_idx, kv_idx: (span.visible(q_idx, kv_idx)
                                            & (segments[b, q_idx] == segments[b, kv_idx]))


def lambda_span(train_len: int, sinks: Optional[int] = None,
                window: Optional[int] = None) -> Span:
    """eval.attention=lambda at training length L: the first `sinks` keys (null: LAMBDA_SINKS)
    and the `window` most recent (null: L - sinks, so that no query sees more than L keys, as
    StreamingLLM's cache is at most the training length). No sinks: the sliding window alone,
    StreamingLLM's window-attention baseline."""
    sinks = LAMBDA_SINKS if sinks is None else sinks
    window = window or max(1, train_len - sinks)
    return Span("lambda", window, sinks) if sinks else Span("sliding", window)
