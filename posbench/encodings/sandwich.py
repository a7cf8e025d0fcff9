"""Sandwich: the parameter-free inner product of sinusoids as a per-head bias (Chi et al. 2023)."""
from dataclasses import dataclass
from typing import Optional

import torch

from posbench.core.errors import ConfigError
from posbench.encodings.base import EncodingConfig, PositionalEncoding, relative_lag, register


def sandwich_bias(lag: torch.Tensor, dim: int) -> torch.Tensor:
    """sum_{k=1}^{dim/2} cos(lag * 10000^(-2k/dim)) - dim/2, in float64: 0 at lag 0, <= 0 elsewhere
    (NVIDIA/NeMo SandwichRelativePositionEmbedding, before the per-head compression)."""
    k = torch.arange(1, dim // 2 + 1, dtype=torch.float64, device=lag.device)
    inv_freq = 10000.0 ** (-2.0 * k / dim)
    return torch.cos(lag.to(torch.float64).unsqueeze(-1) * inv_freq).sum(-1) - dim / 2


def head_scales(n_head: int) -> torch.Tensor:
    """ALiBi-style compression H / (8h), h = 1..H."""
    return n_head / (8.0 * torch.arange(1, n_head + 1, dtype=torch.float64))


@register("sandwich", "parameter-free bias: inner product of sinusoids of the lag, scaled per head")
class Sandwich(PositionalEncoding):
    family = "bias"
    additive_score_mod = True
    lag_only_bias = True
    relative = True
    past_train_len = "defined at every lag, bounded below by -d'H/(8h): log-like decay, slow drift"
    reference = ("Dissecting Transformer Length Extrapolation via the Lens of Receptive Field "
                 "Analysis (Chi et al. 2023)")

    @dataclass
    class Config(EncodingConfig):
        # d' of the sinusoids; None uses the head dimension (as NeMo does)
        dim: Optional[int] = None

    @classmethod
    def check(cls, cfg, run_cfg):
        if cfg.dim is not None and (cfg.dim < 2 or cfg.dim % 2):
            raise ConfigError(f"encoding.dim={cfg.dim} is not accepted; expected null (the head "
                              "dimension) or an even integer >= 2")
        head_dim = run_cfg.model.d_model // run_cfg.model.n_head
        if cfg.dim is None and head_dim % 2:
            raise ConfigError(f"model.d_model/model.n_head={head_dim} is not accepted with "
                              "encoding.dim=null; expected an even head dimension")

    def __init__(self, cfg, dims):
        super().__init__(cfg, dims)
        self.dim = cfg.dim or dims.head_dim
        self.register_buffer("scales", head_scales(dims.n_head).float(), persistent=False)

    def score_mod(self, q, k, pos, layer):
        # one bias per lag that can occur (within a sequence), built in float64 then cast
        lags = torch.arange(self.longest_lag(pos) + 1, device=pos.device)
        table = sandwich_bias(lags, self.dim).float()
        scales, lag = self.scales, relative_lag(pos)

        def sandwich(score, b, h, q_idx, kv_idx):
            # future keys (negative lag) are masked afterwards; clamp keeps the index valid
            return score + scales[h] * table[lag(b, q_idx, kv_idx).clamp(min=0)]

        return sandwich

    def flops(self, batch, length, pairs):
        # the bias table over the lags (dim/2 cosines summed per lag), then per pair the lag, the
        # head's scale, and the addition to each score
        H = self.dims.n_head
        table = length * (1.5 * self.dim + 1)
        return self.dims.n_layer * (table + pairs * (1 + H + batch * H))
