"""p-RoPE: RoPE that keeps only its fastest pairs and leaves the slow ones position-free, and the two
ablations of its Table 2 (Barbero et al. 2024): which pairs rotate, and at which frequencies."""
from dataclasses import dataclass

import torch

from posbench.core.errors import ConfigError
from posbench.encodings.base import register
from posbench.encodings.rope import RoPE, rope_inv_freq

# encoding.variant, the rows "0.75-RoPE", "0.75-RoPE reversed" and "0.75-RoPE partial" of Table 2
VARIANTS = ("p_rope", "reversed", "partial")
# YaRN's ramp and the NTK base assume theta_j = b^(-2j/d) over the full head dimension d
FULL_SPECTRUM_SCALINGS = ("ntk", "dynamic_ntk", "yarn")


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
        # fraction of the d/2 pairs that rotate; 1 is RoPE (every variant)
        p: float = 0.75
        # which R pairs rotate: "p_rope" RoPE's fastest R, the slow rest at 0; "reversed" RoPE's
        # slowest R, the fast rest at 0; "partial" R pairs at b^(-2j/(2R)), RoPE of dimension 2R
        # (GPT-NeoX's rotary_pct), whose slowest pair, b^(-(R-1)/R), still nears b^-1
        variant: str = "p_rope"

    @classmethod
    def check(cls, cfg, run_cfg):
        super().check(cfg, run_cfg)
        if not 0 < cfg.p <= 1:
            raise ConfigError(f"encoding.p={cfg.p} is not accepted; expected 0 < p <= 1")
        if cfg.variant not in VARIANTS:
            raise ConfigError(f"encoding.variant={cfg.variant!r} is not accepted; expected one of "
                              "p_rope (drop the slowest pairs), reversed (drop the fastest), "
                              "partial (RoPE of dimension 2*floor(p*d/2))")
        scalings = {"eval.rope_scaling": run_cfg.eval.rope_scaling,
                    "train.rope_scaling": run_cfg.train.get("rope_scaling", "none")}
        for key, scaling in scalings.items():
            if cfg.variant == "partial" and scaling in FULL_SPECTRUM_SCALINGS:
                raise ConfigError(f"encoding.variant='partial' is not accepted with {key}="
                                  f"{scaling}; expected p_rope or reversed (its formulas assume "
                                  "RoPE's frequencies over the full head dimension)")

    def inv_freq_for(self, base: float) -> torch.Tensor:
        """float64 theta per pair, 0 (a timescale of infinity) on the pairs that do not rotate.
        p_rope and reversed keep RoPE's b^(-2j/d), exponent over the full d, on the pairs that
        rotate: the same values as RoPE there. Which pairs of the half-split layout rotate does
        not matter to a model that learns its q and k maps, only how many and how fast."""
        d, R = self.dims.head_dim, rotated_pairs(self.cfg.p, self.dims.head_dim)
        inv_freq = rope_inv_freq(d, base)
        if self.cfg.variant == "reversed":
            inv_freq[:d // 2 - R] = 0
        elif self.cfg.variant == "partial":
            inv_freq.zero_()
            if R:  # a RoPE of dimension 2R on pairs 0..R-1: from 1 down to b^(-(R-1)/R)
                inv_freq[:R] = rope_inv_freq(2 * R, base)
        else:
            inv_freq[R:] = 0
        return inv_freq
