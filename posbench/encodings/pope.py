"""PoPE, polar coordinate position embeddings (Gopalakrishnan et al. 2025): the content sets only
the magnitudes, the position only the phases (docs/encodings.md#rotary-family).

Every coordinate c = 0..d-1 of a head becomes a 2-vector of length softplus(x_c) at an angle set
by position alone, θ_c = base^(-c/d) (one frequency per coordinate, not per pair):

    q̃_i = softplus(q_i) ⊙ [cos(iθ), sin(iθ)],  k̃_j = softplus(k_j) ⊙ [cos(jθ + δ), sin(jθ + δ)],

so q̃_i · k̃_j = Σ_c softplus(q_c) softplus(k_c) cos((i - j)θ_c - δ_{h,c}), with δ a learned phase
per head and coordinate, clamped to [-2π, 0] and shared by the layers (lucidrains/x-transformers
PolarEmbedding). q̃ and k̃ have 2d coordinates; q̃ carries a factor sqrt(2) so that the
attention's 1/sqrt(2d) makes the 1/sqrt(d) the reference scales by.
"""
import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from posbench.core.errors import ConfigError
from posbench.encodings.base import EncodingConfig, PositionalEncoding, register


@dataclass
class PoPEConfig(EncodingConfig):
    # x-transformers PolarEmbedding(dim, heads, bias_uniform_init=False, base=10000): δ starts at
    # 0, or uniform in [-2π, 0] with bias_uniform_init
    base: float = 10000.0
    bias_uniform_init: bool = False


@register("pope", "polar: softplus magnitudes of q/k coordinates, phases from position only, "
                  "learned phase bias per head")
class PoPE(PositionalEncoding):
    family = "rotary"
    relative = True
    past_train_len = ("phases depend on position only: slow coordinates reach angles unseen in "
                      "training, but content cannot rotate them")
    reference = ("Decoupling the \"What\" and \"Where\" With Polar Coordinate Positional "
                 "Embeddings (Gopalakrishnan et al. 2025)")
    Config = PoPEConfig

    @classmethod
    def check(cls, cfg, run_cfg):
        if not cfg.base > 1:
            raise ConfigError(f"encoding.base={cfg.base} is not accepted; expected a number > 1")

    def __init__(self, cfg, dims):
        super().__init__(cfg, dims)
        d = dims.head_dim
        self.register_buffer("theta", cfg.base ** (-torch.arange(d, dtype=torch.float64) / d),
                             persistent=False)
        bias = torch.zeros(dims.n_head, 1, d)
        if cfg.bias_uniform_init:
            bias.uniform_(-2 * math.pi, 0)
        self.phase_bias = nn.Parameter(bias)

    def rotate(self, q, k, pos, layer):
        if pos.stride(0) == 0:  # one position row shared by the batch: compute it once
            pos = pos[:1]
        # magnitudes in fp32 at least, as the reference; back to q's dtype, as RoPE
        dtype = torch.promote_types(q.dtype, torch.float32)
        angle = (pos.double().unsqueeze(-1) * self.theta).unsqueeze(1)  # (B, 1, T, d) float64
        shifted = angle + self.phase_bias.clamp(-2 * math.pi, 0).double()  # (B, H, T, d)
        q_mag = F.softplus(q.to(dtype)) * math.sqrt(2)
        k_mag = F.softplus(k.to(dtype))
        q_polar = torch.cat((q_mag * angle.cos().to(dtype), q_mag * angle.sin().to(dtype)), -1)
        k_polar = torch.cat((k_mag * shifted.cos().to(dtype), k_mag * shifted.sin().to(dtype)), -1)
        return q_polar.to(q.dtype), k_polar.to(k.dtype)

    def flops(self, batch, length, pairs):
        # per layer: the position row's angles and their cos and sin (3 per head coordinate); the
        # keys' angles shifted by each head's phase and their cos and sin (3 per model
        # coordinate); softplus magnitudes (q's times sqrt(2)) and their products with cos and
        # sin (7 per model coordinate of a sequence)
        dims = self.dims
        return dims.n_layer * length * (7 * batch * dims.d_model + 3 * dims.head_dim
                                        + 3 * dims.d_model)
