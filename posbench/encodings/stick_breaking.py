"""Stick-breaking attention (Tan et al. 2025): the weights come from breaking a stick over the keys
from the nearest to the farthest, not from a softmax, and no position is encoded
(docs/encodings.md#contextual-family).

With z_ij = q_i.k_j / sqrt(d) and β_ij = σ(z_ij), key j < i takes

    A_ij = β_ij Π_{j<k<i} (1 - β_ik),

the share of the stick that the nearer keys left, and the stick left after the farthest key,
1 - Σ_j A_ij = Π_{k<i} (1 - β_ik), goes to the query's own value, as the reference's forward
adds rem * v. Logs: log A_ij = log σ(z_ij) + Σ_{j<k<i} log σ(-z_ik).

As a row_mod: the row's logits become log A_ij for j < i and the log of the leftover at j = i.
These weights sum to 1, so the attention's softmax returns them unchanged (exp(m - logsumexp m)
with logsumexp m = 0 for every q, k, so its gradient is the weights' own).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from posbench.encodings.base import EncodingConfig, PositionalEncoding, register
from posbench.encodings.grape_ap import path_sum


def stick_breaking(scores: torch.Tensor, q_idx: torch.Tensor, kv_idx: torch.Tensor):
    """log A (..., Tq, Tk), -inf for keys j >= i, and the log of the leftover 1 - Σ_j A_ij
    (..., Tq, 1), from scores z; query row r sits at sequence index q_idx[r]."""
    before = kv_idx < q_idx
    keep = F.logsigmoid(-scores).masked_fill(~before, 0.0)  # log(1 - β_ik), keys k < i
    weights = (F.logsigmoid(scores) + path_sum(keep)).masked_fill(~before, float("-inf"))
    return weights, keep.sum(-1, keepdim=True)


@register("stick_breaking", "stick-breaking attention: key j takes σ(z_ij) of the stick the "
                            "nearer keys left, the rest goes to the query's own value; no softmax")
class StickBreaking(PositionalEncoding):
    family = "contextual"
    relative = True
    past_train_len = ("no positions: recency comes from the keys nearer the query, so far keys "
                      "get what the near ones leave at any length")
    reference = ("Scaling Stick-Breaking Attention: An Efficient Implementation and In-depth "
                 "Study (Tan et al. 2025)")

    @dataclass
    class Config(EncodingConfig):
        pass

    def row_mod(self, logits, q, k, pos, layer, q_idx, kv_idx):
        weights, leftover = stick_breaking(logits, q_idx, kv_idx)
        return torch.where(kv_idx == q_idx, leftover, weights)

    def flops(self, batch, length, pairs):
        # per score: log σ(-z) and log σ(z), the reverse running sum of the first, the leftover's
        # sum (7 operations)
        return self.dims.n_layer * batch * self.dims.n_head * 7 * pairs
