"""Rotary position embedding (RoPE), half-split layout as in GPT-NeoX / HF, and the eval-time
length extensions of its frequencies (ENCODINGS.md §6: PI, NTK, dynamic NTK, YaRN)."""
import math
from dataclasses import dataclass
from typing import Tuple

import torch

from posbench.config import ConfigError
from posbench.encodings.base import EncodingConfig, PositionalEncoding, register

# YaRN's ramp bounds in rotations per training window (Peng et al., values for LLaMA)
YARN_ALPHA, YARN_BETA = 1.0, 32.0


def rope_inv_freq(head_dim: int, base: float, device=None) -> torch.Tensor:
    """theta_p = base^(-2p/d), p = 0..d/2-1, float64."""
    return base ** (-torch.arange(0, head_dim, 2, dtype=torch.float64, device=device) / head_dim)


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def rope_tables(pos: torch.Tensor, inv_freq: torch.Tensor, dtype, factor: float = 1.0):
    """cos and sin of pos * theta, (B, 1, T, d), times `factor` (YaRN's temperature): built in
    float64, then cast."""
    if pos.stride(0) == 0:  # one position row shared by the batch: compute it once
        pos = pos[:1]
    angles = pos.to(torch.float64).unsqueeze(-1) * inv_freq.to(pos.device)
    angles = torch.cat((angles, angles), dim=-1).unsqueeze(1)
    return (angles.cos() * factor).to(dtype), (angles.sin() * factor).to(dtype)


def apply_rotary(x, cos, sin):
    return x * cos + rotate_half(x) * sin


def ntk_base(base: float, s: float, head_dim: int) -> float:
    """NTK-aware base b' = b * s^(d/(d-2)): the fastest pair keeps its frequency, the slowest is
    divided by exactly s (bloc97)."""
    return base * s ** (head_dim / (head_dim - 2))


def yarn_inv_freq(inv_freq: torch.Tensor, s: float, train_len: int) -> torch.Tensor:
    """YaRN's per-pair blend theta' = (1 - g) theta / s + g theta, with g the ramp of
    r = L / lambda, the rotations a pair completes in the training window: pairs with r > beta
    keep RoPE, pairs with r < alpha are interpolated as in PI. The ramp is the paper's, linear
    in r; HF's ramp over pair indices agrees on both end regions, not in between."""
    rotations = train_len * inv_freq / (2 * math.pi)
    ramp = ((rotations - YARN_ALPHA) / (YARN_BETA - YARN_ALPHA)).clamp(0, 1)
    return (1 - ramp) * inv_freq / s + ramp * inv_freq


def yarn_temperature(s: float) -> float:
    """YaRN's sqrt(1/t) = 0.1 ln s + 1, applied to both q and k: logits scale by its square."""
    return 0.1 * math.log(s) + 1


@register("rope", "rotates each query/key pair by position times a geometric frequency")
class RoPE(PositionalEncoding):
    family = "rotary"
    relative = True
    rotary = True
    past_train_len = "unseen rotation angles on the slow pairs; perplexity usually climbs past L"
    reference = "RoFormer (Su et al. 2021)"

    @dataclass
    class Config(EncodingConfig):
        base: float = 10000.0

    @classmethod
    def check(cls, cfg, run_cfg):
        if not cfg.base > 1:
            raise ConfigError(f"encoding.base={cfg.base} is not accepted; expected a number > 1")
        head_dim = run_cfg.model.d_model // run_cfg.model.n_head
        if head_dim % 2:
            raise ConfigError(f"model.d_model/model.n_head={head_dim} is not accepted; rotary "
                              "encodings need an even head dimension")
        if run_cfg.eval.rope_scaling in ("ntk", "dynamic_ntk") and head_dim < 4:
            raise ConfigError(f"model.d_model/model.n_head={head_dim} is not accepted with "
                              "NTK scaling; expected a head dimension >= 4 (b' uses d/(d-2))")

    def __init__(self, cfg, dims):
        super().__init__(cfg, dims)
        self.register_buffer("inv_freq", self.inv_freq_for(cfg.base), persistent=False)

    def inv_freq_for(self, base: float) -> torch.Tensor:
        """The frequencies at `base` (float64); NTK scaling asks again with its larger base."""
        return rope_inv_freq(self.dims.head_dim, base)

    def frequencies(self, n: int) -> Tuple[torch.Tensor, float]:
        """(theta, table factor) for a sequence of n tokens under eval.rope_scaling, with
        s = n / L (L = training length); s <= 1 leaves RoPE unchanged."""
        s = n / self.dims.train_len
        if self.rope_scaling == "none" or s <= 1:
            return self.inv_freq, 1.0
        if self.rope_scaling == "pi":
            return self.inv_freq / s, 1.0
        if self.rope_scaling in ("ntk", "dynamic_ntk"):
            # s is recomputed from every sequence's length, so static NTK at s = n/L and dynamic
            # NTK (alpha = 1) coincide on full-sequence evaluation
            base = ntk_base(self.cfg.base, s, self.dims.head_dim)
            return self.inv_freq_for(base).to(self.inv_freq.device), 1.0
        if self.rope_scaling == "yarn":
            return yarn_inv_freq(self.inv_freq, s, self.dims.train_len), yarn_temperature(s)
        raise ValueError(f"rope_scaling={self.rope_scaling!r} is not implemented")

    def rotate(self, q, k, pos, layer):
        inv_freq, factor = self.frequencies(q.shape[2])
        cos, sin = rope_tables(pos, inv_freq, q.dtype, factor)
        return apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)
