"""GRAPE, Group Representational Position Encoding (Zhang et al. 2026): positions act by a
one-parameter group G(t) = exp(tA), queries by G(i) and keys by G(j)^{-T}, so that
q̃_i · k̃_j = q_i^T G(i)^T G(j)^{-T} k_j = q_i^T G(i - j)^T k_j depends on the lag alone
(docs/encodings.md#group-family).

GRAPE-M (`grape_m`), multiplicative: A = Σ_p θ_p L_p is a sum of rank-2 skew generators on
mutually orthogonal planes, L_p = b_p a_p^T - a_p b_p^T for an orthonormal pair (a_p, b_p), which
turns a_p toward b_p. The planes commute, and each one exponentiates in closed form by Rodrigues'
formula, exp(sL_p) = I + sin(s) L_p + (1 - cos s) L_p^2: a turn by s inside the plane, the
identity outside it. G is orthogonal, so G^{-T} = G and both sides turn alike. With the frame F
whose columns are a_0..a_{m-1}, b_0..b_{m-1} (m = d/2), G(t) = F R(tθ) F^T, where R turns
coordinate pair (p, p + m) by tθ_p: on the canonical planes (F = I) this is RoPE's map.

GRAPE-A (`grape_a`), additive: the lift q̂ = [q; 1; 0], k̂ = [k; 0; 1] and the nilpotent
A = -ω e_{d+2} e_{d+1}^T (A^2 = 0): G(t) = I + tA and q̂_i^T G(i - j)^T k̂_j = q_i·k_j - ω(i - j).
With ω = m_h, ALiBi's slope, it is ALiBi; the gated forms let the content set the slope,
ω_h m_h (λ_q(q_i) + λ_k(k_j)), λ = softplus of a learned direction. The lift only adds this
scalar, so it enters as a bias in score_mod, after the 1/sqrt(d) scaling, where ALiBi adds its
own.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional

import torch
import torch.nn.functional as F
from torch import nn

from posbench.core.errors import require
from posbench.encodings.alibi import alibi_slopes
from posbench.encodings.base import EncodingConfig, PositionalEncoding, relative_lag, register
from posbench.encodings.rope import rope_inv_freq

PLANES = ("learned", "canonical")
GATES = ("query_key", "query", "key", "none")


def turn(x: torch.Tensor, frame: Optional[torch.Tensor], cos: torch.Tensor,
         sin: torch.Tensor) -> torch.Tensor:
    """G(t) x = F R(tθ) F^T x: the coordinates (u_p, v_p) = (a_p·x, b_p·x) of x on each plane
    turn to (u cos - v sin, u sin + v cos). frame: F (..., d, d), or None for the canonical
    planes (F = I, RoPE's half-split pairs)."""
    coords = x if frame is None else x @ frame
    u, v = coords.chunk(2, dim=-1)
    turned = torch.cat((u * cos - v * sin, u * sin + v * cos), dim=-1)
    return turned if frame is None else turned @ frame.transpose(-2, -1)


@dataclass
class GrapeMConfig(EncodingConfig):
    # "learned": an orthonormal frame of planes per layer and head, F = exp(S - S^T), S strictly
    # upper triangular and learned from 0 (so training starts on the canonical planes), the
    # paper's RoPE "in a learned orthogonal basis" (its Proposition 3.1); "canonical": the
    # coordinate pairs (p, p + d/2), model-architectures/GRAPE llama-mha-grape-m-nonctx.py
    planes: str = "learned"
    # the rest as llama-mha-grape-m-nonctx.py's GPTConfig: θ_p start at base^(-2p/d), learned per
    # layer, one spectrum shared by the heads, with log θ_p moved by δ/16 for a learned δ (its
    # log_freq_scale: the spectrum learns 16 times slower than a free log-frequency)
    base: float = 10000.0
    learn_frequencies: bool = True
    share_frequencies: bool = True
    log_freq_scale: float = 16.0


@register("grape_m", "GRAPE-M: commuting rank-2 rotations on learned orthonormal planes with a "
                     "learned RoPE spectrum (Rodrigues)")
class GrapeM(PositionalEncoding):
    family = "group"
    relative = True
    past_train_len = ("as RoPE: a rotation group, so slow planes reach angles unseen in training; "
                      "learned planes and frequencies change which")
    reference = "GRAPE: Group Representational Position Encoding (Zhang et al. 2026), GRAPE-M"
    Config = GrapeMConfig

    @classmethod
    def check(cls, cfg, run_cfg):
        require(cfg.planes in PLANES, "encoding.planes", cfg.planes, f"one of {PLANES}")
        require(cfg.base > 1, "encoding.base", cfg.base, "a number > 1")
        require(cfg.log_freq_scale > 0, "encoding.log_freq_scale", cfg.log_freq_scale,
                 "a number > 0")
        head_dim = run_cfg.model.d_model // run_cfg.model.n_head
        require(head_dim % 2 == 0, "model.d_model/model.n_head", head_dim,
                 "an even head dimension (the planes pair its coordinates)")

    def __init__(self, cfg, dims):
        super().__init__(cfg, dims)
        d, m = dims.head_dim, dims.head_dim // 2
        self.register_buffer("theta", rope_inv_freq(d, cfg.base), persistent=False)  # float64
        heads = 1 if cfg.share_frequencies else dims.n_head
        self.frequency_shift = (nn.Parameter(torch.zeros(dims.n_layer, heads, m))
                                if cfg.learn_frequencies else None)
        # S's entries above the diagonal, one generator per layer and head
        learned = cfg.planes == "learned"
        entries = (dims.n_layer, dims.n_head, d * (d - 1) // 2)
        self.frame_generator = nn.Parameter(torch.zeros(entries)) if learned else None
        self.register_buffer("upper", torch.triu_indices(d, d, 1) if learned else None,
                             persistent=False)

    def frequencies(self, layer: int) -> torch.Tensor:
        """θ, (1 or H, d/2) float64."""
        if self.frequency_shift is None:
            return self.theta[None]
        shift = self.frequency_shift[layer].double()
        return self.theta * torch.exp(shift / self.cfg.log_freq_scale)

    def frame(self, layer: int) -> Optional[torch.Tensor]:
        """F = exp(S - S^T) (H, d, d), fp32 at least, columns a_0..a_{m-1}, b_0..b_{m-1};
        None for the canonical planes."""
        if self.frame_generator is None:
            return None
        entries = self.frame_generator[layer]
        entries = entries.to(torch.promote_types(entries.dtype, torch.float32))
        d = self.dims.head_dim
        S = entries.new_zeros(entries.shape[0], d, d)
        S[:, self.upper[0], self.upper[1]] = entries
        with torch.autocast(S.device.type, enabled=False):
            return torch.linalg.matrix_exp(S - S.transpose(-2, -1))

    def rotate(self, q, k, pos, layer):
        if pos.stride(0) == 0:  # one position row shared by the batch: compute it once
            pos = pos[:1]
        dtype = torch.promote_types(q.dtype, torch.float32)
        angle = pos.double()[:, None, :, None] * self.frequencies(layer)[None, :, None, :]
        cos, sin = angle.cos().to(dtype), angle.sin().to(dtype)  # (B, 1 or H, T, d/2)
        frame = self.frame(layer)
        # the frame's projections stay in fp32 under autocast; the result goes back to q's dtype,
        # as RoPE's does
        with torch.autocast(q.device.type, enabled=False):
            frame = None if frame is None else frame.to(dtype)
            return (turn(q.to(dtype), frame, cos, sin).to(q.dtype),
                    turn(k.to(dtype), frame, cos, sin).to(k.dtype))  # G(j)^{-T} = G(j)

    def flops(self, batch, length, pairs):
        # q and k turned as RoPE turns them (7 per model coordinate), and with a learned frame
        # each projected onto it and back (two d x d products per head)
        D, d = self.dims.d_model, self.dims.head_dim
        frame = 8 * D * d if self.frame_generator is not None else 0
        return self.dims.n_layer * batch * length * (7 * D + frame)


@dataclass
class GrapeAConfig(EncodingConfig):
    # which content sets the slope: "query_key" λ_q(q_i) + λ_k(k_j), the paper's eq. 4.6
    # (GRAPE-A-QK, llama-mha-grape-a-querykeygated.py); "query" λ_q(q_i) alone
    # (-querygated.py); "key" λ_k(k_j) alone (-keygated.py); "none": slope ω_h m_h, the exact
    # ALiBi lift of the paper's Section 4.2
    gate: str = "query_key"
    # ω_h = softplus(ρ_h) >= 0 per layer and head, starting at this value (the reference's
    # omega_init None: 1)
    omega_init: float = 1.0


@register("grape_a", "GRAPE-A: ALiBi's slopes scaled by learned ω_h and softplus gates on the "
                     "query and key (unipotent lift)")
class GrapeA(PositionalEncoding):
    family = "group"
    relative = True
    additive_score_mod = True
    past_train_len = ("defined at every distance: a linear penalty whose slope the content sets, "
                      "ALiBi's window with gates")
    reference = "GRAPE: Group Representational Position Encoding (Zhang et al. 2026), GRAPE-A"
    Config = GrapeAConfig

    @classmethod
    def check(cls, cfg, run_cfg):
        require(cfg.gate in GATES, "encoding.gate", cfg.gate, f"one of {GATES}")
        require(cfg.omega_init > 0, "encoding.omega_init", cfg.omega_init, "a number > 0")

    def __init__(self, cfg, dims):
        super().__init__(cfg, dims)
        H, d = dims.n_head, dims.head_dim
        self.register_buffer("slopes", torch.tensor(alibi_slopes(H)), persistent=False)
        self.omega_logit = nn.Parameter(
            torch.full((dims.n_layer, H), math.log(math.expm1(cfg.omega_init))))

        # gate directions start N(0, 1/d), as the reference's u and v, and are used normalized
        def direction():
            return nn.Parameter(torch.randn(dims.n_layer, H, d) / math.sqrt(d))

        self.query_gate = direction() if cfg.gate in ("query_key", "query") else None
        self.key_gate = direction() if cfg.gate in ("query_key", "key") else None

    @staticmethod
    def gate(x: torch.Tensor, direction: torch.Tensor) -> torch.Tensor:
        """λ = softplus(û_h · x / sqrt(d)), û = u/|u|: (B, H, T), fp32 at least."""
        dtype = torch.promote_types(x.dtype, torch.float32)
        unit = F.normalize(direction.to(dtype), dim=-1, eps=1e-6)
        with torch.autocast(x.device.type, enabled=False):
            along = (x.to(dtype) @ unit.unsqueeze(-1)).squeeze(-1)
        return F.softplus(along / math.sqrt(x.shape[-1]))

    def gates(self, q, k, layer):
        """The rate ω_h m_h (H,) and the gates λ_q(q_i), λ_k(k_j) (B, H, T), None where unused."""
        query = None if self.query_gate is None else self.gate(q, self.query_gate[layer])
        key = None if self.key_gate is None else self.gate(k, self.key_gate[layer])
        return F.softplus(self.omega_logit[layer]) * self.slopes, query, key

    def bias_factors(self, q, k, pos, layer):
        """-ω m (λ_q(q_i) + λ_k(k_j)) (p_i - p_j) with p measured from p_o, less its row term
        -ω m λ_q(q_i) p_i: (ω m λ_q(q_i)) p_j, plus with a key gate (-ω m p_i) λ_k(k_j) and
        1 · (ω m λ_k(k_j) p_j)."""
        rate, query, key = self.gates(q, k, layer)
        rate = rate.view(-1, 1)  # (H, 1)
        # the query's term, or with no gate at all the rate's; a key gate alone has none
        lead = rate * query if query is not None else (rate if key is None else None)

        def factors(origin):
            p = (pos - pos[:, origin:origin + 1]).to(rate.dtype).unsqueeze(1)  # (B or 1, 1, T)
            a, b = ([lead], [p]) if lead is not None else ([], [])
            if key is not None:
                a += [-rate * p, torch.ones_like(key)]
                b += [key, rate * key * p]
            shape = torch.broadcast_shapes(*(t.shape for t in a + b))
            return (torch.stack([t.expand(shape) for t in a], -1),
                    torch.stack([t.expand(shape) for t in b], -1))

        return factors

    def score_mod(self, q, k, pos, layer):
        (rate, query, key), lag_of = self.gates(q, k, layer), relative_lag(pos)

        def grape_a(score, b, h, q_idx, kv_idx):
            slope = rate[h]
            if query is not None and key is not None:
                slope = slope * (query[b, h, q_idx] + key[b, h, kv_idx])
            elif query is not None:
                slope = slope * query[b, h, q_idx]
            elif key is not None:
                slope = slope * key[b, h, kv_idx]
            return score - slope * lag_of(b, q_idx, kv_idx)

        return grape_a

    def flops(self, batch, length, pairs):
        # per gate: its direction normalized, û·x/sqrt(d) (a d-long dot product per token and
        # head) and its softplus; the rate ω_h m_h; the slope: the rate times the two gates'
        # sum per score, or times one gate per token, or the rate alone; then per score the lag,
        # the slope times it (per sequence, or per head without gates) and the subtraction
        dims, H = self.dims, self.dims.n_head
        gated = (self.query_gate is not None) + (self.key_gate is not None)
        per_gate = H * dims.head_dim + 2 * batch * length * dims.d_model + 2 * batch * H * length
        slope = {0: 0, 1: batch * H * length, 2: 2 * batch * H * pairs}[gated]
        per_pair = 1 + (batch * H if gated else H) + batch * H
        return dims.n_layer * (gated * per_gate + 2 * H + slope + pairs * per_pair)
