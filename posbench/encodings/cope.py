"""CoPE: positions counted by learned gates over the context (Golovneva et al. 2024).

g_ij = sigmoid(q_i.k_j/sqrt(d)) from the masked logits (future gates are 0), the position
p_ij = sum_{t=j..i} g_it clamped to P_max - 1, and z_ij = q_i.e[p_ij] interpolated linearly between
e[floor p] and e[ceil p] (facebookresearch/RAM listing). The logit becomes q_i.k_j/sqrt(d) + z_ij.
Counting needs whole rows, so CoPE is a row_mod (the attention's blockwise path). Position ids are
never read.
"""
from dataclasses import dataclass

import torch
from torch import nn

from posbench.core.errors import ConfigError
from posbench.encodings.base import EncodingConfig, PositionalEncoding, register


def contextual_positions(logits: torch.Tensor, p_max: int) -> torch.Tensor:
    """p_ij = sum_{t >= j} sigmoid(logits_it) over a masked row (-inf gives a gate of 0, so the sum
    stops at i), clamped to p_max - 1. Non-increasing in j."""
    gates = torch.sigmoid(logits)
    return gates.flip(-1).cumsum(-1).flip(-1).clamp(max=p_max - 1)


def interpolate(table: torch.Tensor, p: torch.Tensor) -> torch.Tensor:
    """table[..., p] at fractional p >= 0: (1 - w) table[floor p] + w table[ceil p],
    w = p - floor p. table (..., Tq, P_max), p (..., Tq, Tk)."""
    low = p.floor()
    w = p - low
    return table.gather(-1, low.long()) * (1 - w) + table.gather(-1, p.ceil().long()) * w


@register("cope", "contextual positions: gated counts of the keys from j to i, interpolated")
class CoPE(PositionalEncoding):
    family = "contextual"
    relative = True
    past_train_len = "gated counts clamped at P_max-1: no unseen indices, but counts saturate"
    reference = ("Contextual Position Encoding: Learning to Count What's Important "
                 "(Golovneva et al. 2024)")

    @dataclass
    class Config(EncodingConfig):
        p_max: int = 64

    @classmethod
    def check(cls, cfg, run_cfg):
        if cfg.p_max < 2:
            raise ConfigError(f"encoding.p_max={cfg.p_max} is not accepted; "
                              "expected an integer >= 2")

    def __init__(self, cfg, dims):
        super().__init__(cfg, dims)
        # one table per layer shared by the heads, zero init: training starts position-blind
        self.pos_emb = nn.Parameter(torch.zeros(dims.n_layer, dims.head_dim, cfg.p_max))

    def row_mod(self, logits, q, k, pos, layer, q_idx, kv_idx):
        # counts in fp32 at least: a bf16 running sum of gates drifts by tenths of a position
        # (its spacing is 0.25 between 32 and 64), and the interpolation weight is the fraction
        logits = logits.to(torch.promote_types(logits.dtype, torch.float32))
        rows = q[:, :, q_idx.flatten()].to(logits.dtype)  # this block's queries
        # q_i.e[p] for every integer p (B, H, Tq, P_max): the interpolation gathers from it
        table = rows @ self.pos_emb[layer].to(logits.dtype)
        return logits + interpolate(table, contextual_positions(logits, self.cfg.p_max))

    def flops(self, batch, length, pairs):
        # q_i . e[p] for every integer p (a matmul per token), and per score its gate, the
        # running count, and the interpolation between two table entries (8 operations)
        dims = self.dims
        per_token = 2 * dims.d_model * self.cfg.p_max
        return dims.n_layer * batch * (length * per_token + 8 * dims.n_head * pairs)
