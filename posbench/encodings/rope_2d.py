"""2-D (axial) RoPE: the first half of each head rotates with position x, the second with y.

Text has one position t; posbench reads it as (x, y) = (t // chunk, t % chunk), the chunk index
and the offset inside the chunk. Scores then depend on (dx, dy), which a shift of t by a constant
changes unless the constant is a multiple of `chunk`: as a 1-D encoding this is absolute.
eval.rope_scaling is not offered: s = n/L describes neither axis (the offset never passes chunk).
"""
from dataclasses import dataclass

import torch

from posbench.core.errors import ConfigError
from posbench.encodings.base import EncodingConfig, PositionalEncoding, register
from posbench.encodings.rope import apply_rotary, rope_inv_freq, rope_tables


def axial_rotate(x: torch.Tensor, x_tables, y_tables):
    """1-D RoPE of the first half of x by x_tables and of the second half by y_tables, each the
    (cos, sin) of rope_tables for a d/2-dimensional RoPE; x (B, H, T, d)."""
    half_x, half_y = x.chunk(2, dim=-1)
    return torch.cat((apply_rotary(half_x, *x_tables), apply_rotary(half_y, *y_tables)), dim=-1)


def chunk_coordinates(pos: torch.Tensor, chunk: int):
    """(x, y) = (chunk index, offset in the chunk) of 1-D positions."""
    return torch.div(pos, chunk, rounding_mode="floor"), pos.remainder(chunk)


@register("rope_2d", "axial RoPE on (chunk index, offset): half the head per axis")
class RoPE2D(PositionalEncoding):
    family = "rotary"
    relative = False
    past_train_len = "the offset axis stays in range; chunk indices past L/chunk were never seen"
    reference = "HF blog, You could have designed state of the art positional encoding (2-D RoPE)"

    @dataclass
    class Config(EncodingConfig):
        base: float = 10000.0
        # tokens per chunk: a 1-D position t becomes (t // chunk, t % chunk)
        chunk: int = 64

    @classmethod
    def check(cls, cfg, run_cfg):
        if not cfg.base > 1:
            raise ConfigError(f"encoding.base={cfg.base} is not accepted; expected a number > 1")
        if cfg.chunk < 1:
            raise ConfigError(f"encoding.chunk={cfg.chunk} is not accepted; expected a positive "
                              "integer")
        head_dim = run_cfg.model.d_model // run_cfg.model.n_head
        if head_dim % 4:
            raise ConfigError(f"model.d_model/model.n_head={head_dim} is not accepted; 2-D RoPE "
                              "needs a head dimension divisible by 4 (two rotary halves)")

    def __init__(self, cfg, dims):
        super().__init__(cfg, dims)
        # theta_p = b^(-2p/(d/2)), p < d/4: each axis is a RoPE of dimension d/2
        self.register_buffer("inv_freq", rope_inv_freq(dims.head_dim // 2, cfg.base),
                             persistent=False)

    def rotate_2d(self, q, k, px, py):
        # one pair of tables per axis, shared by q and k
        x_tables, y_tables = (rope_tables(p, self.inv_freq, q.dtype) for p in (px, py))
        return axial_rotate(q, x_tables, y_tables), axial_rotate(k, x_tables, y_tables)

    def rotate(self, q, k, pos, layer):
        if pos.stride(0) == 0:  # one position row shared by the batch: compute it once
            pos = pos[:1]
        return self.rotate_2d(q, k, *chunk_coordinates(pos, self.cfg.chunk))

    def flops(self, batch, length, pairs):
        # q and k rotated as RoPE rotates them (7 per model coordinate); the position row split
        # into (x, y) (a division) and each axis's tables over half the head (4.5 per coordinate
        # of a d/2-dimensional RoPE, so 4.5 per head coordinate for the two)
        dims = self.dims
        return dims.n_layer * (7 * batch * length * dims.d_model + length
                               + 4.5 * length * dims.head_dim)
