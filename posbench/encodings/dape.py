"""DAPE and DAPE-v2: the logits plus a learned function of every head's logit and positional bias
at each (query, key) (Zheng et al. 2024; 2025; chuanyang-Zheng/DAPE).

l(i, j) = A(i, j) + B(i, j) + f([A; B])(i, j),   A = q.k / sqrt(d), B the base bias, H values each.

f maps the 2H channels of the (query, key) map to H through `width` hidden channels, LeakyReLU
between: two convolutions with kernel (1, k) along the keys. k = 1 is DAPE's MLP at each (i, j),
k = 3 DAPE-v2's 1x3 kernel. As in the reference, a key the query does not see enters f as 0 (its
torch.tril of the map) and the first convolution zero-pads before key 0, the second before
column 0 of the hidden map. Past the last key of the sequence the reference zero-pads the hidden
map too, so its last k//2 rows change with the sequence's length; here the hidden map is computed
there from the zeros it reads, as on every other row, so a row does not depend on what follows it.
"""
import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from posbench.core.errors import require, require_positive
from posbench.encodings.base import EncodingConfig, PositionalEncoding, register, registry

BASES = ("kerple_log", "alibi", "fire")  # the reference's three base biases
SLOPE = 0.01  # nn.LeakyReLU's default slope, the reference's activation


@dataclass
class DapeConfig(EncodingConfig):
    base: str = "kerple_log"  # the paper's main setting, DAPE-Kerple
    width: int = 32  # the hidden channels, the reference configs' mlp_width
    kernel: int = 1  # keys each convolution reads: 1 is DAPE, 3 DAPE-v2


def _uniform(*shape, fan_in: int) -> nn.Parameter:
    """nn.Linear's and nn.Conv2d's default init, U(+-1/sqrt(fan_in)), weights and biases alike."""
    bound = 1 / math.sqrt(fan_in)
    return nn.Parameter(torch.empty(shape).uniform_(-bound, bound))


class Dape(PositionalEncoding):
    family = "contextual"
    relative = True
    past_train_len = ("the base bias (KERPLE by default) at every lag, plus a correction learned "
                      "from each pair's logits and bias, trained on lags < L")
    reference = ("DAPE: Data-Adaptive Positional Encoding for Length Extrapolation (Zheng et al. "
                 "2024); DAPE V2: Process Attention Score as Feature Map (Zheng et al. 2025)")

    Config = DapeConfig

    @classmethod
    def check(cls, cfg, run_cfg):
        require(cfg.base in BASES, "encoding.base", cfg.base, f"one of {BASES}")
        require_positive("encoding.width", cfg.width)
        require(isinstance(cfg.kernel, int) and cfg.kernel >= 1 and cfg.kernel % 2 == 1,
                "encoding.kernel", cfg.kernel, "an odd integer >= 1 (k//2 keys on either side)")
        require(cfg.kernel == 1 or not run_cfg.train.get("pack_documents", False),
                "train.pack_documents", True, f"false for encoding.kernel={cfg.kernel}: the "
                "convolution reads the keys beside each one, across a document's start")
        base = registry()[cfg.base]
        base.cls.check(base.config, run_cfg)

    def __init__(self, cfg, dims):
        super().__init__(cfg, dims)
        entry = registry()[cfg.base]
        self.base = entry.cls(entry.config, dims)
        n, H, W, k = dims.n_layer, dims.n_head, cfg.width, cfg.kernel
        # one f per layer, as the reference builds one in every attention layer
        self.w1 = _uniform(n, W, 2 * H, 1, k, fan_in=2 * H * k)
        self.b1 = _uniform(n, W, fan_in=2 * H * k)
        self.w2 = _uniform(n, H, W, 1, k, fan_in=W * k)
        self.b2 = _uniform(n, H, fan_in=W * k)

    def notes(self):
        return self.base.notes()

    def mix_heads(self, q, k, pos, layer):
        bias_of = self.base.score_mod(q, k, pos, layer)
        w1, b1, w2, b2 = (w[layer] for w in (self.w1, self.b1, self.w2, self.b2))
        pad = self.cfg.kernel // 2

        def mix(logits, b, h, q_idx, kv_idx, hidden):
            bias = bias_of(logits.new_zeros(()), b, h, q_idx, kv_idx).to(logits.dtype)
            bias = bias.expand_as(logits)
            x = torch.cat((logits, bias), 1).masked_fill(hidden, 0)  # (B, 2H, Tq, Tk)
            if pad:
                # zeros past the block's keys on both sides: every key outside them is hidden
                # from all its rows; the hidden map then spans keys first - pad .. last + pad
                x = F.pad(x, (2 * pad, 2 * pad))
            # channels innermost: oneDNN's convolutions over these few channels run 2-2.5x
            # faster forward and backward on the CPU than in the (B, C, Tq, Tk) layout
            x = x.contiguous(memory_format=torch.channels_last)
            z = F.leaky_relu(F.conv2d(x, w1.to(x.dtype), b1.to(x.dtype)), SLOPE)
            if pad:  # the second convolution's zero padding before key 0
                column = kv_idx[..., :1] - pad + torch.arange(z.shape[-1], device=z.device)
                z.masked_fill_(column < 0, 0)  # in place: it keeps the channels-last layout
            return logits + bias + F.conv2d(z, w2.to(z.dtype), b2.to(z.dtype))

        # a block holds the input map and the hidden one at once
        return mix, 2 * self.dims.n_head + self.cfg.width

    def flops(self, batch, length, pairs):
        # per pair of each sequence: both convolutions' multiply-adds, the hidden bias and
        # LeakyReLU, the output bias, and A + B + f
        H, W, k = self.dims.n_head, self.cfg.width, self.cfg.kernel
        per_pair = 2 * k * (2 * H * W + W * H) + 2 * W + 3 * H
        return (self.base.flops(batch, length, pairs)
                + self.dims.n_layer * batch * pairs * per_pair)


register("dape", "the logits plus an MLP of every head's logit and KERPLE bias at each (query, "
         "key)", DapeConfig(kernel=1))(Dape)
register("dape_v2", "DAPE with a 1x3 convolution along the keys in place of the MLP",
         DapeConfig(kernel=3))(Dape)
