"""Which keys a query sees: a layer's attention span (model.attention, or per layer kind in a
`layers` pattern; docs/design.md#the-encoding-contract).

- global: the causal prefix, j <= i;
- sliding: the w most recent keys, i - w < j <= i (Mistral's and Cohere's sliding window);
- chunked: the keys of the query's own chunk of w tokens, j // w == i // w and j <= i (Llama 4's
  chunked attention).

i and j are sequence indices, never position ids, as for the causal mask: a span is the same for
every encoding and every position offset.
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


def default_width(train_len: int) -> int:
    return max(1, train_len // DEFAULT_WIDTH_FRACTION)


@dataclass(frozen=True)
class Span:
    kind: str = "global"
    width: Optional[int] = None  # w, for sliding and chunked

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
        return i + 1

    def mask_mod(self):
        """FlexAttention's mask_mod (a plain function: it counts the arguments)."""
        return lambda b, h, q_idx, kv_idx: self.visible(q_idx, kv_idx)


GLOBAL = Span()
