"""One causal self-attention that asks the encoding for its hooks and picks the fastest exact path.

- no score hook                 -> scaled_dot_product_attention(is_causal=True) (flash on GPU)
- score_mod only, on CUDA       -> FlexAttention with a causal block mask (compiled), unless a
                                   gradient flows into the score_mod's tensors: blockwise
- otherwise (CPU, row/value)    -> blockwise: query blocks against their causal key prefix, so
                                   memory grows with T x block, never T x T; in training each
                                   block is recomputed in backward (checkpoint) for the same bound.
                                   An additive score_mod (encoding.additive_score_mod) becomes a
                                   float mask for fused SDPA in each block instead of dense
                                   scores.
- a bias of the lag alone, CPU  -> fused SDPA per block of queries, the mask a strided view of
  (encoding.lag_only_bias)         one table of lags (posbench/attention/lag_bias.py), unless the
                                   bias is learned and in training
- encoding.lag_rows, CPU eval   -> the same, the mask a strided view of each block's table of
                                   (query row, lag) (FIRE, Transformer-XL)
- encoding.lag_decay, CPU eval  -> the same, each block's q and k scaled so that SDPA forms the
                                   decayed scores (the group family's decay)
- encoding.bias_factors, CPU eval -> the same, a low-rank bias as more coordinates of q and k
                                   (FoX)
- a remap (eval-time distance    -> blockwise, each block's logits picked per (query, key) from
  remaps of RoPE)                  two products, near and far (remapped_attention)
Each layer's span (posbench/attention/span.py) masks the keys outside it with the causal mask:
FlexAttention's block mask on CUDA (also without a score_mod), and on CPU blocks that take only the
keys in reach, so memory is bounded by the span's width.
"""
from __future__ import annotations

import functools
import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

from posbench.attention.lag_bias import (decay_attention, factored_bias_attention,
                                         lag_bias_attention, lag_is_index_difference,
                                         lag_rows_attention, lag_table)
from posbench.attention.span import GLOBAL, Span
from posbench.attention.temperature import Temperature

# score elements per block: bounds the memory of the blockwise path (64 MiB of fp32 per tensor)
BLOCK_ELEMENTS = 1 << 24
# query rows per step of BiasedAttention's backward (measured on CPU: 64 beats 32 and 128)
BACKWARD_ROWS = 64
# shapes FlexAttention is compiled for in one process: a study's training, validation, eval
# lengths, retrieval and extension, with room to spare
FLEX_SHAPES = 64
# model.qk_norm's epsilon: the rms_norm_eps of the models DroPE recalibrates (Llama, SmolLM)
QK_NORM_EPS = 1e-5


@dataclass(frozen=True)
class LayerAttention:
    """One layer's attention options (model.*, or per layer kind in a `layers` pattern)."""
    span: Span = GLOBAL  # which keys each query sees (posbench/attention/span.py)
    temperature: str = "none"  # posbench/attention/temperature.py
    qk_norm: bool = False  # RMSNorm of q and k over the model width (model.qk_norm)


class CausalSelfAttention(nn.Module):
    def __init__(self, d_model: int, n_head: int, layer: int,
                 options: LayerAttention = LayerAttention()):
        super().__init__()
        self.n_head = n_head
        self.layer = layer
        self.span = options.span
        self.temperature = Temperature(options.temperature, n_head, options.span)
        # DroPE's QK-norm: over all heads at once, before the head split and any encoding
        self.q_norm = nn.RMSNorm(d_model, eps=QK_NORM_EPS) if options.qk_norm else None
        self.k_norm = nn.RMSNorm(d_model, eps=QK_NORM_EPS) if options.qk_norm else None
        self.qkv = nn.Linear(d_model, 3 * d_model, bias=False)
        self.proj = nn.Linear(d_model, d_model, bias=False)

    def forward(self, x: torch.Tensor, pos: torch.Tensor, encoding) -> torch.Tensor:
        B, T, C = x.shape
        q, k, v = self.heads(x, pos, encoding)
        y = attend(q, k, v, pos, *encoding.at_layer(self.layer), x, span=self.span)
        return self.proj(y.transpose(1, 2).reshape(B, T, C))

    def heads(self, x: torch.Tensor, pos: torch.Tensor, encoding):
        """q, k, v (B, H, T, d) as the attention sees them: rotated, and q scaled by the layer's
        temperature (eval.temperature, when set, in place of a fixed one)."""
        B, T, C = x.shape
        qkv = self.qkv(x).view(B, T, 3, C)
        if self.q_norm is not None:
            qkv = torch.stack((self.q_norm(qkv[:, :, 0]), self.k_norm(qkv[:, :, 1]),
                               qkv[:, :, 2]), 2)
        q, k, v = qkv.view(B, T, 3, self.n_head, C // self.n_head).permute(2, 0, 3, 1, 4)
        encoding, layer = encoding.at_layer(self.layer)  # this layer's own, in a layer pattern
        if encoding.rotate is not None:
            q, k = encoding.rotate(q, k, pos, layer)
        q = self.temperature(q, encoding.dims.train_len, encoding.temperature)
        return q, k, v


def hook_inputs(encoding, x) -> dict:
    """The keyword arguments beyond q, k, pos and layer that the encoding's hooks take: the
    attention's input x where it reads it (reads_input), else none."""
    if not encoding.reads_input:
        return {}
    if x is None:
        hook = "score_mod" if encoding.score_mod is not None else "row_mod"
        raise ValueError(f"{type(encoding).__name__}'s {hook} reads the attention's input: "
                         "pass x")
    return {"x": x}


def bound_hooks(q, k, pos, encoding, layer, x=None):
    """The encoding's score_mod, row_mod and value_mod bound to these q, k and positions (and to
    the attention's input x where the encoding reads it), each None where the encoding has no
    such hook."""
    inputs = hook_inputs(encoding, x)
    score_mod = (encoding.score_mod(q, k, pos, layer, **inputs)
                 if encoding.score_mod is not None else None)
    row_mod = (functools.partial(encoding.row_mod, q=q, k=k, pos=pos, layer=layer, **inputs)
               if encoding.row_mod is not None else None)
    value_mod = (functools.partial(encoding.value_mod, pos=pos, layer=layer)
                 if encoding.value_mod is not None else None)
    return score_mod, row_mod, value_mod


def attend(q, k, v, pos, encoding, layer, x=None, span: Span = GLOBAL):
    """Causal attention of q, k, v (B, H, T, d) under the encoding's hooks, each query seeing the
    keys of its `span`; x (B, T, D), the attention's input, is needed by the encodings that read
    it (reads_input)."""
    if q.dtype != v.dtype:
        # rotate kept q and k wider than v (the group family's shear under autocast): their
        # logits need it, and autocast would round them back to bf16 in SDPA and FlexAttention
        with torch.autocast(q.device.type, enabled=False):
            return attend(q, k, v.to(q.dtype), pos, encoding, layer, x, span).to(v.dtype)
    if encoding.remap is not None:
        return remapped_attention(q, k, v, pos, encoding, layer, span)
    score_mod, row_mod, value_mod = bound_hooks(q, k, pos, encoding, layer, x)
    if row_mod is None and value_mod is None:
        if score_mod is None and span.is_global:
            return causal_sdpa(q, k, v)
        if q.is_cuda and not _learns_through(score_mod, q):
            return flex_attention(q, k, v, score_mod, span)  # its block mask skips hidden blocks
        # the lag tables' strided views are eager-only: a compiled graph (train.compile) fuses
        # the blockwise mask instead
        lags = span.is_global and not torch.compiler.is_compiling()
        if score_mod is not None and encoding.lag_only_bias and lags:
            table = lag_table(score_mod, pos, q.shape[1], q.dtype)
            if table is not None and not table.requires_grad:  # learned, in training: below
                return lag_bias_attention(q, k, v, table)
        if (encoding.lag_rows is not None and lags and not torch.is_grad_enabled()
                and lag_is_index_difference(pos)):
            rows = encoding.lag_rows(q, k, pos, layer)
            if rows is not None:
                return lag_rows_attention(rows[0], k, v, rows[1])
        if (encoding.lag_decay is not None and lags and not torch.is_grad_enabled()
                and lag_is_index_difference(pos)):
            return decay_attention(q, k, v, encoding.lag_decay(layer))
        if encoding.bias_factors is not None and lags and not torch.is_grad_enabled():
            return factored_bias_attention(q, k, v, encoding.bias_factors(
                q, k, pos, layer, **hook_inputs(encoding, x)))
    # no score hook is a zero bias: a local span's blocks run as fused SDPA with its mask
    additive = ((score_mod is None or encoding.additive_score_mod) and row_mod is None
                and value_mod is None)
    return blockwise_attention(q, k, v, score_mod, row_mod, value_mod, additive=additive,
                               span=span)


def causal_sdpa(q, k, v):
    """Fused causal SDPA. A v narrower than q and k (PoPE's) is padded with zeros to their width
    and the output cut back: SDPA's fused kernels take one width, and its fallback forms the
    whole T x T scores (5x RoPE's time at 4096 on CPU)."""
    width = v.shape[-1]
    if width < q.shape[-1]:
        v = F.pad(v, (0, q.shape[-1] - width))
    return F.scaled_dot_product_attention(q, k, v, is_causal=True)[..., :width]


def blockwise_attention(q, k, v, score_mod=None, row_mod=None, value_mod=None, additive=False,
                        span: Span = GLOBAL):
    """Exact causal attention, one block of queries at a time against the keys its span shows.
    `additive`: score_mod only adds a bias, so each block runs as SDPA with that bias as mask."""
    block = (functools.partial(_bias_block, score_mod=score_mod, span=span) if additive else
             functools.partial(_attend_block, score_mod=score_mod, row_mod=row_mod,
                               value_mod=value_mod, span=span))
    return by_row_blocks(q, k, v, block, span)


def by_row_blocks(q, k, v, block, span: Span = GLOBAL):
    """Causal attention one block of query rows at a time: block(q rows, k prefix, v prefix,
    start, b, h) -> the rows' output, at most BLOCK_ELEMENTS scores per block, recomputed in
    the backward pass when a gradient is needed. Under a local span a block takes only the keys
    from the first one its first query sees (block(..., key_start=that index)), so memory is
    bounded by the span's width, not by T."""
    B, H, T, _ = q.shape
    if span.is_global:
        rows = max(16, min(T, BLOCK_ELEMENTS // max(1, B * H * T)))
    else:  # a block of r rows sees at most r + w - 1 keys
        rows = max(16, min(T, span.width, BLOCK_ELEMENTS // max(1, 2 * B * H * span.width)))
    b = torch.arange(B, device=q.device).view(B, 1, 1, 1)
    h = torch.arange(H, device=q.device).view(1, H, 1, 1)
    outputs = []
    for start in range(0, T, rows):
        end = min(T, start + rows)
        first = span.first_key(start)
        args = (q[:, :, start:end], k[:, :, first:end], v[:, :, first:end], start, b, h)
        fn = functools.partial(block, key_start=first) if first else block
        if torch.is_grad_enabled() and rows < T:
            outputs.append(checkpoint(fn, *args, use_reentrant=False))
        else:
            outputs.append(fn(*args))
    return outputs[0] if len(outputs) == 1 else torch.cat(outputs, dim=2)


def _bias_block(q, k, v, start, b, h, score_mod, key_start=0, span: Span = GLOBAL):
    """One block through fused SDPA, the additive score_mod evaluated on zero scores as its mask
    (none: zeros): (1, H, Tq, Tk) when the batch shares positions, expanded to 4-D B, H without
    copying (CPU's fused kernel needs that). Its keys start at sequence index key_start."""
    Tq, Tk = q.shape[2], k.shape[2]
    q_idx, kv_idx = block_indices(start, Tq, Tk, q.device, key_start)
    if score_mod is None:
        bias = torch.zeros(1, 1, Tq, Tk, dtype=q.dtype, device=q.device)
    else:
        bias = score_mod(torch.zeros((), dtype=q.dtype, device=q.device), b, h, q_idx, kv_idx)
    # one pass over the block where masked_fill would copy, then fill
    mask = torch.where(span.hidden(q_idx, kv_idx), float("-inf"), bias.to(q.dtype))
    if mask.requires_grad:
        return BiasedAttention.apply(q, k, v, mask, start - key_start)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask.expand(*q.shape[:2], Tq, Tk))


def block_indices(start: int, Tq: int, Tk: int, device, key_start: int = 0):
    """q_idx (1, 1, Tq, 1) of the block's queries, which start at sequence index `start`, and
    kv_idx (1, 1, 1, Tk) of its keys, which start at `key_start`: the index tensors a score_mod
    broadcasts over."""
    return (torch.arange(start, start + Tq, device=device).view(1, 1, Tq, 1),
            torch.arange(key_start, key_start + Tk, device=device).view(1, 1, 1, Tk))


def _attend_block(q, k, v, start, b, h, score_mod, row_mod, value_mod, key_start=0,
                  span: Span = GLOBAL):
    """One block from dense fp32 scores, for any combination of hooks."""
    probs, q_idx, kv_idx = _block_probs(q, k, start, b, h, score_mod, row_mod, key_start, span)
    out = probs @ v.to(probs.dtype)
    if value_mod is not None:
        out = out + value_mod(probs, q_idx=q_idx, kv_idx=kv_idx)
    return out.to(v.dtype)


def _block_probs(q, k, start, b, h, score_mod, row_mod, key_start=0, span: Span = GLOBAL):
    """Causal attention probabilities (B, H, Tq, Tk) in fp32 at least of the query block that
    starts at sequence index `start` against keys from `key_start`, each query seeing its span,
    with the block's q_idx and kv_idx."""
    q_idx, kv_idx = block_indices(start, q.shape[2], k.shape[2], q.device, key_start)
    dtype = torch.promote_types(q.dtype, torch.float32)  # logits in fp32 at least, even under bf16
    # scaling q, not the scores, saves a pass over the block's scores; autocast off, or it
    # would round the fp32 operands back to bf16
    with torch.autocast(q.device.type, enabled=False):
        scores = (q.to(dtype) / math.sqrt(q.shape[-1])) @ k.to(dtype).transpose(-2, -1)
    if score_mod is not None:
        scores = score_mod(scores, b, h, q_idx, kv_idx)
    future = span.hidden(q_idx, kv_idx)  # and keys outside the span
    scores = scores.masked_fill(future, float("-inf"))
    if row_mod is not None:
        scores = row_mod(scores, q_idx=q_idx, kv_idx=kv_idx).masked_fill(future, float("-inf"))
    return torch.softmax(scores, dim=-1), q_idx, kv_idx


def attention_probs(q, k, pos, encoding, layer, start=0, end=None, x=None, span: Span = GLOBAL):
    """Attention probabilities (B, H, end - start, end) of queries start..end-1 from q and k as
    CausalSelfAttention.heads returns them: the dense-score path every hook goes through, for
    inspecting what a trained model attends to (value_mod changes the output, not these); keys
    outside the layer's span get 0."""
    end = q.shape[2] if end is None else end
    if encoding.remap is not None:
        q, k, is_near = _remapped_heads(q, k, pos, encoding, layer)
        b = torch.arange(q.shape[0], device=q.device).view(-1, 1, 1, 1)
        return _remap_probs(q[:, :, start:end], k[:, :, :end], start, b, is_near, span=span)
    score_mod, row_mod, _ = bound_hooks(q, k, pos, encoding, layer, x)
    b = torch.arange(q.shape[0], device=q.device).view(-1, 1, 1, 1)
    h = torch.arange(q.shape[1], device=q.device).view(1, -1, 1, 1)
    return _block_probs(q[:, :, start:end], k[:, :, :end], start, b, h, score_mod, row_mod,
                        span=span)[0]


def remapped_attention(q, k, v, pos, encoding, layer, span: Span = GLOBAL):
    """Causal attention under the encoding's `remap` hook (RoPE's eval-time distance remaps,
    posbench/encodings/rope.py): the logit of query i and key j is near_q_i . near_k_j / sqrt(d)
    where is_near, else far_q_i . far_k_j / sqrt(d), exactly, from dense fp32 scores a block of
    query rows at a time (the blockwise path's memory bound), each query seeing its span."""
    q2, k2, is_near = _remapped_heads(q, k, pos, encoding, layer)

    def block(q, k, v, start, b, h, key_start=0):
        probs = _remap_probs(q, k, start, b, is_near, key_start, span)
        return (probs @ v.to(probs.dtype)).to(v.dtype)

    return by_row_blocks(q2, k2, v, block, span)


def _remapped_heads(q, k, pos, encoding, layer):
    """The hook's near and far q (and k) side by side in the last dim, (B, H, T, 2d), so that
    a block of rows slices both at once, and is_near."""
    near_q, near_k, far_q, far_k, is_near = encoding.remap(q, k, pos, layer)
    return torch.cat((near_q, far_q), -1), torch.cat((near_k, far_k), -1), is_near


def _remap_probs(q, k, start, b, is_near, key_start=0, span: Span = GLOBAL):
    """Probabilities (B, H, Tq, Tk) of the block of queries at sequence index start.. against
    the keys from key_start, from _remapped_heads' q and k; b (B, 1, 1, 1) indexes the batch for
    is_near."""
    d = q.shape[-1] // 2
    q_idx, kv_idx = block_indices(start, q.shape[2], k.shape[2], q.device, key_start)
    dtype = torch.promote_types(q.dtype, torch.float32)
    with torch.autocast(q.device.type, enabled=False):
        near_q, far_q = (q.to(dtype) / math.sqrt(d)).split(d, -1)
        near_k, far_k = k.to(dtype).split(d, -1)
        scores = torch.where(is_near(b, q_idx, kv_idx), near_q @ near_k.transpose(-2, -1),
                             far_q @ far_k.transpose(-2, -1))
    return torch.softmax(scores.masked_fill(span.hidden(q_idx, kv_idx), float("-inf")), dim=-1)


class BiasedAttention(torch.autograd.Function):
    """Causal softmax(q k^T / sqrt(d) + mask) v for a float mask that needs a gradient (learned
    biases); query i of the block sits at sequence index start + i and `mask`, (B or 1, H or 1,
    Tq, Tk), is -inf past it.
    SDPA would take its unfused math path for such a mask on CPU. Here the forward stays fused,
    and the backward recomputes the probabilities a chunk of query rows at a time against only
    the keys those rows can see, which skips the masked half and stays in cache."""

    @staticmethod
    def forward(ctx, q, k, v, mask, start):
        # detached: SDPA picks its unfused path for any mask that requires grad, even here
        full = mask.detach().expand(*q.shape[:2], *mask.shape[2:])
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=full)
        ctx.save_for_backward(q, k, v, mask, out)
        ctx.start = start
        return out

    @staticmethod
    def backward(ctx, grad_out):
        q, k, v, mask, out = ctx.saved_tensors
        # contiguous once: a strided operand makes CPU bmm copy it matrix by matrix
        q, k, v, grad_out = (t.contiguous() for t in (q, k, v, grad_out))
        scale = 1 / math.sqrt(q.shape[-1])
        row_dot = (grad_out * out).sum(-1, keepdim=True)  # rowsum(dO * O)
        grad_q, grad_k, grad_v = torch.empty_like(q), torch.zeros_like(k), torch.zeros_like(v)
        grad_mask = torch.zeros_like(mask)
        # the batch and head dims the mask broadcasts over: its gradient sums over them
        broadcast = [i for i in (0, 1) if mask.shape[i] == 1 and q.shape[i] > 1]
        # the chunks keep a CPU's cache warm; a GPU takes the block at once, fewer launches
        step = BACKWARD_ROWS if q.device.type == "cpu" else q.shape[2]
        for i in range(0, q.shape[2], step):
            rows, keys = slice(i, i + step), slice(0, ctx.start + i + step)
            qc, dout = q[:, :, rows].contiguous(), grad_out[:, :, rows].contiguous()
            kc, vc = k[:, :, keys], v[:, :, keys]  # prefixes: contiguous batch by batch
            probs = (qc @ kc.transpose(-2, -1)).mul_(scale).add_(mask[:, :, rows, keys]).softmax(-1)
            # dS = P * (dP - rowsum(dO * O)) with dP = dO v^T; it is also the mask's gradient
            grad_scores = (dout @ vc.transpose(-2, -1)).sub_(row_dot[:, :, rows]).mul_(probs)
            grad_q[:, :, rows] = (grad_scores @ kc).mul_(scale)
            grad_k[:, :, keys] += (grad_scores.transpose(-2, -1) @ qc).mul_(scale)
            grad_v[:, :, keys] += probs.transpose(-2, -1) @ dout
            grad_mask[:, :, rows, keys] = (grad_scores.sum(broadcast, keepdim=True) if broadcast
                                           else grad_scores)
        return grad_q, grad_k, grad_v, grad_mask, None


def _learns_through(score_mod, q) -> bool:
    """Whether a gradient flows into tensors the score_mod captures (a learned bias, or one made
    from the attention's input). FlexAttention's backward adds those gradients with one atomic
    per score onto a few addresses: 48x slower than NoPE for T5 on an H100 (2026-11-25), not
    reproducible run to run, and inductor refuses FIRE's and FoX's score_mods (a tensor that
    needs a gradient, indexed twice). The blockwise path's backward is exact and deterministic."""
    if score_mod is None or not torch.is_grad_enabled():
        return False
    zero = torch.zeros((), dtype=torch.long, device=q.device)
    return score_mod(torch.zeros((), dtype=q.dtype, device=q.device), zero, zero, zero,
                     zero).requires_grad


@functools.lru_cache(maxsize=8)
def _block_mask(T: int, device: str, span: Span):
    return _compiled_block_mask()(span.mask_mod(), None, None, T, T, device=device)


@functools.lru_cache(maxsize=1)
def _compiled_block_mask():
    from torch.nn.attention.flex_attention import create_block_mask

    # uncompiled, it forms the whole T x T mask first (11 bytes a pair: 40 GiB at 65536 on an
    # H100, 2026-11-25)
    return torch.compile(create_block_mask, dynamic=True)


@functools.lru_cache(maxsize=1)
def _compiled_flex():
    from torch.nn.attention.flex_attention import flex_attention as flex

    # static shapes: under dynamic ones the score_mods' captured tables take symbolic sizes,
    # which half of them do not trace with (torch 2.13)
    return torch.compile(flex, dynamic=False)


def flex_attention(q, k, v, score_mod, span: Span = GLOBAL):
    """FlexAttention with the span's block mask (causal for a global span); score_mod may be
    None."""
    from torch.nn.attention.flex_attention import create_block_mask
    from torch.nn.attention.flex_attention import flex_attention as flex

    T = q.shape[2]
    if torch.compiler.is_compiling():  # in train.compile's graph: traced into it, no caches
        mask = create_block_mask(span.mask_mod(), None, None, T, T, device=q.device)
        return flex(q, k, v, score_mod=score_mod, block_mask=mask)
    mask = _block_mask(T, str(q.device), span)
    # one compile per (batch, length, grad mode): a study has more shapes than dynamo's default
    # limit of 8, past which FlexAttention runs unfused and forms the whole scores
    with torch._dynamo.config.patch(recompile_limit=FLEX_SHAPES):
        return _compiled_flex()(q, k, v, score_mod=score_mod, block_mask=mask)
