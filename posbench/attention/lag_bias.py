"""Causal attention under a bias laid out by lag, on CPU: fused SDPA per block of queries, its
mask a strided view of a table indexed by (query row, lag), so that no (query, key) mask is built.

With the keys in reverse order, row r of a block of n queries that ends at sequence index e
(query e - n + r) meets reversed key j' (key e - 1 - j') at lag r + j' - (n - 1). So a table
whose column m holds lag m - (n - 1) gives the block's mask as the view [r, r + j']: strides
(1, 1) when the bias depends on the lag alone (one table for every row: lag_bias_attention), or
(W + 1, 1) for a table of W lags per row (lag_rows_attention). Columns of negative lags, the
future keys, hold -inf. The cost over RoPE's causal kernel is the upper triangle of each diagonal
block, which a float mask makes SDPA compute, ROWS/T of the work.
"""
from __future__ import annotations

import math
from typing import Callable, Optional

import torch
import torch.nn.functional as F

# query rows per SDPA call: waste ROWS / T of the causal work on the diagonal blocks' upper
# triangles, against one Python call per block
ROWS = 256


def lag_is_index_difference(pos: torch.Tensor) -> bool:
    """Whether every sequence's positions step by one, so that pos_i - pos_j = i - j."""
    steps = pos[:, 1:] - pos[:, :-1]
    return bool((steps == 1).all())


def steps_by_one(pos: torch.Tensor, pos_is_index: bool) -> bool:
    """Whether pos_i - pos_j = i - j in every sequence: known where the positions are the
    sequence index (pos_is_index: the model's own 0..T-1), else read on the host, which a
    compiled graph cannot do without breaking (False there: the caller takes a general path)."""
    return pos_is_index or (not torch.compiler.is_compiling() and lag_is_index_difference(pos))


def lag_table(score_mod: Callable, pos: torch.Tensor, n_head: int, dtype: torch.dtype,
              pos_is_index: bool = False) -> Optional[torch.Tensor]:
    """(H, T) the bias at lags 0..T-1, from the score_mod on one query row (the last, which sees
    them all), when every sequence has the same unit-step positions (steps_by_one), so that
    lag = i - j; None otherwise (the caller then builds each block's mask from the score_mod)."""
    B, T = pos.shape
    if not (B == 1 or pos.stride(0) == 0) or not steps_by_one(pos[:1], pos_is_index):
        return None
    device = pos.device
    index = torch.zeros((1, 1, 1, 1), dtype=torch.long, device=device)
    bias = score_mod(torch.zeros((), dtype=dtype, device=device), index,
                     torch.arange(n_head, device=device).view(1, n_head, 1, 1), index + T - 1,
                     torch.arange(T, device=device).view(1, 1, 1, T))  # lags T-1 .. 0
    return bias.to(dtype).expand(1, n_head, 1, T)[0, :, 0].flip(-1)


def lag_masks(table: torch.Tensor, rows: int) -> Callable:
    """mask(n, end): the (1, H, n, end) causal mask of a block of n queries against keys
    end-1 .. 0, for a bias of lags 0..T-1 given as `table` (H, T), as a strided view of it
    padded with the future keys' -inf: no block's mask is ever built. SDPA broadcasts it over
    the batch; a batch dimension of stride 0 instead would be written out whole in a compiled
    graph (train.compile), per layer."""
    H = table.shape[0]
    padded = torch.cat((table.new_full((H, rows - 1), float("-inf")), table), dim=1)
    return lambda n, end: padded.as_strided((1, H, n, end), (0, padded.stride(0), 1, 1),
                                            rows - n)


def lag_bias_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                       table: torch.Tensor) -> torch.Tensor:
    """softmax(q k^T / sqrt(d) + b_h(i - j), causal) v for q, k, v (B, H, T, d) and the bias of
    lags 0..T-1 as `table` (H, T)."""
    rows = min(ROWS, q.shape[2])
    mask = lag_masks(table, rows)

    def block(q_rows, keys, values, start, n, end):
        return F.scaled_dot_product_attention(q_rows, keys, values, attn_mask=mask(n, end))

    return _by_blocks(q, k, v, block, rows)


def learned_lag_bias_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                               table: torch.Tensor) -> torch.Tensor:
    """lag_bias_attention for a `table` that needs a gradient, on CUDA: one fused SDPA call whose
    kernel returns the mask's gradient. The mask's rows are sliding windows over the table (row
    i holds lags i, i-1, ..., then the future's -inf), so autograd sums that gradient along each
    diagonal into the table: no atomic adds (FlexAttention's way: 48x NoPE's step for T5 on an
    H100), the same sums every run."""
    H, T = table.shape
    line = torch.cat((table.flip(-1), table.new_full((H, T - 1), float("-inf"))), dim=1)
    mask = line.unfold(-1, T, 1).flip(-2)  # window T-1-i: lags i, i-1, ..., i-T+1
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask.to(q.dtype).unsqueeze(0))


def lag_rows_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                       rows_at: Callable) -> torch.Tensor:
    """softmax(q k^T / sqrt(d) + b(i, i - j), causal) v for q, k, v (B, H, T, d), where
    rows_at(start, n, lags) is the bias of queries start..start+n-1 at each of `lags` (a long
    tensor, negative lags included: their values are replaced by -inf), (B or 1, H, n,
    len(lags))."""
    B, H, T, _ = q.shape

    def block(q_rows, keys, values, start, n, end):
        table = rows_at(start, n, torch.arange(1 - n, end, device=q.device)).contiguous()
        table[..., :n - 1] = float("-inf")  # the future keys
        table = table.expand(B, H, n, table.shape[-1])
        mask = table.as_strided((B, H, n, end), (table.stride(0), table.stride(1),
                                                 table.stride(2) + 1, 1))
        return F.scaled_dot_product_attention(q_rows, keys, values, attn_mask=mask)

    return _by_blocks(q, k, v, block, ROWS)


def decay_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                    rates: torch.Tensor) -> torch.Tensor:
    """softmax(causal((q k^T / sqrt(d)) e^{a_h (i - j)})) v for rates a (H,) <= 0. For a block of
    queries from s the decay factors as e^{a (i - s)} e^{a (s - j)}: the block's queries and keys
    are scaled by these, so SDPA forms the decayed scores itself, and the causal mask is the view
    of a table of zeros. Rows are capped so that the largest key factor, e^{-a (n - 1)} for the
    block's own keys, stays below e^60; key factors below e^-80 are set to 0, which changes a
    logit by under 1e-34 of its score."""
    H, T = q.shape[1:3]
    steepest = float(-rates.min())
    rows = min(ROWS, T, max(1, int(60 / steepest))) if steepest > 0 else min(ROWS, T)
    mask = lag_masks(q.new_zeros(H, T), rows)
    exponents = rates.to(q.dtype).view(H, 1) * torch.arange(T, device=q.device, dtype=q.dtype)
    # query row r of a block: e^{a r}; reversed key j' of a block of n rows (key s + n - 1 - j'):
    # e^{a (j' + 1 - n)}, entry rows - n + j' of this table
    query_factor = exponents.exp().unsqueeze(-1)  # (H, T, 1)
    key_exponents = torch.cat((-exponents[:, 1:rows].flip(-1), exponents), dim=1)
    key_factor = key_exponents.exp().masked_fill(key_exponents < -80, 0).unsqueeze(-1)

    def block(q_rows, keys, values, start, n, end):
        return F.scaled_dot_product_attention(
            q_rows * query_factor[:, :n], keys * key_factor[:, rows - n:rows - n + end], values,
            attn_mask=mask(n, end))

    return _by_blocks(q, k, v, block, rows)


def factored_bias_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                            factors: Callable) -> torch.Tensor:
    """softmax(q k^T / sqrt(d) + r_i + a_i . b_j, causal) v for a bias of low rank R beside a
    row term r that a softmax ignores: factors(o) -> (a, b), each (B or 1, H, T, R), measured
    from sequence index o. Each query carries a_i and each key b_j as R more coordinates (v
    padded to that width, the output cut back), so fused SDPA forms the biased scores with no
    mask of the tokens. Each block takes its factors from its own last key, so that the keys
    near its queries, those that weigh, hold coordinates near 0 and their bias exact."""
    B, H, T, d = q.shape
    dtype = q.dtype
    # in fp32 under autocast too: a coordinate of a key 256 tokens back is tens of logits,
    # which bf16 would round by a tenth of a logit
    work = torch.promote_types(dtype, torch.float32)
    q, k, v = q.to(work), k.to(work), v.to(work)
    scale = 1 / math.sqrt(d)
    rows = min(ROWS, T)
    mask = lag_masks(q.new_zeros(H, T), rows)
    # v is padded once, to the factors' rank, rather than block by block
    v = F.pad(v, (0, factors(T - 1)[0].shape[-1]))

    def block(q_rows, keys, values, start, n, end):
        a, b = (f.to(work).expand(B, H, T, f.shape[-1]) for f in factors(end - 1))
        q_rows = torch.cat((q_rows, a[:, :, start:end]), dim=-1)
        keys = torch.cat((keys, b[:, :, :end].flip(2) / scale), dim=-1)
        return F.scaled_dot_product_attention(q_rows, keys, values, attn_mask=mask(n, end),
                                              scale=scale)

    with torch.autocast(q.device.type, enabled=False):
        out = _by_blocks(q, k, v, block, rows)
    return out[..., :d].to(dtype)


def _by_blocks(q, k, v, block, rows):
    """Causal attention one block of `rows` queries at a time against their prefix of keys, in
    reverse order: block(q rows, keys, values, start, n, end) -> the rows' output, for the n
    queries from sequence index start and the keys end-1 down to 0."""
    T = q.shape[2]
    rows = min(rows, T)
    k, v = k.flip(2), v.flip(2)
    outputs = []
    for start in range(0, T, rows):
        end = min(T, start + rows)
        outputs.append(block(q[:, :, start:end], k[:, :, T - end:], v[:, :, T - end:], start,
                             end - start, end))
    return outputs[0] if len(outputs) == 1 else torch.cat(outputs, dim=2)
