"""Clipped RoPE, the paper's CoPE (Li et al. 2026, "CoPE: Clipped RoPE as A Scalable Free Lunch
for Long Context LLMs"): RoPE whose N slowest pairs have their frequencies tapered to 0 by a half
cosine, a soft clip of the low frequencies; `variant=hard` is the paper's HardClip ablation, those
N pairs at 0 outright (docs/encodings.md#rotary-family). Registered as `clipped_rope`: `cope` is
the contextual position encoding of Golovneva et al.

With θ_j = b^(-2j/d), j = 0..d/2-1, and N = floor(clip * d/2), pair d/2 - N + k (k = 0..N-1)
turns at θ·w_k, w_k = (1 + cos(π k/(N-1)))/2: the first clipped pair keeps w = 1, the slowest gets
0. This is hrlics/CoPE's LlamaRotaryEmbedding, clip_low_n = 20 of Llama-3-8B's 64 pairs, whose
torch.linspace(0, π, N) gives the angles πk/(N-1) and, for N = 1, the single angle 0 (w = 1:
RoPE). The weights multiply the frequencies, so they commute with every eval-time scaling, each
of which scales or recomputes the frequencies pair by pair (the reference re-applies them to the
dynamic NTK frequencies, as inv_freq_for does here), but llama3, which picks each pair's band by
the wavelength it turns with: the clipped one.
"""
import math
from dataclasses import dataclass

import torch

from posbench.core.errors import ConfigError
from posbench.encodings.base import register
from posbench.encodings.rope import RoPE, rope_inv_freq

# hrlics/CoPE: clip_low_n = 20 pairs of head dimension 128 (Llama-3-8B), as a fraction of d/2
REFERENCE_CLIP = 20 / 64
VARIANTS = ("soft", "hard")


def clipped_pairs(clip: float, head_dim: int) -> int:
    """N = floor(clip * d/2), the number of slow pairs the clip reaches."""
    return int(clip * head_dim // 2)


def clip_weights(n_pairs: int, clip: float, variant: str) -> torch.Tensor:
    """float64 multiplier per pair: 1 on the fast pairs; on the N slowest, the half-cosine taper
    (soft) or 0 (hard)."""
    weights = torch.ones(n_pairs, dtype=torch.float64)
    N = clipped_pairs(clip, 2 * n_pairs)
    if N and variant == "hard":
        weights[n_pairs - N:] = 0
    elif N:
        angle = torch.linspace(0, math.pi, N, dtype=torch.float64)
        weights[n_pairs - N:] = 0.5 * (1 + torch.cos(angle))
    return weights


@register("clipped_rope", "RoPE with the frequencies of its slowest pairs tapered to 0 by a half "
                          "cosine (CoPE's soft clip)")
class ClippedRoPE(RoPE):
    family = "rotary"
    relative = True
    rotary = True
    past_train_len = ("the slowest pairs barely or never turn, so far fewer angles past L are "
                      "unseen; the taper's faster end still reaches new ones")
    reference = "CoPE: Clipped RoPE as A Scalable Free Lunch for Long Context LLMs (Li et al. 2026)"

    @dataclass
    class Config(RoPE.Config):
        # fraction of the d/2 pairs, the slowest, that the clip reaches: N = floor(clip * d/2);
        # hrlics/CoPE's 20 of 64 (5 of the 16 pairs of a head of 32); 0 is RoPE
        clip: float = REFERENCE_CLIP
        # "soft": the half-cosine taper of CoPE; "hard": the N pairs at 0, the paper's HardClip
        variant: str = "soft"

    @classmethod
    def check(cls, cfg, run_cfg):
        super().check(cfg, run_cfg)
        if not 0 <= cfg.clip <= 1:
            raise ConfigError(f"encoding.clip={cfg.clip} is not accepted; expected 0 <= clip <= 1 "
                              "(the fraction of the slowest pairs clipped)")
        if cfg.variant not in VARIANTS:
            raise ConfigError(f"encoding.variant={cfg.variant!r} is not accepted; expected soft "
                              "(CoPE's half-cosine taper) or hard (HardClip: the pairs at 0)")

    def inv_freq_for(self, base: float) -> torch.Tensor:
        d = self.dims.head_dim
        return rope_inv_freq(d, base) * clip_weights(d // 2, self.cfg.clip, self.cfg.variant)
