"""p-RoPE: RoPE that keeps only its fastest pairs and leaves the slow ones position-free."""
from dataclasses import dataclass

import torch

from posbench.core.errors import ConfigError
from posbench.encodings.base import register
from posbench.encodings.rope import RoPE, rope_inv_freq


def rotated_pairs(p: float, head_dim: int) -> int:
    """R = floor(p * d / 2), written as google-deepmind/gemma's `int(rope_proportion * d // 2)`."""
    return int(p * head_dim // 2)


@register("p_rope", "RoPE on the fastest floor(p*d/2) pairs only; the slow pairs carry no position")
class PRoPE(RoPE):
    family = "rotary"
    relative = True
    rotary = True
    past_train_len = "drops exactly the slow pairs whose phases past L were never seen"
    reference = "Round and Round We Go! (Barbero et al. 2024)"

    @dataclass
    class Config(RoPE.Config):
        # fraction of the d/2 pairs that rotate (the highest frequencies); 1 is RoPE
        p: float = 0.75

    @classmethod
    def check(cls, cfg, run_cfg):
        super().check(cfg, run_cfg)
        if not 0 < cfg.p <= 1:
            raise ConfigError(f"encoding.p={cfg.p} is not accepted; expected 0 < p <= 1")

    def inv_freq_for(self, base: float) -> torch.Tensor:
        """RoPE's theta_j = b^(-2j/d) (exponent over the full d) for j < R, then 0: the same
        float64 values as RoPE on the rotated pairs, and a timescale of infinity on the rest."""
        inv_freq = rope_inv_freq(self.dims.head_dim, base)
        inv_freq[rotated_pairs(self.cfg.p, self.dims.head_dim):] = 0
        return inv_freq
