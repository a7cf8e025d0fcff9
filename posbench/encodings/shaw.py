"""Shaw et al.: learned relative key and value vectors of the clipped lag.

e_ij = q_i.(k_j + wK[clip(i - j)])/sqrt(d),   z_i = sum_j a_ij (v_j + wV[clip(i - j)]),
clip(lag) = min(lag, k). A causal model only meets lags 0..k, so it keeps k+1 vectors of the
paper's 2k+1. The key term is q.wK^T (T x (k+1)) followed by a gather; the value term is the
attention mass on each clipped lag times wV, so neither forms a T x T x d tensor.
"""
import math
from dataclasses import dataclass

import torch
from torch import nn

from posbench.core.errors import ConfigError
from posbench.encodings.base import EncodingConfig, PositionalEncoding, relative_lag, register


def clipped_lag(lag: torch.Tensor, k: int) -> torch.Tensor:
    # future keys (negative lag) are masked anyway; clamping keeps them a valid index
    return lag.clamp(min=0, max=k)


@register("shaw", "learned relative key/value vectors of the lag, clipped at k, per layer and head")
class Shaw(PositionalEncoding):
    family = "bias"
    relative = True
    past_train_len = "every lag >= k shares one vector: the far field is position-blind"
    reference = "Self-Attention with Relative Position Representations (Shaw et al. 2018)"

    @dataclass
    class Config(EncodingConfig):
        k: int = 16
        values: bool = True
        # one set of vectors per layer for all heads (the paper's big model) instead of per head
        share_heads: bool = False
        # one set for all layers (CoPE's reference RelPosEmb shares its table so) instead of per layer
        share_layers: bool = False

    @classmethod
    def check(cls, cfg, run_cfg):
        if cfg.k < 1:
            raise ConfigError(f"encoding.k={cfg.k} is not accepted; expected an integer >= 1")

    def __init__(self, cfg, dims):
        super().__init__(cfg, dims)
        heads = 1 if cfg.share_heads else dims.n_head
        layers = 1 if cfg.share_layers else dims.n_layer
        shape = (layers, heads, cfg.k + 1, dims.head_dim)  # broadcasts over heads when 1
        # the paper gives no init: the GPT's embedding init
        self.w_k = nn.Parameter(torch.randn(shape) * 0.02)
        if cfg.values:
            self.w_v = nn.Parameter(torch.randn(shape) * 0.02)
        else:
            self.value_mod = None  # no value hook: score_mod alone, so FlexAttention on GPU

    def score_mod(self, q, k, pos, layer):
        dtype = torch.promote_types(q.dtype, torch.float32)
        # q_i.wK[lag]/sqrt(d) for every query and clipped lag: (B, H, T, k+1)
        with torch.autocast(q.device.type, enabled=False):  # fp32 under autocast too
            q_w = (q.to(dtype) @ self.table(self.w_k, layer).to(dtype).transpose(-1, -2)
                   / math.sqrt(q.shape[-1]))
        clip, lag = self.cfg.k, relative_lag(pos)

        def shaw_keys(score, b, h, q_idx, kv_idx):
            return score + q_w[b, h, q_idx, clipped_lag(lag(b, q_idx, kv_idx), clip)]

        return shaw_keys

    def flops(self, batch, length, pairs):
        # q_i . wK[lag] for every query and clipped lag (k + 1 of them) and its scale; per pair the
        # clipped lag and the addition to the score; with values, the mass per clipped lag
        # (one addition per pair) and mass @ wV
        H, D, lags = self.dims.n_head, self.dims.d_model, self.cfg.k + 1
        own = batch * length * lags * (2 * D + H) + pairs * (1 + batch * H)
        if self.cfg.values:
            own += batch * length * lags * 2 * D + pairs * (1 + batch * H)
        return self.dims.n_layer * own

    def value_mod(self, probs, pos, layer, q_idx, kv_idx):
        B = probs.shape[0]
        b = torch.arange(B, device=probs.device).view(B, 1, 1, 1)
        lag = clipped_lag(relative_lag(pos)(b, q_idx, kv_idx), self.cfg.k).expand_as(probs)
        # attention mass on each clipped lag (future keys carry none), (B, H, Tq, k+1)
        mass = probs.new_zeros(*probs.shape[:-1], self.cfg.k + 1).scatter_add_(-1, lag, probs)
        return mass @ self.table(self.w_v, layer).to(probs.dtype)

    def table(self, w: nn.Parameter, layer: int) -> torch.Tensor:
        """The layer's vectors of w: its own, or the one set every layer shares."""
        return w[0 if self.cfg.share_layers else layer]
