"""RoPE-ID, RoPE "In Distribution" (Wertheimer et al., ICLR 2026, "Frayed RoPE and Long Inputs: A
Geometric Perspective", arXiv 2603.18017): RoPE at high frequency on a subset of each head's
channels, the others position-free (docs/encodings.md#rotary-family).

Only the abstract's rule, RoPE at high frequency on a subset of the channels, was read from the
paper; its method section and appendix were not. What is assumed: the subset is half of the
channels (secondary summaries of the paper), the fastest half of RoPE's pairs at RoPE's own
frequencies θ_j = b^(-2j/d), j < floor(d/4): in the half-split layout those are the first and
third quarters of the head, where reviews of the paper place the rotated channels. The temperature
coefficient the reviews also mention is not applied. So `rope_id` is `p_rope` at p = 1/2.
"""
import math

import torch

from posbench.encodings.base import register
from posbench.encodings.p_rope import rotated_pairs
from posbench.encodings.rope import RoPE, rope_inv_freq

# the assumed subset: half of the channels, RoPE's fastest half of its pairs
ROTATED_FRACTION = 0.5


@register("rope_id", "RoPE on the fastest half of the pairs (the first and third quarters of each "
                     "head); the other half carries no position")
class RoPEID(RoPE):
    family = "rotary"
    relative = True
    rotary = True
    past_train_len = ("the slow half carries no position; of the fast half, the pairs slower than "
                      "one turn in L still reach unseen angles")
    reference = ("Frayed RoPE and Long Inputs: A Geometric Perspective (Wertheimer et al. 2026); "
                 "assumed: RoPE's fastest half of the pairs, no temperature")

    def inv_freq_for(self, base: float) -> torch.Tensor:
        """float64 θ per pair: RoPE's on the first floor(d/4) pairs, 0 on the others."""
        d = self.dims.head_dim
        inv_freq = rope_inv_freq(d, base)
        inv_freq[rotated_pairs(ROTATED_FRACTION, d):] = 0
        return inv_freq

    def notes(self):
        d, L = self.dims.head_dim, self.dims.scaling_len
        theta = self.inv_freq_for(self.cfg.base)
        rotated = int((theta > 0).sum())
        turning = int((theta * L >= 2 * math.pi).sum())
        return [f"{rotated} of {d // 2} pairs rotate, {turning} of them at least once within "
                f"L={L} tokens; the others carry no position"]
