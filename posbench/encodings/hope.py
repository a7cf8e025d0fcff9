"""HoPE, High-frequency rotary Position Encoding (Chen et al., ACL 2025): RoPE on the pairs that
complete at least one turn within the training length L only; every slower pair, the ones that
never finish a turn in training (among them the "activated" ones the paper finds forming the
U-shaped attention), is made position-free (docs/encodings.md#rotary-family).

Pair j of RoPE's half-split layout turns at θ_j = b^(-2j/d); it keeps θ_j when θ_j·L >= 2π (its
wavelength 2π/θ_j is at most L) and gets θ_j = 0 otherwise. θ_j falls with j, so the kept pairs
are the fastest K, a prefix: p-RoPE's cut with its proportion set by L instead of by p.

L is the training length the cut is measured against: Dims.scaling_len, the first run's
train.seq_len of a lineage, so that `posbench extend` keeps the pairs its parent trained with. The
cut is fixed by `encoding.base` at build time; an eval-time NTK scaling asks inv_freq_for for a
larger base and gets the NTK frequencies on the same kept pairs, the others still at 0.
"""
import math
from dataclasses import dataclass

import torch

from posbench.encodings.base import register
from posbench.encodings.rope import RoPE, rope_inv_freq


def hope_kept(head_dim: int, base: float, train_len: int) -> torch.Tensor:
    """Bool per pair: θ_j·L >= 2π, the pairs that complete a turn within L tokens."""
    return rope_inv_freq(head_dim, base) * train_len >= 2 * math.pi


@register("hope", "RoPE on the pairs that turn at least once within L; the slower pairs carry no "
                  "position")
class HoPE(RoPE):
    family = "rotary"
    relative = True
    rotary = True
    past_train_len = ("every pair that rotates went once around its circle within L; the "
                      "slower pairs carry no position, so no angle leaves the trained range")
    reference = ("HoPE: A Novel Positional Encoding Without Long-Term Decay for Enhanced Context "
                 "Awareness and Extrapolation (Chen et al. 2025)")

    @dataclass
    class Config(RoPE.Config):
        # RoPE's base, whose θ_j the kept pairs keep; the cut θ_j·L >= 2π is the paper's rule
        # and has no parameter of its own
        base: float = 10000.0

    def inv_freq_for(self, base: float) -> torch.Tensor:
        """float64 θ per pair at `base`: RoPE's on the pairs that turn within L at
        encoding.base, 0 on the others."""
        d = self.dims.head_dim
        kept = hope_kept(d, self.cfg.base, self.dims.scaling_len)
        return rope_inv_freq(d, base) * kept

    def notes(self):
        kept = int(hope_kept(self.dims.head_dim, self.cfg.base, self.dims.scaling_len).sum())
        return [f"{kept} of {self.dims.head_dim // 2} pairs rotate (those that turn within "
                f"L={self.dims.scaling_len} tokens); the others carry no position"]
