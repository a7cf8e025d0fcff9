"""Rotary position embedding (RoPE), half-split layout as in GPT-NeoX / HF."""
from dataclasses import dataclass

import torch

from posbench.config import ConfigError
from posbench.encodings.base import EncodingConfig, PositionalEncoding, register


def rope_inv_freq(head_dim: int, base: float, device=None) -> torch.Tensor:
    """theta_p = base^(-2p/d), p = 0..d/2-1, float64."""
    return base ** (-torch.arange(0, head_dim, 2, dtype=torch.float64, device=device) / head_dim)


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def rope_tables(pos: torch.Tensor, inv_freq: torch.Tensor, dtype):
    """cos and sin of pos * theta, (B, 1, T, d): built in float64, then cast."""
    if pos.stride(0) == 0:  # one position row shared by the batch: compute it once
        pos = pos[:1]
    angles = pos.to(torch.float64).unsqueeze(-1) * inv_freq.to(pos.device)
    angles = torch.cat((angles, angles), dim=-1).unsqueeze(1)
    return angles.cos().to(dtype), angles.sin().to(dtype)


def apply_rotary(x, cos, sin):
    return x * cos + rotate_half(x) * sin


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

    def __init__(self, cfg, dims):
        super().__init__(cfg, dims)
        self.register_buffer("inv_freq", rope_inv_freq(dims.head_dim, cfg.base), persistent=False)

    def rotate(self, q, k, pos, layer):
        cos, sin = rope_tables(pos, self.inv_freq, q.dtype)
        return apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)
