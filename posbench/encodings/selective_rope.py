"""Selective RoPE (Movahedi et al. 2025): RoPE's rotation of q and k, turned by running sums of
angles that the tokens choose instead of by their positions (docs/encodings.md#contextual-family).

Layer l, head h reads the attention's input x_t (after the block's LayerNorm), cut into H chunks
of D/H, each L2-normalized (x̂_t). Each pair p of the head gets one increment per token,

    φ_t = σ(g_h · x̂_t + c_h) · act(Σ_{s<K} w_{p,s} u_{t-K+1+s}),   u_t = P x̂_t,

with P a projection (per head over its chunk, weight-normalized: "full_rank"; or D -> r -> H d/2:
"low_rank"), a depthwise causal convolution of K taps (zeros before the sequence), act SiLU or the
identity, and the sigmoid gate optional. Its phase is the running sum φ̃_t = Σ_{s<=t} φ_s, and
q_t, k_t are rotated on RoPE's half-split pairs by θ_p φ̃_t with RoPE's frequencies
θ_p = m base^(-2p/d), so the logit of query i and key j reads

    φ̃_i - φ̃_j = Σ_{s=j+1..i} φ_s

per pair: a rotation by the angles of the tokens between them. Position ids are never read. It is
FoX's construction with an imaginary gate: FoX sums log f_s, a decay; this sums i θ_p φ_s, a turn.
With phase_bias a constant e^b joins every increment, so an input part of zero is RoPE at base
`base` (docs/group_theory.md).

How it is computed (a row_mod, exact): the rotation needs x, which the rotate hook does not get
(docs/design.md#the-encoding-contract), and no bias of per-token scalars gives a rotated q.k, so
each block of query rows forms its rotated logits from the whole q and k in fp32 at least, on the
blockwise path (the memory of one block of logits). Phases are summed and turned into cos and sin
in float64, as RoPE's tables are built.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from posbench.core.errors import require
from posbench.encodings.base import EncodingConfig, PositionalEncoding, register
from posbench.encodings.rope import apply_rotary, rope_inv_freq

PROJECTIONS = ("full_rank", "low_rank")
ACTIVATIONS = ("silu", "none")
# inside the L2 normalization of each chunk of x: x / sqrt(|x|^2 + eps), as fla's l2_norm
X_NORM_EPS = 1e-6


@dataclass
class SelectiveRoPEConfig(EncodingConfig):
    # timurcarstensen/selective-rope (the authors' code), SelectiveRoPE with the values of its
    # language-modelling sweep (configs/language_modeling/language_modeling.yaml): temp_type
    # "rope" with temp_theta 500000 and temp_max 1 (the frequencies, not learned),
    # phi_parametrization "full-rank", d_conv 4, conv_act silu, use_gate with the "standard"
    # gate (one sigmoid per head), use_bias off; its models' _init_weights draw every nn.Linear
    # and nn.Conv1d weight N(0, initializer_range^2 = 0.02^2) with zero biases
    base: float = 500000.0
    max_frequency: float = 1.0
    projection: str = "full_rank"
    rank: int = 16  # low_rank's r (phi_proj_rank, the module's default)
    conv_size: int = 4
    conv_activation: str = "silu"
    phase_gate: bool = True
    phase_bias: bool = False
    init_std: float = 0.02


@register("selective_rope", "Selective RoPE: RoPE's rotations by running sums of angles read from "
                            "the tokens (projection, causal convolution, sigmoid gate), not by "
                            "position")
class SelectiveRoPE(PositionalEncoding):
    family = "contextual"
    relative = True
    reads_input = True
    past_train_len = ("no positions: phases are running sums of per-token angles, defined at any "
                      "length; far keys can reach phase gaps on the slow pairs that no training "
                      "span produced")
    reference = "Selective Rotary Position Embedding (Movahedi et al. 2025)"
    Config = SelectiveRoPEConfig

    @classmethod
    def check(cls, cfg, run_cfg):
        require(cfg.base > 1, "encoding.base", cfg.base, "a number > 1")
        require(cfg.max_frequency > 0, "encoding.max_frequency", cfg.max_frequency,
                "a number > 0")
        require(cfg.projection in PROJECTIONS, "encoding.projection", cfg.projection,
                "full_rank or low_rank")
        require(cfg.rank >= 1, "encoding.rank", cfg.rank, "an integer >= 1")
        require(cfg.conv_size >= 1, "encoding.conv_size", cfg.conv_size, "an integer >= 1")
        require(cfg.conv_activation in ACTIVATIONS, "encoding.conv_activation",
                cfg.conv_activation, "silu or none")
        require(cfg.init_std >= 0, "encoding.init_std", cfg.init_std, "a number >= 0")
        require(not run_cfg.train.get("pack_documents", False), "train.pack_documents", True,
                f"false for encoding={cfg.name}: its causal convolution reads the tokens before "
                "each one, across a document's start")
        head_dim = run_cfg.model.d_model // run_cfg.model.n_head
        require(head_dim % 2 == 0, "model.d_model/model.n_head", head_dim,
                "an even head dimension (rotary pairs)")

    def __init__(self, cfg, dims):
        super().__init__(cfg, dims)
        n, H, D, d = dims.n_layer, dims.n_head, dims.d_model, dims.head_dim
        half, chunk = d // 2, D // H

        def normal(*shape):
            return nn.Parameter(torch.randn(n, *shape) * cfg.init_std)

        if cfg.projection == "full_rank":
            # ChunkedLinear: per head, chunk -> d/2, kaiming-uniform directions (only their
            # direction counts: each output's weights are normalized) times a scale that starts at 1
            bound = math.sqrt(6 / half)
            self.proj_weight = nn.Parameter((torch.rand(n, H, chunk, half) * 2 - 1) * bound)
            self.proj_scale = nn.Parameter(torch.ones(n, H))
        else:
            self.proj_down, self.proj_up = normal(cfg.rank, D), normal(H * half, cfg.rank)
        self.conv_weight = normal(H * half, cfg.conv_size)
        if cfg.phase_gate:
            self.gate_weight, self.gate_bias = normal(H, D), nn.Parameter(torch.zeros(n, H))
        if cfg.phase_bias:
            self.phase_bias = nn.Parameter(torch.zeros(n, H, half))  # e^0 = 1 per token
        self.register_buffer("inv_freq", rope_inv_freq(d, cfg.base) * cfg.max_frequency,
                             persistent=False)

    def increments(self, x: torch.Tensor, layer: int) -> torch.Tensor:
        """φ_t of every token and pair, (B, H, T, d/2), in fp32 at least."""
        cfg = self.cfg
        B, T, D = x.shape
        H, half = self.dims.n_head, self.dims.head_dim // 2
        dtype = torch.promote_types(x.dtype, torch.float32)
        with torch.autocast(x.device.type, enabled=False):
            chunks = x.to(dtype).view(B, T, H, D // H)
            chunks = chunks * torch.rsqrt(chunks.square().sum(-1, keepdim=True) + X_NORM_EPS)
            flat = chunks.reshape(B, T, D)
            if cfg.projection == "full_rank":
                w = F.normalize(self.proj_weight[layer].to(dtype), dim=-2)  # unit columns
                w = w * self.proj_scale[layer].to(dtype).view(H, 1, 1)
                u = torch.einsum("bthc,hcp->bthp", chunks, w).reshape(B, T, H * half)
            else:
                u = flat @ self.proj_down[layer].to(dtype).T @ self.proj_up[layer].to(dtype).T
            # depthwise and causal: tap K-1 is the token itself, zeros before the sequence
            K = cfg.conv_size
            phi = F.conv1d(F.pad(u.transpose(1, 2), (K - 1, 0)),
                           self.conv_weight[layer].to(dtype).unsqueeze(1), groups=H * half)
            if cfg.conv_activation == "silu":
                phi = F.silu(phi)
            phi = phi.view(B, H, half, T).transpose(-2, -1)
            if cfg.phase_bias:
                phi = phi + self.phase_bias[layer].to(dtype).exp().unsqueeze(1)
            if cfg.phase_gate:
                gate = torch.sigmoid(flat @ self.gate_weight[layer].to(dtype).T
                                     + self.gate_bias[layer].to(dtype))  # (B, T, H)
                phi = phi * gate.transpose(1, 2).unsqueeze(-1)
        return phi

    def phases(self, x: torch.Tensor, layer: int) -> torch.Tensor:
        """φ̃_t = Σ_{s<=t} φ_s, (B, H, T, d/2), float64."""
        return self.increments(x, layer).to(torch.float64).cumsum(2)

    def tables(self, x: torch.Tensor, layer: int, dtype):
        """cos and sin of θ_p φ̃_t on the half-split layout, (B, H, T, d), in `dtype`."""
        angles = self.phases(x, layer) * self.inv_freq.to(device=x.device)
        angles = torch.cat((angles, angles), dim=-1)
        return angles.cos().to(dtype), angles.sin().to(dtype)

    def row_mod(self, logits, q, k, pos, layer, q_idx, kv_idx, *, x):
        """q̃_i · k̃_j / sqrt(d) for the block's query rows and keys (consecutive sequence indices,
        keys from any start): phases from the whole sequence, read where the block needs them
        (the running sum is causal, so no later token reaches them)."""
        rows, keys = q_idx.flatten(), kv_idx.flatten()
        dtype = torch.promote_types(q.dtype, torch.float32)
        cos, sin = self.tables(x, layer, dtype)
        with torch.autocast(q.device.type, enabled=False):
            q_rot = apply_rotary(q[:, :, rows].to(dtype), cos[:, :, rows], sin[:, :, rows])
            k_rot = apply_rotary(k[:, :, keys].to(dtype), cos[:, :, keys], sin[:, :, keys])
            return (q_rot * (1 / math.sqrt(q.shape[-1]))) @ k_rot.transpose(-2, -1)

    def flops(self, batch, length, pairs):
        """Per token: the chunks' L2 norm, the projection, the causal convolution and its
        activation, the gate, the running sum, cos and sin, q and k rotated and q scaled; per
        score, the rotated logit (2d), which replaces the attention's own."""
        cfg, H, D, d = self.cfg, self.dims.n_head, self.dims.d_model, self.dims.head_dim
        half = H * d // 2  # increments per token
        projection = D * d if cfg.projection == "full_rank" else 2 * cfg.rank * (D + half)
        per_token = (3 * D + 2 * H + projection + 2 * cfg.conv_size * half
                     + half * (cfg.conv_activation == "silu") + half * cfg.phase_bias
                     + (2 * D * H + 2 * H + half) * cfg.phase_gate
                     + 2 * half  # running sum, angles
                     + 2 * D + 7 * D + D)  # cos and sin, the rotation of q and k, q's scale
        return self.dims.n_layer * batch * (length * per_token + 2 * D * pairs)
