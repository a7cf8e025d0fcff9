"""Rotary position embedding (RoPE), half-split layout as in GPT-NeoX / HF, and the eval-time
length extensions of its frequencies (PI, NTK, HF's dynamic NTK, YaRN; docs/encodings.md).

Every extension is a function of one scale s (RoPE.scale): static when eval.rope_scaling_factor
is set, the same s at every evaluated length as the PI, NTK and YaRN papers evaluate; dynamic
when it is null, s = max(1, n/L) from each evaluated length n and the training length L.
"""
import math
from dataclasses import dataclass
from typing import Tuple

import torch

from posbench.errors import ConfigError
from posbench.encodings.base import EncodingConfig, PositionalEncoding, register

# YaRN's bounds in turns per training window, beta_fast and beta_slow of its released code: pairs
# that turn more than 32 times in L tokens keep RoPE, pairs that turn less than once are scaled
YARN_BETA_FAST, YARN_BETA_SLOW = 32.0, 1.0


def rope_inv_freq(head_dim: int, base: float, device=None) -> torch.Tensor:
    """theta_p = base^(-2p/d), p = 0..d/2-1, float64."""
    return base ** (-torch.arange(0, head_dim, 2, dtype=torch.float64, device=device) / head_dim)


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def rope_tables(pos: torch.Tensor, inv_freq: torch.Tensor, dtype, factor: float = 1.0):
    """cos and sin of pos * theta, (B, 1, T, d), times `factor` (YaRN's attention factor): built
    in float64, then cast."""
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


def yarn_pair_range(head_dim: int, base: float, train_len: int) -> Tuple[int, int]:
    """The pair indices (low, high) between which YaRN's ramp runs. A pair turns beta times in L
    tokens (L theta_p / 2pi = beta) at the fractional index p = d ln(L / (2 pi beta)) / (2 ln b):
    low is that index for beta_fast rounded down, high the one for beta_slow rounded up, clamped
    to [0, d-1] as the released code and HF clamp them (d, not d/2: see docs/encodings.md)."""
    def index(turns: float) -> float:
        return head_dim * math.log(train_len / (2 * math.pi * turns)) / (2 * math.log(base))

    return (max(math.floor(index(YARN_BETA_FAST)), 0),
            min(math.ceil(index(YARN_BETA_SLOW)), head_dim - 1))


def yarn_inv_freq(inv_freq: torch.Tensor, s: float, head_dim: int, base: float,
                  train_len: int) -> torch.Tensor:
    """YaRN's "NTK-by-parts" frequencies: theta' = (1 - w) theta / s + w theta, where the weight w
    of the unscaled frequency falls linearly over the pair index, from 1 at pair `low` and below
    to 0 at pair `high` and above (yarn_pair_range)."""
    low, high = yarn_pair_range(head_dim, base, train_len)
    if low == high:  # both bounds clamped to one pair: a step there instead of 0/0
        high += 0.001
    pair = torch.arange(len(inv_freq), dtype=inv_freq.dtype, device=inv_freq.device)
    keep = 1 - ((pair - low) / (high - low)).clamp(0, 1)
    return inv_freq / s * (1 - keep) + inv_freq * keep


def yarn_attention_factor(s: float) -> float:
    """YaRN's attention factor sqrt(1/t) = 0.1 ln s + 1, multiplied into cos and sin and so into
    both q and k: the logits scale by its square."""
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

    def scale(self, n: int) -> float:
        """The scale s for a sequence of n tokens: eval.rope_scaling_factor when set (static),
        else max(1, n/L); dynamic_ntk reads the factor as HF's alpha (1 when null),
        s = max(1, alpha*n/L - (alpha-1)), which is n/L at alpha = 1."""
        ratio, factor = n / self.dims.train_len, self.rope_scaling_factor
        if self.rope_scaling == "dynamic_ntk":
            alpha = 1.0 if factor is None else factor
            return max(1.0, alpha * ratio - (alpha - 1))
        return max(1.0, ratio) if factor is None else factor

    def frequencies(self, n: int) -> Tuple[torch.Tensor, float]:
        """(theta, table factor) for a sequence of n tokens under eval.rope_scaling at scale
        self.scale(n); s = 1 leaves RoPE unchanged."""
        s = 1.0 if self.rope_scaling == "none" else self.scale(n)
        if s == 1:
            return self.inv_freq, 1.0
        if self.rope_scaling == "pi":
            return self.inv_freq / s, 1.0
        if self.rope_scaling in ("ntk", "dynamic_ntk"):
            base = ntk_base(self.cfg.base, s, self.dims.head_dim)
            return self.inv_freq_for(base).to(self.inv_freq.device), 1.0
        if self.rope_scaling == "yarn":
            return (yarn_inv_freq(self.inv_freq, s, self.dims.head_dim, self.cfg.base,
                                  self.dims.train_len), yarn_attention_factor(s))
        raise ValueError(f"rope_scaling={self.rope_scaling!r} is not implemented")

    def rotate(self, q, k, pos, layer):
        inv_freq, factor = self.frequencies(q.shape[2])
        cos, sin = rope_tables(pos, inv_freq, q.dtype, factor)
        return apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)
