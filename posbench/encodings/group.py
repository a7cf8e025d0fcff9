"""The one-parameter group family: logits q_i^T exp((i - j) X) k_j for a generator X in real Jordan
form (docs/encodings.md#group-family). One module, `GroupPE`, registered under several presets.

Generator of one head, on its half-split layout (pair p = (x_p, x_{p+d/2})):

    X = a_h I  +  ⊕_b C_k(0, -θ_b)  ⊕  0,    C_k(0, -θ) = I_k ⊗ C(0, -θ) + ε N_k ⊗ I_2

a chain b of k consecutive pairs per Jordan block; pairs past the last chain are NoPE channels.
On one chain exp(tC_k) = Σ_{r<k} ((εt)^r / r!) N_k^r ⊗ R(-θt). The sign of θ is chosen so
that k = 1 is RoPE exactly: RoFormer rotates both q and k by +θt, so its lag i - j turns by -θ.
Keys get G(j) = exp(-jX) and queries F(i) = exp(iX^T), so F(i)^T G(j) = exp((i - j)X).

Numerics:
- the shear is εN_k with ε = 1/L (L = training length): similar to N_k, same group law, but
  εΔ <= 1 over the training range, so the polynomial terms stay small where the model is trained;
- the decay is one rate a_h <= 0 per head, so it factors out of the head's dot product and is
  applied as the multiplicative mask e^{a_h Δ} on the score (RetNet's D matrix) instead of
  e^{±a t} on q and k, which overflows fp32 once |a| t > 88;
- angle and polynomial tables are built in float64, the transform itself runs in fp32;
- with a shear (k >= 2) q and k also leave `rotate` in fp32 under bf16 autocast, and q·k must
  be formed from them in fp32: their polynomial terms grow like (εt)^r and cancel in q·k, so
  rounding them to bf16 costs logit errors of about 1 at t = 8192, L = 128 (on CUDA, TF32
  reads them at about a fifth of that: docs/encodings.md). Rotations alone (k = 1) go back to
  q's dtype, as RoPE.

ALiBi as a group: constant augmented coordinates q̄ = (1, 0), k̄ = (0, -m_h) under N_2 give
q̄^T exp(ΔN_2) k̄ = -m_h Δ. A head's q and k cannot grow inside the attention, so this block enters
through its content-independent logit b(Δ) = Σ_r c_r Δ^r, c_r = q̄^T N^r k̄ / r!, added by
`score_mod` after the 1/sqrt(d) scaling, where ALiBi adds its bias.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional

import torch
import torch.nn.functional as F
from torch import nn

from posbench.core.errors import ConfigError
from posbench.encodings.alibi import alibi_slopes
from posbench.encodings.base import EncodingConfig, PositionalEncoding, relative_lag, register

FREQUENCIES = ("rope", "retnet", "none")
DECAYS = ("none", "retnet", "learned")


@dataclass
class GroupConfig(EncodingConfig):
    # k: pairs per Jordan chain; 1 = (damped) rotation, >= 2 = the exotic, defective class
    block_size: int = 2
    # Jordan chains per head; the head's remaining pairs are NoPE channels. None: every pair
    chains: Optional[int] = None
    # θ_b of chain b of n: "rope" base^(-b/n), "retnet" base^(-b/(n-1)), "none" 0
    frequencies: str = "rope"
    base: float = 10000.0
    # a_h: "none" 0, "retnet" ln(1 - 2^(-5-h)), "learned" -softplus(α_h) started at RetNet's
    decay: str = "none"
    # learn θ_b and ε_b per head and chain, as log-offsets from the preset's values
    learn_frequencies: bool = False
    learn_shear: bool = False
    # add ALiBi as the augmented block q̄ = (1, 0), k̄ = (0, -m_h) under N_2
    alibi: bool = False


def chain_frequencies(kind: str, n_total: int, base: float) -> torch.Tensor:
    """θ_b, b = 0..n_total-1, float64. With one pair per chain "rope" is RoPE's base^(-2p/d)."""
    b = torch.arange(n_total, dtype=torch.float64)
    if kind == "rope":
        return base ** (-b / n_total)
    if kind == "retnet":  # microsoft/torchscale RetNetRelPos: 1 / base^linspace(0, 1, d/2)
        return base ** -torch.linspace(0, 1, n_total, dtype=torch.float64)
    return torch.zeros(n_total, dtype=torch.float64)


def retnet_decay(n_head: int) -> torch.Tensor:
    """a_h = ln(1 - 2^(-5-h)), h = 0..H-1 (microsoft/torchscale RetNetRelPos), float64."""
    return torch.log1p(-(2.0 ** (-5.0 - torch.arange(n_head, dtype=torch.float64))))


def shear(u: torch.Tensor, s: torch.Tensor, transpose: bool) -> torch.Tensor:
    """Σ_{r<k} (s^r / r!) N^r u along the last (chain) axis of size k, where (N u)_p = u_{p+1};
    with transpose, N^T: (N^T u)_p = u_{p-1}. s: float64, broadcastable to u[..., 0]."""
    out = u
    for r in range(1, u.shape[-1]):
        moved = F.pad(u[..., :-r], (r, 0)) if transpose else F.pad(u[..., r:], (0, r))
        out = out + (s ** r / math.factorial(r)).to(u.dtype).unsqueeze(-1) * moved
    return out


def exp_map(x: torch.Tensor, t: torch.Tensor, theta: torch.Tensor, eps: torch.Tensor, k: int,
            transpose: bool = False) -> torch.Tensor:
    """exp(tY) x, or exp(tY^T) x with transpose, for Y = ⊕_b C_k(0, -θ_b) with shear ε_b on the
    first n·k pairs of x's half-split layout (n = θ's last size); other pairs are unchanged.

    x: (..., d); t, θ, ε: float64, t broadcastable to x[..., :1] and θ, ε to x[..., :n].
    On chain b: (exp(tY) x)_p = R(-θt) Σ_{r<k} ((εt)^r / r!) x_{p+r}; the transpose takes x_{p-r}
    and turns by +θt. Cost O(k d) per vector. Returns fp32 at least, never bf16.
    """
    dtype = torch.promote_types(x.dtype, torch.float32)
    n = theta.shape[-1]
    m = n * k
    x1, x2 = x.to(dtype).chunk(2, dim=-1)
    u, v = (half[..., :m].unflatten(-1, (n, k)) for half in (x1, x2))
    s = eps * t
    u, v = shear(u, s, transpose), shear(v, s, transpose)
    angle = theta * (t if transpose else -t)  # float64, as RoPE's tables
    cos, sin = (f(angle).to(dtype).unsqueeze(-1) for f in (torch.cos, torch.sin))
    u, v = u * cos + (-v) * sin, v * cos + u * sin  # RoPE's x cos + rotate_half(x) sin
    x1 = torch.cat((u.flatten(-2), x1[..., m:]), dim=-1)
    x2 = torch.cat((v.flatten(-2), x2[..., m:]), dim=-1)
    return torch.cat((x1, x2), dim=-1)


def bias_coefficients(q_bar: torch.Tensor, k_bar: torch.Tensor) -> torch.Tensor:
    """c_r = q̄^T N^r k̄ / r!, so that q̄^T exp(ΔN) k̄ = Σ_r c_r Δ^r. q̄, k̄: (..., k)."""
    k = q_bar.shape[-1]
    return torch.stack([(q_bar[..., :k - r] * k_bar[..., r:]).sum(-1) / math.factorial(r)
                        for r in range(k)], dim=-1)


def alibi_as_group(n_head: int) -> torch.Tensor:
    """Coefficients (H, 2) of b(Δ) = q̄^T exp(ΔN_2) k̄ with q̄ = (1, 0), k̄ = (0, -m_h): -m_h Δ."""
    m = torch.tensor(alibi_slopes(n_head), dtype=torch.float64)
    q_bar = torch.tensor([1.0, 0.0], dtype=torch.float64).expand(n_head, 2)
    k_bar = torch.stack((torch.zeros_like(m), -m), dim=-1)
    return bias_coefficients(q_bar, k_bar).float()


def _pairs_moved(cfg) -> bool:
    """Whether X acts inside the head at all (otherwise q and k pass unchanged)."""
    return cfg.chains != 0 and (cfg.block_size > 1 or cfg.frequencies != "none")


@register("decay", "one exponential decay e^(a_h Δ) per head (RetNet rates) multiplying the score",
          config=GroupConfig(block_size=1, frequencies="none", decay="retnet"))
@register("damped_rope", "RoPE with RetNet's angles, damped by RetNet's per-head decay e^(a_h Δ)",
          config=GroupConfig(block_size=1, frequencies="retnet", decay="retnet"))
@register("alibi_as_group", "ALiBi as the nilpotent N_2 on constant coordinates (1,0), (0,-m_h)",
          config=GroupConfig(block_size=1, chains=0, frequencies="none", alibi=True))
@register("jordan_real", "real nilpotent J_2(0) on 2 pairs per head: a content slope Δ q_0 k_1 / L",
          config=GroupConfig(block_size=2, chains=1, frequencies="none"))
@register("jordan_rope", "exotic default: d/4 complex Jordan blocks C_2(0, ω_p) per head, ε = 1/L",
          config=GroupConfig())
@register("generator_learned", "C_2 Jordan blocks with learned decay, frequencies and shears",
          config=GroupConfig(decay="learned", learn_frequencies=True, learn_shear=True))
class GroupPE(PositionalEncoding):
    family = "group"
    relative = True
    past_train_len = ("polynomial terms (Δ/L)^r grow past L (unbounded logits unless a < 0); "
                      "decay sends far logits to 0, not -inf")
    reference = ("Using group theory to explore the space of positional encodings "
                 "(Puranik, Jane Street 2026); Jordan-RoPE (arXiv 2605.04217)")
    Config = GroupConfig

    @classmethod
    def check(cls, cfg, run_cfg):
        def require(ok, key, value, accepted):
            if not ok:
                raise ConfigError(f"{key}={value!r} is not accepted; expected {accepted}")

        require(cfg.block_size >= 1, "encoding.block_size", cfg.block_size, "an integer >= 1")
        require(cfg.chains is None or cfg.chains >= 0, "encoding.chains", cfg.chains,
                "null or an integer >= 0")
        require(cfg.frequencies in FREQUENCIES, "encoding.frequencies", cfg.frequencies,
                f"one of {FREQUENCIES}")
        require(cfg.base > 1, "encoding.base", cfg.base, "a number > 1")
        require(cfg.decay in DECAYS, "encoding.decay", cfg.decay,
                f"one of {DECAYS} (a growing a > 0 blows up)")
        require(not cfg.learn_frequencies or cfg.frequencies != "none",
                "encoding.learn_frequencies", cfg.learn_frequencies,
                "false when encoding.frequencies='none'")
        require(not cfg.learn_shear or cfg.block_size > 1, "encoding.learn_shear", cfg.learn_shear,
                "false when encoding.block_size=1 (no nilpotent part)")
        if not _pairs_moved(cfg):
            return
        head_dim = run_cfg.model.d_model // run_cfg.model.n_head
        require(head_dim % 2 == 0, "model.d_model/model.n_head", head_dim,
                "an even head dimension (the generator acts on pairs)")
        pairs = head_dim // 2
        if cfg.chains is None:
            require(pairs % cfg.block_size == 0, "encoding.block_size", cfg.block_size,
                    f"a divisor of the head's {pairs} pairs")
        else:
            require(cfg.chains * cfg.block_size <= pairs, "encoding.chains", cfg.chains,
                    f"at most {pairs // cfg.block_size} chains of {cfg.block_size} pairs per head")

    def __init__(self, cfg, dims):
        super().__init__(cfg, dims)
        n_total = dims.head_dim // 2 // cfg.block_size
        n = n_total if cfg.chains is None else cfg.chains
        theta = chain_frequencies(cfg.frequencies, n_total, cfg.base)[:n]
        self.register_buffer("theta", theta[None], persistent=False)  # (1, n) float64
        self.register_buffer("epsilon", torch.full((1, n), 1.0 / dims.train_len,
                                                   dtype=torch.float64), persistent=False)
        # learned as log-offsets, so that weight decay pulls back toward the preset's values
        self.frequency_shift = (nn.Parameter(torch.zeros(dims.n_head, n))
                                if cfg.learn_frequencies else None)
        self.shear_shift = nn.Parameter(torch.zeros(dims.n_head, n)) if cfg.learn_shear else None
        self._init_decay(cfg.decay, dims.n_head)
        alibi = alibi_as_group(dims.n_head) if cfg.alibi else None
        self.register_buffer("alibi_coefficients", alibi, persistent=False)
        # hooks this generator does not need stay absent: the attention keeps its fastest path
        if not _pairs_moved(cfg):
            self.rotate = None
        if cfg.decay == "none" and not cfg.alibi:
            self.score_mod = None
        # ALiBi's bias without decay only adds to the score: the CPU path may fuse it, and
        # reads it from one table of lags (a polynomial of the lag per head)
        self.additive_score_mod = self.lag_only_bias = cfg.alibi and cfg.decay == "none"
        # decay alone multiplies the score by e^{a lag}: the CPU path scales q and k instead
        if cfg.decay == "none" or cfg.alibi:
            self.lag_decay = None

    def _init_decay(self, kind: str, n_head: int):
        rate = retnet_decay(n_head)
        self.register_buffer("decay_rate", rate.float() if kind == "retnet" else None,
                             persistent=False)
        # learned: a = -softplus(α0 + δ) with softplus(α0) = -a_retnet, so a stays <= 0
        self.register_buffer("decay_logit", torch.log(torch.expm1(-rate)).float()
                             if kind == "learned" else None, persistent=False)
        self.decay_shift = nn.Parameter(torch.zeros(n_head)) if kind == "learned" else None

    def frequencies(self) -> torch.Tensor:
        """θ, (1 or H, n) float64."""
        if self.frequency_shift is None:
            return self.theta
        return self.theta * self.frequency_shift.double().exp()

    def shears(self) -> torch.Tensor:
        """ε, (1 or H, n) float64."""
        if self.shear_shift is None:
            return self.epsilon
        return self.epsilon * self.shear_shift.double().exp()

    def decay_rates(self) -> Optional[torch.Tensor]:
        """a_h <= 0, (H,) fp32, or None without decay."""
        if self.decay_shift is None:
            return self.decay_rate
        return -F.softplus(self.decay_logit + self.decay_shift)

    def lag_decay(self, layer: int) -> torch.Tensor:
        return self.decay_rates()

    def rotate(self, q, k, pos, layer):
        if pos.stride(0) == 0:  # one position row shared by the batch: compute it once
            pos = pos[:1]
        t = pos.to(torch.float64)[:, None, :, None]  # (B, 1, T, 1)
        theta, eps = self.frequencies().unsqueeze(-2), self.shears().unsqueeze(-2)  # (H|1, 1, n)
        size = self.cfg.block_size
        # the shear's terms cancel in q·k: they stay in fp32 (module docstring, Numerics)
        dtype = q.dtype if size == 1 else torch.promote_types(q.dtype, torch.float32)
        return (exp_map(q, t, theta, eps, size, transpose=True).to(dtype),  # F(i) = exp(i X^T)
                exp_map(k, -t, theta, eps, size).to(dtype))  # G(j) = exp(-j X)

    def score_mod(self, q, k, pos, layer):
        rates, coefficients, lag_of = self.decay_rates(), self.alibi_coefficients, relative_lag(pos)

        def group(score, b, h, q_idx, kv_idx):
            lag = lag_of(b, q_idx, kv_idx)
            if rates is not None:  # future lags are masked afterwards; clamping keeps them finite
                score = score * torch.exp(rates[h] * lag.clamp(min=0))
            if coefficients is not None:  # b(Δ) = Σ_r c_r Δ^r by Horner
                # indices counted from 0: this score_mod alone among the flex encodings read
                # coefficients[h, -1], and alone disagreed with the CPU on an H100 (2026-11-25)
                top = coefficients.shape[-1] - 1
                bias = coefficients[h, top]
                for r in range(top - 1, -1, -1):
                    bias = bias * lag + coefficients[h, r]
                score = score + bias
            return score

        return group

    def flops(self, batch, length, pairs):
        dims, cfg, H = self.dims, self.cfg, self.dims.n_head
        n, k = self.theta.shape[-1], cfg.block_size
        per_layer = 0
        if self.rotate is not None:
            # θ and ε (per head when learned: exp and product), the keys' -t twice, and for q and
            # k each: the angles and their cos and sin (3 per chain and position, per head when
            # learned), s = εt, each shear order's s^r / r! for both halves and its multiply-add
            # on every moved pair, and RoPE's turn (7 per moved pair and token)
            h_theta = H if cfg.learn_frequencies else 1
            h_eps = H if cfg.learn_shear else 1
            moved = batch * H * length * n * k  # pairs of each half moved, per tensor
            one_side = (3 * h_theta * length * n + h_eps * length * n
                        + 4 * (k - 1) * (h_eps * length * n + moved) + 7 * moved)
            per_layer += 2 * length + 2 * H * n * (h_theta > 1) + 2 * H * n * (h_eps > 1)
            per_layer += 2 * one_side
        if self.score_mod is not None:
            per_layer += pairs  # the lag
            if self.decay_shift is not None:  # a = -softplus(α0 + δ)
                per_layer += 3 * H
            if cfg.decay != "none":  # e^{a lag} per head, times each score
                per_layer += pairs * (2 * H + batch * H)
            if cfg.alibi:  # Horner's multiply-add per order past the constant, then the add
                per_layer += pairs * (2 * H * (self.alibi_coefficients.shape[-1] - 1) + batch * H)
        return dims.n_layer * per_layer

    def notes(self):
        if self.cfg.decay == "none":
            return []
        return ["decay drives far logits to 0, not -inf: in softmax the far keys keep weight e^0 "
                "(docs/encodings.md#group-family)"]

