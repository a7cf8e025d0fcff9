"""FoPE, Fourier Position Embedding (Hua et al., ICML 2025, arXiv 2412.17739): RoPE whose pairs
are multiplied by Fourier series of the kept frequencies instead of turned by one frequency each,
the frequencies that do not complete a turn within the training length L dropped
(docs/encodings.md#rotary-family).

RoPE multiplies pair m of a head (coordinates m and m + d/2, the half-split layout) by the unit
complex number e^{i ω_m t}. FoPE multiplies it by

    w_{h,m}(t) = Σ_k A_{h,k,m} cos(ω_k t) + i Σ_k B_{h,k,m} sin(ω_k t),    m < K,

k running over the K kept frequencies ω_k = b^(-2k/d) with ω_k·L >= 2π (HoPE's cut, a prefix of
the pairs), A and B a cos and a sin coefficient matrix of each layer and head. The d/2 - K other
pairs carry no position: the references fill their cos and sin with 1 (w = 1 + i, a fixed turn by
π/4 and a factor √2 on q and k, so that the pair's share of the logit is doubled), and
`free_pairs=zero_frequency` gives them the paper's zero frequency (w = 1, no rotation). Queries
and keys are multiplied alike, so that pair m's share of the logit is Re(conj(w(i) q) w(j) k):
a function of i - j alone only when A = B = I (RoPE's rotation, here HoPE's). FoPE is therefore
not relative, and its one hook is `rotate`, so it takes the fused attention paths as RoPE does.

A and B start at I plus independent noise, N(0, σ² · 2 / (K² + H K)) per entry: the references'
`xavier_normal_(gain=σ)` of a (H, K, K) tensor (torch's fans are K·K in and H·K out), σ = 0.3
the authors' 60M config. The released training code leaves them fixed (`fourier_learnable` is
False and no config sets it); `learnable=true` makes them the encoding's parameters, trained as
every position parameter is (no weight decay, train.position_lr_mult times the rate). Either way
they are saved with the model.

The frequency scalings (eval.rope_scaling, train.rope_scaling) act on the kept frequencies and
leave the coefficients alone, as the authors' `len_extra` does after the clip; YaRN's attention
factor multiplies every pair's cos and sin, as it does RoPE's. The distance remaps are refused:
they need RoPE's rotation.
"""
import math
from dataclasses import dataclass

import torch
from torch import nn

from posbench.core.errors import require
from posbench.encodings.base import register
from posbench.encodings.rope import RoPE, apply_rotary, rope_inv_freq

# sin of the position-free pairs: both references pad cos and sin with 1; the paper's zero
# frequency has cos 1, sin 0
FREE_SIN = {"reference": 1.0, "zero_frequency": 0.0}


def kept_pairs(head_dim: int, base: float, train_len: int, clip: bool) -> int:
    """K, the frequencies the series are built from: those that turn within L, ω·L >= 2π (the
    fastest K pairs, HoPE's cut), or all d/2 without the clip."""
    if not clip:
        return head_dim // 2
    # on the CPU whatever the default device: a model may be built on "meta" to be sized
    return int((rope_inv_freq(head_dim, base, "cpu") * train_len >= 2 * math.pi).sum())


def noise_std(sigma: float, n_head: int, kept: int) -> float:
    """The std of xavier_normal_(gain=σ) on a (H, K, K) tensor: σ·sqrt(2 / (fan_in + fan_out))
    with torch's fans of a 3-d tensor, K·K and H·K."""
    return sigma * math.sqrt(2 / (kept * kept + n_head * kept)) if kept else 0.0


@register("fope", "RoPE whose pairs are multiplied by Fourier series (cos and sin coefficients per "
                  "layer and head) of the frequencies that turn within L; the slower ones dropped")
class FoPE(RoPE):
    family = "rotary"
    relative = False
    rotary = True
    rope_remaps = False  # its pairs do not turn by RoPE's rotation: a remapped lag has none
    past_train_len = ("each frequency in the series turned within L, but the series mix them: "
                      "past L they meet combinations of phases unseen in training, and the logits "
                      "read both positions, not the lag")
    reference = ("Fourier Position Embedding: Enhancing Attention's Periodic Extension for Length "
                 "Generalization (Hua et al. 2025)")

    @dataclass
    class Config(RoPE.Config):
        # rope_theta of yiju-zhao/Fourier-Position-Embedding's OLMo configs (its default, 10^4)
        base: float = 10000.0
        # fourier_init_norm_gain of its 60M configs (0.4 at 180M, 0.6 at 1.2B): the xavier gain
        # of the noise added to the identity
        sigma: float = 0.3
        # rope_clamp_floor_freq with rope_clamp_floor_to_zero: drop the frequencies below 2π/L
        # (false: every frequency enters the series, the paper's ablation without the clip)
        clip: bool = True
        # fourier_learnable, False in the released code: the coefficients stay at their init
        learnable: bool = False
        # the position-free pairs: "reference" (cos = sin = 1, as both references pad them) or
        # "zero_frequency" (cos 1, sin 0: no rotation)
        free_pairs: str = "reference"

    @classmethod
    def check(cls, cfg, run_cfg):
        super().check(cfg, run_cfg)
        require(cfg.sigma >= 0, "encoding.sigma", cfg.sigma, "a number >= 0 (the xavier gain "
                "of the coefficients' noise)")
        require(cfg.free_pairs in FREE_SIN, "encoding.free_pairs", cfg.free_pairs,
                "reference (cos = sin = 1, as the references pad them) or zero_frequency "
                "(cos 1, sin 0)")

    def __init__(self, cfg, dims):
        super().__init__(cfg, dims)
        K = self.kept = kept_pairs(dims.head_dim, cfg.base, dims.scaling_len, cfg.clip)
        std = noise_std(cfg.sigma, dims.n_head, K)
        shape = (dims.n_layer, dims.n_head, K, K)
        # per layer and head, the cos and the sin series drawn apart
        cos_coef, sin_coef = (torch.eye(K) + std * torch.randn(shape) for _ in range(2))
        if cfg.learnable:
            self.cos_coef, self.sin_coef = nn.Parameter(cos_coef), nn.Parameter(sin_coef)
        else:
            self.register_buffer("cos_coef", cos_coef)
            self.register_buffer("sin_coef", sin_coef)

    def tables(self, pos: torch.Tensor, layer: int, n: int, dtype):
        """cos and sin (B or 1, H, T, d) of every pair at pos, built in float64, then cast. The
        series read the first K of RoPE's frequencies, scaled as eval.rope_scaling scales them
        (the cut was made at build time, at encoding.base: an NTK base changes the kept
        frequencies, not which are kept)."""
        inv_freq, factor = self.frequencies(n)
        if pos.stride(0) == 0:  # one position row shared by the batch: compute it once
            pos = pos[:1]
        K, half = self.kept, self.dims.head_dim // 2
        with torch.autocast(pos.device.type, enabled=False):
            angles = (pos.to(torch.float64).unsqueeze(-1)
                      * inv_freq[:K].to(pos.device)).unsqueeze(1)  # (B, 1, T, K)
            cos = angles.cos() @ self.cos_coef[layer].double()  # (B, H, T, K)
            sin = angles.sin() @ self.sin_coef[layer].double()
            if K < half:
                free = cos.new_ones(*cos.shape[:-1], half - K)
                cos = torch.cat((cos, free), dim=-1)
                sin = torch.cat((sin, free * FREE_SIN[self.cfg.free_pairs]), dim=-1)
            cos, sin = (torch.cat((x, x), dim=-1) * factor for x in (cos, sin))
        return cos.to(dtype), sin.to(dtype)

    def rotate(self, q, k, pos, layer):
        cos, sin = self.tables(pos, layer, q.shape[2], q.dtype)
        return apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)

    def notes(self):
        trained = "trained" if self.cfg.learnable else "fixed at their init"
        return [f"{self.kept} of {self.dims.head_dim // 2} frequencies enter the Fourier series "
                f"(those that turn within L={self.dims.scaling_len} tokens); the "
                f"{self.dims.head_dim // 2 - self.kept} other pairs carry no position; the "
                f"coefficients are {trained}"]
