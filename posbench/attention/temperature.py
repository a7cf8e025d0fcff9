"""Softmax temperature by length: a factor on each query row, q_i <- tau_i * q_i, so that row i's
logits q_i . k_j scale by tau_i (docs/encodings.md#softmax-temperature). One option,
model.temperature (per layer kind in a `layers` pattern), and eval.temperature to re-score a
trained model with a fixed kind.

With L the training length, i the query's sequence index, n_i the keys it sees (i + 1, or fewer
under a local span) and n the sequence length:

- none:            1
- logn:            max(1, ln n_i / ln L)                       (Qwen's logn_attn)
- ssmax:           s_h ln n_i, s_h learned per head            (Scalable-Softmax)
- llama4_floorlog: 1 + 0.1 ln(floor((i + 1) / F) + 1), F = L   (Llama 4's NoPE layers, F = 8192)
- yarn:            (0.1 ln s + 1)^2, s = max(1, n / L)          (YaRN's attention factor, squared:
                                                               it multiplies q and k)
- drope_beta:      1 + c ln(max(1, n / L)), c = 0.412           (DroPE's beta*)

Every fixed kind is 1 at every query of a sequence of at most L tokens but for floorlog's last
(i + 1 = L gives 1 + 0.1 ln 2, as Llama 4's at position 8191), so training at L is untouched and
they act where the model extrapolates; ssmax is trained.
"""
from __future__ import annotations

import math
from typing import Optional

import torch
from torch import nn

from posbench.attention.span import GLOBAL, Span

TEMPERATURES = ("none", "logn", "ssmax", "llama4_floorlog", "yarn", "drope_beta")
LEARNED = ("ssmax",)
# Scalable-Softmax's s at the start of training: the value the paper illustrates SSMax with, and
# the default of the pip package scalable-softmax
SSMAX_INIT = 0.43
# Llama 4's attn_scale (its floor_scale F, 8192 tokens, becomes the training length L here)
FLOORLOG_SCALE = 0.1
# YaRN's 0.1 in sqrt(1/t) = 0.1 ln s + 1
YARN_SLOPE = 0.1
# DroPE's c for its model trained from scratch, fitted on held-out text at the target length
DROPE_C = 0.412


def temperature_factor(kind: str, n: int, train_len: int, span: Span = GLOBAL,
                       s: Optional[torch.Tensor] = None, device=None) -> Optional[torch.Tensor]:
    """(H or 1, n, 1) factors tau_i of query rows 0..n-1 (float64, or s's dtype for ssmax), or
    None for `none`. `s`: SSMax's (H,) scales."""
    if kind == "none":
        return None
    if kind in ("yarn", "drope_beta"):
        ratio = math.log(max(1.0, n / train_len))
        value = (YARN_SLOPE * ratio + 1) ** 2 if kind == "yarn" else 1 + DROPE_C * ratio
        return torch.full((1, n, 1), value, dtype=torch.float64, device=device)
    i = torch.arange(n, dtype=torch.float64, device=device)
    if kind == "llama4_floorlog":
        return (1 + FLOORLOG_SCALE * torch.log1p(torch.floor((i + 1) / train_len))).view(1, n, 1)
    log_seen = span.visible_keys(n, device).log()
    if kind == "logn":
        return (log_seen / math.log(train_len)).clamp(min=1).view(1, n, 1)
    if kind == "ssmax":
        return s.view(-1, 1, 1) * log_seen.to(s.dtype).view(1, n, 1)
    raise ValueError(f"temperature={kind!r} is not implemented")


class Temperature(nn.Module):
    """One layer's temperature: its kind, and SSMax's learned s per head."""

    def __init__(self, kind: str, n_head: int, span: Span = GLOBAL):
        super().__init__()
        self.kind, self.span = kind, span
        self.learned = kind in LEARNED
        if kind == "ssmax":
            self.s = nn.Parameter(torch.full((n_head,), SSMAX_INIT))

    def forward(self, q: torch.Tensor, train_len: int, override: Optional[str] = None):
        """q (B, H, T, d) with each row scaled by its factor; `override` (eval.temperature) takes
        the place of a fixed kind, never of a learned one."""
        kind = override if override is not None and not self.learned else self.kind
        factor = temperature_factor(kind, q.shape[2], train_len, self.span,
                                    getattr(self, "s", None), q.device)
        return q if factor is None else q * factor.to(q.dtype)
