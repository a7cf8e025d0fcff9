"""Causal attention under a bias that depends on the head and the lag alone, on CPU: fused SDPA
per block of queries, its mask a strided view of one (H, lags) table, so no mask is ever built.

A bias b_h(i - j) is constant along the diagonals of the (query, key) square. With the keys in
reverse order, row r of a block of n queries that starts at sequence index s (query s + r) meets
reversed key j' (key s + n - 1 - j') at lag r + j' - (n - 1): the block's mask is
padded[h, r + j' + ROWS - n], a view with strides (1, 1) over the rows and keys of the table of
lags 0..T-1 after ROWS - 1 entries of -inf, the future keys. Its cost over RoPE's causal kernel is
the upper triangle of each diagonal block, which a float mask makes SDPA compute, ROWS/T of the
work, and the mask's reads, which stay in cache.
"""
from __future__ import annotations

from typing import Callable, Optional

import torch
import torch.nn.functional as F

# query rows per SDPA call: waste ROWS / T of the causal work on the diagonal blocks' upper
# triangles, against one Python call per block
ROWS = 256


def lag_table(score_mod: Callable, pos: torch.Tensor, n_head: int,
              dtype: torch.dtype) -> Optional[torch.Tensor]:
    """(H, T) the bias at lags 0..T-1, from the score_mod on one query row (the last, which sees
    them all), when every sequence has the same unit-step positions, so that lag = i - j; None
    otherwise (the caller then builds each block's mask from the score_mod)."""
    B, T = pos.shape
    row = pos[0]
    if not (B == 1 or pos.stride(0) == 0) or not torch.equal(row - row[0],
                                                            torch.arange(T, device=row.device)):
        return None
    device = pos.device
    index = torch.zeros((1, 1, 1, 1), dtype=torch.long, device=device)
    bias = score_mod(torch.zeros((), dtype=dtype, device=device), index,
                     torch.arange(n_head, device=device).view(1, n_head, 1, 1), index + T - 1,
                     torch.arange(T, device=device).view(1, 1, 1, T))  # lags T-1 .. 0
    return bias.to(dtype).expand(1, n_head, 1, T)[0, :, 0].flip(-1)


def lag_bias_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                       table: torch.Tensor) -> torch.Tensor:
    """softmax(q k^T / sqrt(d) + b_h(i - j), causal) v for q, k, v (B, H, T, d) and the bias of
    lags 0..T-1 as `table` (H, T)."""
    B, H, T, _ = q.shape
    rows = min(ROWS, T)
    padded = torch.cat((table.new_full((H, rows - 1), float("-inf")), table), dim=1)
    k, v = k.flip(2), v.flip(2)
    outputs = []
    for start in range(0, T, rows):
        end = min(T, start + rows)
        n = end - start
        mask = padded.as_strided((B, H, n, end), (0, padded.stride(0), 1, 1), rows - n)
        outputs.append(F.scaled_dot_product_attention(q[:, :, start:end], k[:, :, T - end:],
                                                      v[:, :, T - end:], attn_mask=mask))
    return outputs[0] if len(outputs) == 1 else torch.cat(outputs, dim=2)
