"""DA-Transformer: ReLU(q.k) rescaled by a learned sigmoid of the distance (Wu et al. 2021)."""
from dataclasses import dataclass

import torch
from torch import nn

from posbench.encodings.base import EncodingConfig, PositionalEncoding, relative_lag, register

# init is not given by the paper: small random slopes, neutral offsets
W_INIT_STD = 0.01


def distance_rescale(r: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """(1 + e^v) / (1 + e^(v - r)), written as (1 + e^v) * sigmoid(r - v) so it cannot overflow:
    1 at r = 0, rising toward 1 + e^v for r -> inf and falling toward 0 for r -> -inf."""
    return (1 + v.exp()) * torch.sigmoid(r - v)


@register("da_transformer", "multiplies ReLU(q.k) by a learned per-head sigmoid of |i-j|")
class DATransformer(PositionalEncoding):
    family = "contextual"
    relative = True
    past_train_len = "the sigmoid saturates, so far lags look alike; far scores fall to 0, not -inf"
    reference = "DA-Transformer: Distance-aware Transformer (Wu et al. 2021)"

    @dataclass
    class Config(EncodingConfig):
        pass

    def __init__(self, cfg, dims):
        super().__init__(cfg, dims)
        # per layer and head; (H,) vectors so the optimizer treats them like biases (no decay)
        self.w = nn.ParameterList(nn.Parameter(torch.randn(dims.n_head) * W_INIT_STD)
                                  for _ in range(dims.n_layer))
        self.v = nn.ParameterList(nn.Parameter(torch.zeros(dims.n_head))
                                  for _ in range(dims.n_layer))

    def score_mod(self, q, k, pos, layer):
        w, v, lag = self.w[layer], self.v[layer], relative_lag(pos)

        def da(score, b, h, q_idx, kv_idx):
            distance = lag(b, q_idx, kv_idx).abs().to(w.dtype)
            # score = q.k/sqrt(d), so ReLU(score) = ReLU(q.k)/sqrt(d); the mask comes after
            return torch.relu(score) * distance_rescale(w[h] * distance, v[h])

        return da

    def flops(self, batch, length, pairs):
        # |lag| of the shared position row; per head w|lag|, the sigmoid and its factor; per
        # score the ReLU and the product
        H = self.dims.n_head
        return self.dims.n_layer * pairs * (2 + 4 * H + 2 * batch * H)
