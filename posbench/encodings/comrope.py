"""ComRoPE (Yu et al. 2025): RoPE whose rotation generator is learned, in commuting b x b blocks
(docs/encodings.md#group-family).

In one dimension ComRoPE-AP gives each layer and head a block-diagonal skew generator
A = diag(B_0, ..., B_{m-1}), B_i = P_i - P_i^T with a learned b x b matrix P_i, m = d/b, and turns
queries and keys by G(t) = exp((t/L) A), block by block. Blocks on disjoint coordinates commute,
so G(i)^T G(j) = exp(((j - i)/L) A): the logit depends on the lag alone, for any learned P.

Positions enter in units of the training length L, as the reference measures positions in units
of the image side: one optimizer step moves an angular speed by about lr/L per token, not lr.
Block i holds the pairs i*b/2 .. (i+1)*b/2 - 1 of RoPE's half-split layout (its coordinates
p and p + d/2 for each such pair), and A starts at RoPE's generator, B_i turning pair p by
L*θ_p per unit (θ_p = base^(-2p/d)): an untrained comrope is `rope`. With b = 2 a block is one
pair and ComRoPE is RoPE with a learned speed per pair, layer and head; larger blocks also learn
the planes their pairs turn in.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from posbench.core.errors import require
from posbench.encodings.base import EncodingConfig, PositionalEncoding, register
from posbench.encodings.rope import rope_inv_freq


def to_blocks(x: torch.Tensor, b: int) -> torch.Tensor:
    """(..., d) in the half-split layout to (..., d/b, b): block i holds the first coordinates of
    pairs i*b/2 .. (i+1)*b/2 - 1, then their second coordinates."""
    half = x.shape[-1] // 2
    return x.unflatten(-1, (2, half // (b // 2), b // 2)).transpose(-3, -2).flatten(-2)


def from_blocks(x: torch.Tensor) -> torch.Tensor:
    """The inverse of to_blocks."""
    m, b = x.shape[-2:]
    return x.unflatten(-1, (2, b // 2)).transpose(-3, -2).flatten(-3)


@dataclass
class ComRoPEConfig(EncodingConfig):
    # Longin-Yu/ComRoPE model.py: block_size 2 is its config's default
    block_size: int = 2
    # the RoPE spectrum A starts at
    base: float = 10000.0


@register("comrope", "ComRoPE-AP: RoPE with a learned skew generator in commuting b x b blocks "
                     "per layer and head, starting at RoPE's")
class ComRoPE(PositionalEncoding):
    family = "group"
    relative = True
    past_train_len = ("as RoPE: rotations, so slow blocks reach angles unseen in training; the "
                      "learned generator changes which")
    reference = ("ComRoPE: Scalable and Robust Rotary Position Embedding Parameterized by "
                 "Trainable Commuting Angle Matrices (Yu et al. 2025), ComRoPE-AP")
    Config = ComRoPEConfig

    @classmethod
    def check(cls, cfg, run_cfg):
        head_dim = run_cfg.model.d_model // run_cfg.model.n_head
        require(cfg.block_size >= 2 and cfg.block_size % 2 == 0, "encoding.block_size",
                cfg.block_size, "an even integer >= 2 (a block holds whole pairs)")
        require(head_dim % cfg.block_size == 0, "model.d_model/model.n_head", head_dim,
                f"a head dimension divisible by encoding.block_size={cfg.block_size}")
        require(cfg.base > 1, "encoding.base", cfg.base, "a number > 1")
        require(cfg.block_size == 2 or run_cfg.train.get("budget", "tokens") != "flops",
                "encoding.block_size", cfg.block_size,
                "2 under train.budget=flops (a larger block's matrix exponential costs what its "
                "learned generator's norm asks, which no count from the config can declare)")

    def __init__(self, cfg, dims):
        super().__init__(cfg, dims)
        d, b = dims.head_dim, cfg.block_size
        # RoPE's generator in block form: B[b/2 + r, r] = L θ_p, B[r, b/2 + r] = -L θ_p; P = B/2
        speed = dims.train_len * rope_inv_freq(d, cfg.base).view(d // b, b // 2)
        B = torch.zeros(d // b, b, b, dtype=torch.float64)
        r = torch.arange(b // 2)
        B[:, b // 2 + r, r], B[:, r, b // 2 + r] = speed, -speed
        self.generator = nn.Parameter((B / 2).float().expand(dims.n_layer, dims.n_head, -1, -1,
                                                            -1).clone())

    def maps(self, pos: torch.Tensor, layer: int) -> torch.Tensor:
        """G(t) = exp((t/L) A) per block, (B, H, T, d/b, b, b), float64."""
        P = self.generator[layer].double()
        A = P - P.transpose(-2, -1)  # (H, m, b, b)
        t = pos.double()[:, None, :, None] / self.dims.train_len  # (B, 1, T, 1)
        if self.cfg.block_size == 2:
            # a 2 x 2 skew block [[0, -w], [w, 0]] exponentiates to the rotation by w t: exact,
            # and its cost does not depend on w, as matrix_exp's squarings do
            angle = t * A[:, None, :, 1, 0]  # (B, H, T, m)
            cos, sin = angle.cos(), angle.sin()
            return torch.stack((cos, -sin, sin, cos), dim=-1).unflatten(-1, (2, 2))
        return torch.linalg.matrix_exp(t[..., None, None] * A[None, :, None])

    def rotate(self, q, k, pos, layer):
        if pos.stride(0) == 0:  # one position row shared by the batch: compute it once
            pos = pos[:1]
        dtype = torch.promote_types(q.dtype, torch.float32)
        G = self.maps(pos, layer).to(dtype)
        b = self.cfg.block_size
        with torch.autocast(q.device.type, enabled=False):
            def turn(x):
                return from_blocks((G @ to_blocks(x.to(dtype), b).unsqueeze(-1)).squeeze(-1))

            return turn(q).to(q.dtype), turn(k).to(k.dtype)  # G orthogonal: G^{-T} = G

    def flops(self, batch, length, pairs):
        # per layer: A = P - P^T and t/L; the maps of the position row (b = 2: the angle, its cos
        # and sin and -sin, 4 per block and head; larger blocks: tA, and matrix_exp's degree-18
        # Taylor polynomial, 4 products of b x b, without the squarings that check refuses to
        # budget); then G @ x for q and k (2 b^2 per block and token, b per model coordinate)
        dims, b = self.dims, self.cfg.block_size
        blocks = dims.n_head * (dims.head_dim // b)
        maps = 4 * blocks * length if b == 2 else blocks * length * (b * b + 8 * b ** 3)
        return dims.n_layer * (blocks * b * b + length + maps
                               + 4 * batch * length * dims.d_model * b)
