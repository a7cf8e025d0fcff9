"""Transformer-XL relative attention: the four logit terms of Dai et al. 2019.

A_ij = (q_i + u).k_j + (q_i + v).W_R R_{i-j}, then / sqrt(d); q.k is the attention's own score.
R_lag = [sin(lag w), cos(lag w)] (w_f = 10000^(-2f/D)) is fixed; W_R is per layer; u and v are
shared by all layers (kimiyoung/transformer-xl without --untie_r). Terms (b)+(d) are computed once
per lag that occurs, (B, H, T, lags), and gathered at lag = pos_i - pos_j: the same numbers as the
reference's "relative shift" of its (T, lags) matrix, for any position ids. Like that matrix it
holds B*H*T*lags numbers, so this encoding's memory grows with T^2.
"""
import math
from dataclasses import dataclass

import torch
from torch import nn

from posbench.config import ConfigError
from posbench.encodings.base import EncodingConfig, PositionalEncoding, register


def relative_sinusoids(lags: torch.Tensor, dim: int) -> torch.Tensor:
    """R_lag = [sin(lag w), cos(lag w)] concatenated, (n, dim), in float64."""
    inv_freq = 10000.0 ** (-torch.arange(0, dim, 2, dtype=torch.float64, device=lags.device) / dim)
    angles = lags.to(torch.float64).unsqueeze(-1) * inv_freq
    return torch.cat((angles.sin(), angles.cos()), dim=-1)


def lag_scores(q: torch.Tensor, v: torch.Tensor, w_r: torch.Tensor, n_lags: int) -> torch.Tensor:
    """Terms (b)+(d) unscaled, (q_i + v).W_R R_lag for lag = 0..n_lags-1: (B, H, T, n_lags).
    q (B, H, T, d), v (H, d), w_r (H*d, D), all of one dtype."""
    H, d = v.shape
    r = relative_sinusoids(torch.arange(n_lags, device=q.device), w_r.shape[1]).to(q.dtype)
    keys = (r @ w_r.T).view(n_lags, H, d).transpose(0, 1)  # W_R R_lag per head, (H, n_lags, d)
    return (q + v.unsqueeze(1)) @ keys.transpose(-1, -2)


@register("transformer_xl", "Transformer-XL's four terms: content and sinusoid-lag keys, u and v")
class TransformerXL(PositionalEncoding):
    family = "bias"
    additive_score_mod = True
    relative = True
    past_train_len = "R_lag is defined at every lag, but W_R, v were trained only on lags < L"
    reference = ("Transformer-XL: Attentive Language Models Beyond a Fixed-Length Context "
                 "(Dai et al. 2019)")

    @dataclass
    class Config(EncodingConfig):
        pass

    @classmethod
    def check(cls, cfg, run_cfg):
        if run_cfg.model.d_model % 2:
            raise ConfigError(f"model.d_model={run_cfg.model.d_model} is not accepted by "
                              "transformer_xl; expected an even width (R_lag is sin/cos pairs)")

    def __init__(self, cfg, dims):
        super().__init__(cfg, dims)
        H, d, D = dims.n_head, dims.head_dim, dims.d_model
        # kimiyoung/transformer-xl init: N(0, 0.02^2). u and v are stored flat so that the
        # optimizer treats them like the biases they are (no weight decay on 1-d parameters).
        self.u = nn.Parameter(torch.randn(H * d) * 0.02)
        self.v = nn.Parameter(torch.randn(H * d) * 0.02)
        self.w_r = nn.Parameter(torch.randn(dims.n_layer, H * d, D) * 0.02)

    def score_mod(self, q, k, pos, layer):
        H, d = q.shape[1], q.shape[3]
        dtype = torch.promote_types(q.dtype, torch.float32)
        u, v = self.u.view(H, d).to(dtype), self.v.view(H, d).to(dtype)
        scale = 1 / math.sqrt(d)
        key_bias = (k.to(dtype) @ u.unsqueeze(-1)).squeeze(-1) * scale  # term (c), (B, H, T)
        n_lags = int((pos.amax(1) - pos.amin(1)).max()) + 1  # lags occur within a sequence only
        position = lag_scores(q.to(dtype), v, self.w_r[layer].to(dtype), n_lags) * scale

        def transformer_xl(score, b, h, q_idx, kv_idx):
            # future keys (negative lag) are masked afterwards; clamp keeps the index valid
            lag = (pos[b, q_idx] - pos[b, kv_idx]).clamp(min=0)
            return score + key_bias[b, h, kv_idx] + position[b, h, q_idx, lag]

        return transformer_xl
