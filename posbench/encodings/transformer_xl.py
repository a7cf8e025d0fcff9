"""Transformer-XL relative attention: the four logit terms of Dai et al. 2019.

A_ij = (q_i + u).k_j + (q_i + v).W_R R_{i-j}, then / sqrt(d); q.k is the attention's own score.
R_lag = [sin(lag w), cos(lag w)] (w_f = 10000^(-2f/D)) is fixed; W_R is per layer; u and v are
shared by all layers (kimiyoung/transformer-xl without --untie_r). Terms (b)+(d) are computed per
query row and lag that occurs, (B, H, rows, lags), and gathered at lag = pos_i - pos_j: the same
numbers as the reference's "relative shift" of its (T, lags) matrix, for any position ids.
On CPU they are computed for one block of query rows at a time, so memory grows with T; on CUDA,
FlexAttention looks each score up in the whole table, B*H*T*lags numbers, T^2 like the reference.
"""
import math
from dataclasses import dataclass

import torch
from torch import nn

from posbench.core.errors import ConfigError
from posbench.encodings.base import EncodingConfig, PositionalEncoding, relative_lag, register
from posbench.encodings.rope import rope_inv_freq


def relative_sinusoids(lags: torch.Tensor, dim: int) -> torch.Tensor:
    """R_lag = [sin(lag w), cos(lag w)] concatenated, (n, dim), in float64."""
    angles = lags.to(torch.float64).unsqueeze(-1) * rope_inv_freq(dim, 10000.0, lags.device)
    return torch.cat((angles.sin(), angles.cos()), dim=-1)


def lag_keys(w_r: torch.Tensor, n_lags: int, n_head: int) -> torch.Tensor:
    """W_R R_lag per head for lag = 0..n_lags-1, (H, n_lags, d), in w_r's dtype; w_r (H*d, D)."""
    r = relative_sinusoids(torch.arange(n_lags, device=w_r.device), w_r.shape[1]).to(w_r.dtype)
    with torch.autocast(w_r.device.type, enabled=False):  # in w_r's dtype under autocast too
        return (r @ w_r.T).view(n_lags, n_head, -1).transpose(0, 1)


def whole_table(q: torch.Tensor) -> bool:
    """Whether terms (b)+(d) are built for every query row at once: FlexAttention (CUDA) looks
    its scores up one by one; the CPU paths ask for a block of query rows at a time."""
    return q.is_cuda


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

    def lag_terms(self, q, pos, layer):
        """u and v (H, d), the lag keys W_R R_lag (H, d, lags) for every lag that occurs, and the
        queries (q_i + v) / sqrt(d) that meet them, in fp32 at least."""
        H, d = q.shape[1], q.shape[3]
        dtype = torch.promote_types(q.dtype, torch.float32)
        u, v = self.u.view(H, d).to(dtype), self.v.view(H, d).to(dtype)
        n_lags = self.longest_lag(pos) + 1
        keys = lag_keys(self.w_r[layer].to(dtype), n_lags, H).transpose(-1, -2)  # (H, d, lags)
        return u, keys, (q.to(dtype) + v.unsqueeze(1)) * (1 / math.sqrt(d))  # (B, H, T, d)

    def score_mod(self, q, k, pos, layer):
        u, keys, queries = self.lag_terms(q, pos, layer)
        # the terms in fp32 at least, as lag_terms made their operands: CUDA's autocast would
        # round these products to bf16
        with torch.autocast(q.device.type, enabled=False):
            # term (c), (B, H, T)
            key_bias = (k.to(u.dtype) @ u.unsqueeze(-1)).squeeze(-1) * (1 / math.sqrt(q.shape[3]))
            table = queries @ keys if whole_table(q) else None  # (B, H, T, lags)
        lag_of = relative_lag(pos)

        def transformer_xl(score, b, h, q_idx, kv_idx):
            # future keys (negative lag) are masked afterwards; clamp keeps the index valid
            lag = lag_of(b, q_idx, kv_idx).clamp(min=0)
            if table is not None:
                position = table[b, h, q_idx, lag]
            else:  # q_idx is a column of query rows, (1, 1, rows, 1): only those rows' lags
                with torch.autocast(q.device.type, enabled=False):
                    by_lag = queries[:, :, q_idx.flatten()] @ keys  # (B, H, rows, lags)
                position = by_lag.gather(-1, lag.expand(*by_lag.shape[:-1], lag.shape[-1]))
            return score + key_bias[b, h, kv_idx] + position

        return transformer_xl

    def flops(self, batch, length, pairs):
        # the lag keys W_R R_lag (sinusoids of every lag, projected D -> D); per token the
        # queries' q + v and scale and the key term k.u; per pair the query-lag products (a
        # matmul over every lag a query sees), the lag, and the two additions to the score
        H, D = self.dims.n_head, self.dims.d_model
        lag_keys = length * (2 * D * D + 1.5 * D)
        per_token = batch * length * (4 * D + H)
        per_pair = pairs * (1 + 2 * batch * H + 2 * batch * D)
        return self.dims.n_layer * (lag_keys + per_token + per_pair)

    def lag_rows(self, q, k, pos, layer):
        """Terms (b)+(d) by query row and lag, and (c) in the queries: (q_i + u) . k_j is (a)+(c),
        the reference's own form."""
        u, keys, queries = self.lag_terms(q, pos, layer)

        def rows(start, n, lags):
            return (queries[:, :, start:start + n] @ keys.index_select(-1, lags.clamp(min=0))
                    ).to(q.dtype)

        return (q + u.unsqueeze(1)).to(q.dtype), rows
