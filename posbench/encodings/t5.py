"""T5 relative position bias: a learned scalar per head and log-spaced distance bucket."""
import math
from dataclasses import dataclass

import torch
from torch import nn

from posbench.core.errors import ConfigError
from posbench.encodings.base import EncodingConfig, PositionalEncoding, relative_lag, register


def t5_bucket(distance: torch.Tensor, num_buckets: int, max_distance: int) -> torch.Tensor:
    """Causal bucket of the lag i - j >= 0 (HF T5Attention._relative_position_bucket,
    bidirectional=False): exact below num_buckets/2, log-spaced up to max_distance, then flat."""
    n = distance.clamp(min=0)
    exact = num_buckets // 2
    log_ratio = torch.log(n.clamp(min=1).float() / exact) / math.log(max_distance / exact)
    large = (exact + (log_ratio * (num_buckets - exact)).long()).clamp(max=num_buckets - 1)
    return torch.where(n < exact, n, large)


@register("t5", "learned per-head bias of log-spaced distance buckets, shared by all layers")
class T5Bias(PositionalEncoding):
    family = "bias"
    relative = True
    additive_score_mod = True
    lag_only_bias = True
    past_train_len = "every lag >= max_distance shares the last bucket: flat bias, no new parameters"
    reference = "Exploring the Limits of Transfer Learning (Raffel et al. 2020)"

    @dataclass
    class Config(EncodingConfig):
        num_buckets: int = 32
        max_distance: int = 128

    @classmethod
    def check(cls, cfg, run_cfg):
        if cfg.num_buckets < 2 or cfg.num_buckets % 2:
            raise ConfigError(f"encoding.num_buckets={cfg.num_buckets} is not accepted; "
                              "expected an even integer >= 2")
        if cfg.max_distance <= cfg.num_buckets // 2:
            raise ConfigError(f"encoding.max_distance={cfg.max_distance} is not accepted; "
                              f"expected an integer > num_buckets/2 = {cfg.num_buckets // 2}")

    def __init__(self, cfg, dims):
        super().__init__(cfg, dims)
        # one table shared by all layers, initialized as the reference implementation does
        # (Hugging Face's T5: normal with std d_model^-1/2)
        self.bias = nn.Parameter(torch.randn(cfg.num_buckets, dims.n_head) * dims.d_model ** -0.5)

    def score_mod(self, q, k, pos, layer):
        md = self.cfg.max_distance
        # the bias of every lag 0..max_distance, (md + 1, H): larger lags share the last bucket,
        # so one small gather per score replaces the log-bucketing of every (i, j)
        lags = torch.arange(md + 1, device=pos.device)
        table = self.bias[t5_bucket(lags, self.cfg.num_buckets, md)]
        lag = relative_lag(pos)

        def t5(score, b, h, q_idx, kv_idx):
            return score + table[lag(b, q_idx, kv_idx).clamp(0, md), h]

        return t5

    def flops(self, batch, length, pairs):
        # the lag of the shared position row, its bucket's bias added to each score
        return self.dims.n_layer * pairs * (1 + batch * self.dims.n_head)
