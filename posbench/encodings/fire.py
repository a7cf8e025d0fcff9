"""FIRE: a learned MLP of the log-lag, divided by the log of the query's span (Li et al. 2024).

b(i, j) = f(psi(i - j) / psi(max(L_thr, span_i)))_h,   psi(x) = log(|c x| + 1),
L_thr = |L_mult * L_init|. f is an MLP 1 -> width -> H (ReLU); f, c and L_mult are learned, one
set per layer. L_init is the training length, as in the paper, so that queries within the
training window keep an absolute scale at any training length (the port in mcleish7/arithmetic
fixes it at 512, its own training length); width 32 and c = 0.1 are that port's.

span_i is the query's distance to the first position of its sequence: the largest lag it can see.
The paper's sequences start at 0, where span_i = i, its normalizer, and so do posbench's runs. For
a sequence placed at an offset, the offset drops out, so FIRE is relative (SHIFT holds at every
offset) while lag / span still lies in [0, 1].
"""
import math
from dataclasses import dataclass
from typing import Optional

import torch
from torch import nn

from posbench.core.errors import ConfigError
from posbench.encodings.base import EncodingConfig, PositionalEncoding, relative_lag, register

EPS = 1e-6  # added to the normalizer


def psi(x: torch.Tensor, c: torch.Tensor) -> torch.Tensor:
    return torch.log1p((c * x).abs())


def _uniform(*shape, bound):
    return nn.Parameter(torch.empty(shape).uniform_(-bound, bound))


class FireMLP(nn.Module):
    """One layer's FIRE: f (1 -> width -> H), c and L_mult.

    The weights are plain parameters with nn.Linear's default init U(+-1/sqrt(fan_in)), the
    reference's layers: the GPT re-initializes nn.Linear modules, and the score_mod evaluates f
    one hidden unit at a time."""

    def __init__(self, n_head: int, width: int, init_c: float):
        super().__init__()
        self.w1 = _uniform(width, 1, bound=1.0)
        self.b1 = _uniform(width, bound=1.0)
        self.w2 = _uniform(n_head, width, bound=1 / math.sqrt(width))
        self.b2 = _uniform(n_head, bound=1 / math.sqrt(width))
        self.c = nn.Parameter(torch.tensor(init_c))
        self.l_mult = nn.Parameter(torch.tensor(1.0))

    def forward(self, x: torch.Tensor, h: torch.Tensor) -> torch.Tensor:
        """f(x)_h, summed unit by unit so that it stays elementwise (a FlexAttention score_mod
        cannot reduce over an extra axis) and never holds width x the scores at once."""
        out = self.b2[h]
        for unit in range(self.w1.shape[0]):
            out = out + self.w2[h, unit] * torch.relu(self.w1[unit, 0] * x + self.b1[unit])
        return out

    @torch.no_grad()
    def lines(self, low: float, high: float):
        """f on [low, high] as the line it is between consecutive breakpoints: a ReLU unit bends
        only where w1 x + b1 = 0. (breakpoints (K,) sorted, slopes (K+1, H), intercepts
        (K+1, H)) in float64; segment s lies between breakpoints s-1 and s. Breakpoints outside
        [low, high] are left out: x never crosses them."""
        w1, b1 = self.w1[:, 0].double(), self.b1.double()
        w2, b2 = self.w2.double(), self.b2.double()
        cuts = (-b1[w1 != 0] / w1[w1 != 0]).sort().values
        cuts = cuts[(cuts > low) & (cuts < high)]
        # one point inside each segment, within [low, high], tells which units are on there
        ends = torch.cat((cuts.new_tensor([low]), cuts, cuts.new_tensor([high])))
        inside = (ends[1:] + ends[:-1]) / 2
        active = (inside.unsqueeze(1) * w1 + b1 > 0).double()  # (K+1, width)
        return cuts, (active * w1) @ w2.T, b2 + (active * b1) @ w2.T

    @staticmethod
    def piecewise(x: torch.Tensor, lines) -> torch.Tensor:
        """f(x) for every head, (..., H, R, T) from x (..., 1, R, T), read from lines(): a
        segment look-up and one multiply-add per score where forward takes 3 x width
        operations. The look-ups are whole rows of the (H, segments) tables, which copy fast."""
        cuts, slopes, intercepts = (t.to(x.dtype) for t in lines)
        # at a breakpoint both lines agree (f is continuous): either segment will do
        segment = torch.bucketize(x, cuts).flatten()
        shape = (slopes.shape[1], *x.shape[:-3], *x.shape[-2:])  # heads first, then moved

        def look_up(table):
            return table.T.index_select(1, segment).view(shape).movedim(0, -3)

        return look_up(intercepts).addcmul_(look_up(slopes), x)


@register("fire", "learned MLP of log-lag over log of the query's span (progressive interpolation)")
class FIRE(PositionalEncoding):
    family = "bias"
    additive_score_mod = True
    relative = True
    past_train_len = "interpolates: lag/span maps every query into [0,1] at any length"
    reference = ("Functional Interpolation for Relative Positions Improves Long Context "
                 "Transformers (Li et al. 2024)")

    @dataclass
    class Config(EncodingConfig):
        width: int = 32
        init_c: float = 0.1
        # L_thr = |L_mult * init_L|, L_mult learned from 1; None: the training length
        init_L: Optional[float] = None

    @classmethod
    def check(cls, cfg, run_cfg):
        if cfg.width < 1:
            raise ConfigError(f"encoding.width={cfg.width} is not accepted; "
                              "expected an integer >= 1")
        if not cfg.init_c > 0:
            raise ConfigError(f"encoding.init_c={cfg.init_c} is not accepted; "
                              "expected a number > 0")
        if cfg.init_L is not None and not cfg.init_L > 0:
            raise ConfigError(f"encoding.init_L={cfg.init_L} is not accepted; "
                              "expected a number > 0, or null for the training length")

    def __init__(self, cfg, dims):
        super().__init__(cfg, dims)
        self.mlps = nn.ModuleList(FireMLP(dims.n_head, cfg.width, cfg.init_c)
                                  for _ in range(dims.n_layer))

    def inputs(self, pos, layer):
        """psi of every lag that occurs (lags,) and the normalizer of every query ((T,) for one
        position row shared by the batch, else (B, T)): x = psi(lag) / normalizer."""
        mlp = self.mlps[layer]
        threshold = (mlp.l_mult * (self.cfg.init_L or self.dims.train_len)).abs()
        rows = pos[0] if pos.stride(0) == 0 else pos
        psi_lag = psi(torch.arange(self.longest_lag(pos) + 1, device=pos.device), mlp.c)
        span = (rows - rows[..., :1]).to(threshold.dtype)
        return psi_lag, psi(torch.maximum(span, threshold), mlp.c) + EPS

    def lines(self, pos, layer, psi_lag, normalizer):
        """f as lines over the range of x, for evaluation on CPU; None where the unit sum runs
        (FlexAttention on CUDA, and training, whose gradient flows through it)."""
        mlp = self.mlps[layer]
        if pos.is_cuda or (torch.is_grad_enabled() and mlp.w1.requires_grad):
            return None
        return mlp.lines(0.0, float(psi_lag.max() / normalizer.min()))

    def score_mod(self, q, k, pos, layer):
        mlp = self.mlps[layer]
        # One position row for the batch (the usual expanded arange) makes the bias the same for
        # every sequence: on the blockwise path the MLP then runs once, not batch-size times.
        # psi of every lag and the normalizer of every query are looked up per score: no learned
        # 0-d tensor is captured (FlexAttention's backward fails on those,
        # pytorch/pytorch#145208), and no log is taken per score
        psi_lag, normalizer = self.inputs(pos, layer)
        at = ((lambda table, b, idx: table[idx]) if normalizer.dim() == 1 else
              (lambda table, b, idx: table[b, idx]))
        lag_of = relative_lag(pos)
        lines = self.lines(pos, layer, psi_lag, normalizer)

        def fire(score, b, h, q_idx, kv_idx):
            # future keys (negative lag) are masked afterwards; clamp keeps the index valid
            lag = lag_of(b, q_idx, kv_idx).clamp(min=0)
            # the CPU path's blocks: x (B or 1, 1, rows, keys) and h every head in order
            if lines is not None and lag.dim():
                bias = mlp.piecewise(psi_lag.take(lag) / at(normalizer, b, q_idx), lines)
                return bias.add_(score) if score.dim() == 0 else score + bias  # in place: 0-d
            return score + mlp(psi_lag[lag] / at(normalizer, b, q_idx), h)

        return fire

    def flops(self, batch, length, pairs):
        # per pair of the shared position row: the lag, x = psi(lag) / normalizer, each hidden
        # unit's w1 x + b1 and ReLU, then its w2 for every head and the sum; the bias added to
        # each score. psi and the normalizers are per position (9 operations)
        H, width = self.dims.n_head, self.cfg.width
        per_pair = 2 + width * (3 + 2 * H) + batch * H
        return self.dims.n_layer * (pairs * per_pair + 9 * length)

    def lag_rows(self, q, k, pos, layer):
        """At evaluation: f by query row and lag, x computed from the lags directly."""
        psi_lag, normalizer = self.inputs(pos, layer)
        lines = self.lines(pos, layer, psi_lag, normalizer)
        if lines is None:
            return None
        queries = normalizer.view(-1, 1, normalizer.shape[-1], 1)  # (B or 1, 1, T, 1)

        def rows(start, n, lags):
            x = psi_lag[lags.clamp(min=0)] / queries[:, :, start:start + n]
            return self.mlps[layer].piecewise(x, lines)

        return q, rows
