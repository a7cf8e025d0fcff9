"""ALiBi: a per-head linear penalty on the query-key distance (Press et al. 2022)."""
import math
from dataclasses import dataclass
from typing import List, Optional

import torch

from posbench.core.errors import ConfigError
from posbench.encodings.base import EncodingConfig, PositionalEncoding, relative_lag, register


def alibi_slopes(n_head: int) -> List[float]:
    """Geometric slopes 2^(-8h/n) for n a power of two; otherwise the closest power of two's
    slopes followed by every other slope of the next power (ofirpress/attention_with_linear_biases)."""

    def power_of_two(n):
        return [2.0 ** (-8.0 * h / n) for h in range(1, n + 1)]

    if math.log2(n_head).is_integer():
        return power_of_two(n_head)
    c = 2 ** math.floor(math.log2(n_head))
    return power_of_two(c) + power_of_two(2 * c)[0::2][: n_head - c]


@register("alibi", "subtracts slope_h * (i - j) from each logit; geometric slopes per head")
class ALiBi(PositionalEncoding):
    family = "bias"
    relative = True
    additive_score_mod = True
    lag_only_bias = True
    past_train_len = "defined at every distance; the linear penalty acts as a window, ppl stays flat"
    reference = "Train Short, Test Long (Press et al. 2022)"

    @dataclass
    class Config(EncodingConfig):
        # how many heads get a bias, the first ones, with the slopes of that many heads; the
        # others none (x-transformers' alibi_num_heads); null: every head, the paper's ALiBi
        heads: Optional[int] = None

    @classmethod
    def check(cls, cfg, run_cfg):
        n_head = run_cfg.model.n_head
        if cfg.heads is not None and not 1 <= cfg.heads <= n_head:
            raise ConfigError(f"encoding.heads={cfg.heads} is not accepted; expected 1 to "
                              f"model.n_head={n_head} (the heads with a bias), or null (all)")

    def __init__(self, cfg, dims):
        super().__init__(cfg, dims)
        biased = dims.n_head if cfg.heads is None else cfg.heads
        slopes = alibi_slopes(biased) + [0.0] * (dims.n_head - biased)
        self.register_buffer("slopes", torch.tensor(slopes), persistent=False)

    def score_mod(self, q, k, pos, layer):
        slopes, lag = self.slopes, relative_lag(pos)

        def alibi(score, b, h, q_idx, kv_idx):
            return score - slopes[h] * lag(b, q_idx, kv_idx)

        return alibi

    def flops(self, batch, length, pairs):
        # the lag and its slope per head, from the shared position row; subtracted per score
        H = self.dims.n_head
        return self.dims.n_layer * pairs * (1 + H + batch * H)
