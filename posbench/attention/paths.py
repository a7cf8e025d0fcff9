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
- a learned bias of the lag      -> one fused SDPA call, its mask laid out from the table of lags,
  alone, CUDA training             whose gradient the kernel returns (no atomics)
- encoding.lag_rows, CPU eval   -> the same, the mask a strided view of each block's table of
                                   (query row, lag) (FIRE, Transformer-XL)
- encoding.lag_decay, CPU eval  -> the same, each block's q and k scaled so that SDPA forms the
                                   decayed scores (the group family's decay)
- encoding.bias_factors, CPU eval -> the same, a low-rank bias as more coordinates of q and k
                                   (FoX)
- a remap (eval-time distance    -> blockwise, each block's logits picked per (query, key) from
  remaps of RoPE)                  two products, near and far (remapped_attention)
- encoding.mix_heads (DAPE)     -> blockwise on every device, dense fp32 scores rewritten across
                                   the heads before the mask; no fused kernel or FlexAttention's
                                   per-head score_mod can mix heads
Each layer's span (posbench/attention/span.py) masks the keys outside it with the causal mask:
FlexAttention's block mask on CUDA (also without a score_mod), and on CPU blocks that take only the
keys in reach, so memory is bounded by the span's width (a lambda span's sinks lie at the start:
its blocks take the keys from there, as a global span's do). A span cut into segments (training's
documents and windows) takes FlexAttention with a block mask per sequence on CUDA and the
blockwise path on CPU, with or without hooks.

Two options of every layer act on every path (model.attn_gate, model.attn_sinks):
- a learned sink logit s_h per head joins each row's softmax denominator and adds no value:
  p_ij = e^{l_ij} / (e^{s_h} + sum_j e^{l_ij}) (gpt-oss). FlexAttention returns each row's
  log-sum-exp, and its output is scaled by sigmoid(lse - s_h); the dense-score blocks append s_h
  as one more column of the row; the SDPA-mask blocks attend to one more key, of zeros, with s_h
  as its mask and a zero value. Fused causal SDPA and the evaluation fast paths of lag_bias.py
  return no log-sum-exp, so a layer with sinks takes the blockwise path on CPU in their place
  (FlexAttention on CUDA).
- a gate sigmoid(x W_g) multiplies each head's output before the output projection (Qiu et al.
  2025's G1), outside the paths: CausalSelfAttention.forward.
"""
from __future__ import annotations

import functools
import math
from dataclasses import dataclass
from typing import Optional, Tuple

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

from posbench.attention.lag_bias import (decay_attention, factored_bias_attention,
                                         lag_bias_attention, lag_rows_attention,
                                         lag_table, learned_lag_bias_attention,
                                         steps_by_one)
from posbench.attention.decoupled_rope import DecoupledRoPE
from posbench.attention.span import GLOBAL, Segmented, Span
from posbench.attention.temperature import Temperature

# score elements per block: bounds the memory of the blockwise path (64 MiB of fp32 per tensor)
BLOCK_ELEMENTS = 1 << 24
# query rows per step of biased_attention's backward (measured on CPU: 64 beats 32 and 128)
BACKWARD_ROWS = 64
# shapes FlexAttention is compiled for in one process: a study's training, validation, eval
# lengths, retrieval and extension, with room to spare
FLEX_SHAPES = 64
# model.qk_norm's epsilon: the rms_norm_eps of the models DroPE recalibrates (Llama, SmolLM)
QK_NORM_EPS = 1e-5
# model.attn_gate: no gate, one gate per head (broadcast over its channels), one per channel
ATTN_GATES = ("none", "headwise", "elementwise")


@dataclass(frozen=True)
class LayerAttention:
    """One layer's attention options (model.*, or per layer kind in a `layers` pattern)."""
    span: Span = GLOBAL  # which keys each query sees (posbench/attention/span.py)
    temperature: str = "none"  # posbench/attention/temperature.py
    qk_norm: bool = False  # RMSNorm of q and k over the model width (model.qk_norm)
    gate: str = "none"  # a sigmoid gate on each head's output from the layer's input (ATTN_GATES)
    sinks: bool = False  # a learned sink logit per head in the softmax denominator
    # MLA's decoupled rotary part per head, d^R (posbench/attention/decoupled_rope.py); 0: none
    rope_dim: int = 0


class CausalSelfAttention(nn.Module):
    def __init__(self, d_model: int, n_head: int, layer: int,
                 options: LayerAttention = LayerAttention()):
        super().__init__()
        self.n_head = n_head
        self.layer = layer
        self.span = self.trained_span = options.span
        self.temperature = Temperature(options.temperature, n_head, options.span)
        # DroPE's QK-norm: over all heads at once, before the head split and any encoding
        self.q_norm = nn.RMSNorm(d_model, eps=QK_NORM_EPS) if options.qk_norm else None
        self.k_norm = nn.RMSNorm(d_model, eps=QK_NORM_EPS) if options.qk_norm else None
        self.qkv = nn.Linear(d_model, 3 * d_model, bias=False)
        self.proj = nn.Linear(d_model, d_model, bias=False)
        # Gated attention's G1 gate: sigmoid(x W_g), no bias, one logit per head or per channel;
        # its weight is initialized with the model's other projections (GPT._init)
        if options.gate not in ATTN_GATES:
            raise ValueError(f"attention gate {options.gate!r}: expected one of {ATTN_GATES}")
        self.gate = (None if options.gate == "none" else
                     nn.Linear(d_model, n_head if options.gate == "headwise" else d_model,
                               bias=False))
        # gpt-oss's sinks: one logit per head, drawn from N(0, 0.02^2) by GPT._init
        self.sinks = nn.Parameter(torch.zeros(n_head)) if options.sinks else None
        self.decoupled = (DecoupledRoPE(d_model, n_head, options.rope_dim) if options.rope_dim
                          else None)

    def forward(self, x: torch.Tensor, pos: torch.Tensor, encoding,
                segments: Optional[torch.Tensor] = None,
                pos_is_index: bool = False) -> torch.Tensor:
        """`segments` (B, T): attention within each segment of the sequence as well (training's
        documents and windows, posbench/attention/span.py: Segmented), or None. `pos_is_index`:
        pos is the model's own 0..T-1 in every row (attend)."""
        B, T, C = x.shape
        q, k, v = self.heads(x, pos, encoding)
        span = self.span if segments is None else Segmented(self.span, segments)
        y = attend(q, k, v, pos, *encoding.at_layer(self.layer), x, span=span, sinks=self.sinks,
                   pos_is_index=pos_is_index)
        if self.gate is not None:  # (B, T, H or C) -> (B, H, T, 1 or d), each head's own
            y = y * torch.sigmoid(self.gate(x)).view(B, T, self.n_head, -1).transpose(1, 2)
        return self.proj(y.transpose(1, 2).reshape(B, T, C))

    def set_eval_span(self, span: Optional[Span]) -> None:
        """eval.attention's span (posbench/attention/span.py: lambda_span) in place of a global
        layer's causal one, also for the keys its temperature counts; None, or a local layer:
        the span it was trained with."""
        self.span = span if span is not None and self.trained_span.is_global else self.trained_span
        self.temperature.span = self.span

    def heads(self, x: torch.Tensor, pos: torch.Tensor, encoding):
        """q, k, v (B, H, T, d) as the attention sees them: rotated, and q scaled by the layer's
        temperature (eval.temperature, when set, in place of a fixed one). With MLA's decoupled
        RoPE, q and k are d + d^R wide and only their rotary parts are rotated."""
        B, T, C = x.shape
        qkv = self.qkv(x).view(B, T, 3, C)
        if self.q_norm is not None:
            qkv = torch.stack((self.q_norm(qkv[:, :, 0]), self.k_norm(qkv[:, :, 1]),
                               qkv[:, :, 2]), 2)
        q, k, v = qkv.view(B, T, 3, self.n_head, C // self.n_head).permute(2, 0, 3, 1, 4)
        encoding, layer = encoding.at_layer(self.layer)  # this layer's own, in a layer pattern
        if self.decoupled is not None:
            q, k = self.decoupled(x, q, k, pos, encoding, layer)
        elif encoding.rotate is not None:
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


def attend(q, k, v, pos, encoding, layer, x=None, span: Span = GLOBAL, sinks=None,
           pos_is_index: bool = False):
    """Causal attention of q, k, v (B, H, T, d) under the encoding's hooks, each query seeing the
    keys of its `span`; x (B, T, D), the attention's input, is needed by the encodings that read
    it (reads_input). `sinks` (H,): a sink logit per head in every row's softmax denominator, or
    None. `pos_is_index`: pos is 0..T-1 in every row, which lets the lag paths run without
    reading it (lag_bias.steps_by_one), also in a compiled graph."""
    if q.dtype != v.dtype:
        # rotate kept q and k wider than v (the group family's shear under autocast): their
        # logits need it, and autocast would round them back to bf16 in SDPA and FlexAttention
        with torch.autocast(q.device.type, enabled=False):
            return attend(q, k, v.to(q.dtype), pos, encoding, layer, x, span,
                          sinks, pos_is_index).to(v.dtype)
    if encoding.remap is not None:
        return remapped_attention(q, k, v, pos, encoding, layer, span, sinks)
    score_mod, row_mod, value_mod = bound_hooks(q, k, pos, encoding, layer, x)
    mix = encoding.mix_heads(q, k, pos, layer) if encoding.mix_heads is not None else None
    if row_mod is None and value_mod is None and mix is None:
        if score_mod is None and span.is_global and sinks is None:
            return causal_sdpa(q, k, v)
        if q.is_cuda and not _learns_through(score_mod, q):
            # its block mask skips hidden blocks; its log-sum-exp takes the sinks
            return flex_attention(q, k, v, score_mod, span, sinks)
        lags = span.is_global and sinks is None  # they return no log-sum-exp for a sink
        if score_mod is not None and encoding.lag_only_bias and lags:
            table = lag_table(score_mod, pos, q.shape[1], q.dtype, pos_is_index)
            if table is not None and not table.requires_grad:
                return lag_bias_attention(q, k, v, table)
            # learned, in training, eager; on CPU and in a compiled graph: below
            if table is not None and q.is_cuda and not torch.compiler.is_compiling():
                return learned_lag_bias_attention(q, k, v, table)
        # evaluation's paths: eager only (a compiled graph is training's, under train.compile)
        evaluating = lags and not torch.is_grad_enabled() and not torch.compiler.is_compiling()
        if (encoding.lag_rows is not None and evaluating
                and steps_by_one(pos, pos_is_index)):
            rows = encoding.lag_rows(q, k, pos, layer)
            if rows is not None:
                return lag_rows_attention(rows[0], k, v, rows[1])
        if (encoding.lag_decay is not None and evaluating
                and steps_by_one(pos, pos_is_index)):
            return decay_attention(q, k, v, encoding.lag_decay(layer))
        if encoding.bias_factors is not None and evaluating:
            return factored_bias_attention(q, k, v, encoding.bias_factors(
                q, k, pos, layer, **hook_inputs(encoding, x)))
    # no score hook is a zero bias: a local span's blocks run as fused SDPA with its mask
    additive = ((score_mod is None or encoding.additive_score_mod) and row_mod is None
                and value_mod is None and mix is None)
    return blockwise_attention(q, k, v, score_mod, row_mod, value_mod, additive=additive,
                               span=span, sinks=sinks, mix=mix)


def causal_sdpa(q, k, v):
    """Fused causal SDPA. A v narrower than q and k (PoPE's) is padded with zeros to their width
    and the output cut back: SDPA's fused kernels take one width, and its fallback forms the
    whole T x T scores (5x RoPE's time at 4096 on CPU)."""
    width = v.shape[-1]
    if width < q.shape[-1]:
        v = F.pad(v, (0, q.shape[-1] - width))
    return F.scaled_dot_product_attention(q, k, v, is_causal=True)[..., :width]


def blockwise_attention(q, k, v, score_mod=None, row_mod=None, value_mod=None, additive=False,
                        span: Span = GLOBAL, sinks=None, mix=None):
    """Exact causal attention, one block of queries at a time against the keys its span shows.
    `additive`: score_mod only adds a bias, so each block runs as SDPA with that bias as mask.
    `sinks` (H,): each head's sink logit in the softmax denominator, or None. `mix`: the
    encoding's mix_heads pair (fn, channels), or None."""
    mix_heads, channels = mix or (None, 0)
    block = (functools.partial(_bias_block, score_mod=score_mod, span=span, sinks=sinks)
             if additive else
             functools.partial(_attend_block, score_mod=score_mod, row_mod=row_mod,
                               value_mod=value_mod, span=span, sinks=sinks,
                               mix_heads=mix_heads))
    return by_row_blocks(q, k, v, block, span, channels)


def by_row_blocks(q, k, v, block, span: Span = GLOBAL, channels: int = 0):
    """Causal attention one block of query rows at a time: block(q rows, k prefix, v prefix,
    start, b, h) -> the rows' output, at most BLOCK_ELEMENTS scores per block, recomputed in
    the backward pass when a gradient is needed. Under a local span a block takes only the keys
    from the first one its first query sees (block(..., key_start=that index)), so memory is
    bounded by the span's width, not by T. `channels`: the values a block holds per (query, key)
    when more than its heads (mix_heads), so that it holds at most BLOCK_ELEMENTS of them."""
    B, H, T, _ = q.shape
    per_key = B * max(H, channels)
    if not span.bounded:  # global, or lambda: its sinks lie at the start
        rows = max(16, min(T, BLOCK_ELEMENTS // max(1, per_key * T)))
    else:  # a block of r rows sees at most r + w - 1 keys
        rows = max(16, min(T, span.width, BLOCK_ELEMENTS // max(1, 2 * per_key * span.width)))
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


def _bias_block(q, k, v, start, b, h, score_mod, key_start=0, span: Span = GLOBAL, sinks=None):
    """One block through fused SDPA, the additive score_mod evaluated on zero scores as its mask
    (none: zeros): (1, H, Tq, Tk) when the batch shares positions, expanded to 4-D B, H without
    copying (CPU's fused kernel needs that). Its keys start at sequence index key_start. With
    `sinks` (H,), one more key leads them: zeros, its value zeros and its mask the head's sink
    logit, so that e^{s_h} joins each row's denominator and nothing its output."""
    Tq, Tk = q.shape[2], k.shape[2]
    q_idx, kv_idx = block_indices(start, Tq, Tk, q.device, key_start)
    if score_mod is None:
        bias = torch.zeros(1, 1, Tq, Tk, dtype=q.dtype, device=q.device)
    else:
        bias = score_mod(torch.zeros((), dtype=q.dtype, device=q.device), b, h, q_idx, kv_idx)
    # one pass over the block where masked_fill would copy, then fill
    mask = torch.where(span.hidden(q_idx, kv_idx), float("-inf"), bias.to(q.dtype))
    offset = start - key_start  # the sequence index of the block's first query, among its keys
    if sinks is not None:
        H = q.shape[1]
        mask = torch.cat((sinks.to(q.dtype).view(1, H, 1, 1).expand(mask.shape[0], H, Tq, 1),
                          mask.expand(mask.shape[0], H, Tq, Tk)), dim=-1)
        k, v = F.pad(k, (0, 0, 1, 0)), F.pad(v, (0, 0, 1, 0))
        offset, Tk = offset + 1, Tk + 1
    if mask.requires_grad:
        return biased_attention(q, k, v, mask, offset)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask.expand(*q.shape[:2], Tq, Tk))


def block_indices(start: int, Tq: int, Tk: int, device, key_start: int = 0):
    """q_idx (1, 1, Tq, 1) of the block's queries, which start at sequence index `start`, and
    kv_idx (1, 1, 1, Tk) of its keys, which start at `key_start`: the index tensors a score_mod
    broadcasts over."""
    return (torch.arange(start, start + Tq, device=device).view(1, 1, Tq, 1),
            torch.arange(key_start, key_start + Tk, device=device).view(1, 1, 1, Tk))


def _attend_block(q, k, v, start, b, h, score_mod, row_mod, value_mod, key_start=0,
                  span: Span = GLOBAL, sinks=None, mix_heads=None):
    """One block from dense fp32 scores, for any combination of hooks."""
    probs, q_idx, kv_idx = _block_probs(q, k, start, b, h, score_mod, row_mod, key_start, span,
                                        sinks, mix_heads)
    out = probs @ v.to(probs.dtype)
    if value_mod is not None:
        out = out + value_mod(probs, q_idx=q_idx, kv_idx=kv_idx)
    return out.to(v.dtype)


def _block_probs(q, k, start, b, h, score_mod, row_mod, key_start=0, span: Span = GLOBAL,
                 sinks=None, mix_heads=None):
    """Causal attention probabilities (B, H, Tq, Tk) in fp32 at least of the query block that
    starts at sequence index `start` against keys from `key_start`, each query seeing its span,
    with the block's q_idx and kv_idx. With `sinks` (H,), each row's sum is e^{s_h} short of 1."""
    q_idx, kv_idx = block_indices(start, q.shape[2], k.shape[2], q.device, key_start)
    dtype = torch.promote_types(q.dtype, torch.float32)  # logits in fp32 at least, even under bf16
    # scaling q, not the scores, saves a pass over the block's scores; autocast off, or it
    # would round the fp32 operands back to bf16
    with torch.autocast(q.device.type, enabled=False):
        scores = (q.to(dtype) / math.sqrt(q.shape[-1])) @ k.to(dtype).transpose(-2, -1)
    if score_mod is not None:
        scores = score_mod(scores, b, h, q_idx, kv_idx)
    future = span.hidden(q_idx, kv_idx)  # and keys outside the span
    if mix_heads is not None:  # its weights act on fp32 logits, as the logits were formed
        with torch.autocast(q.device.type, enabled=False):
            scores = mix_heads(scores, b, h, q_idx, kv_idx, future)
    scores = scores.masked_fill(future, float("-inf"))
    if row_mod is not None:
        scores = row_mod(scores, q_idx=q_idx, kv_idx=kv_idx).masked_fill(future, float("-inf"))
    return softmax_with_sinks(scores, sinks), q_idx, kv_idx


def softmax_with_sinks(scores, sinks=None):
    """softmax over the last dim of scores (B, H, Tq, Tk); with sinks (H,), e^{s_h} joins each
    row's denominator: the softmax of the row with s_h appended, that column dropped (gpt-oss)."""
    if sinks is None:
        return torch.softmax(scores, dim=-1)
    sink = sinks.to(scores.dtype).view(1, -1, 1, 1).expand(*scores.shape[:3], 1)
    return torch.softmax(torch.cat((scores, sink), dim=-1), dim=-1)[..., :-1]


def attention_probs(q, k, pos, encoding, layer, start=0, end=None, x=None, span: Span = GLOBAL,
                    sinks=None):
    """Attention probabilities (B, H, end - start, end) of queries start..end-1 from q and k as
    CausalSelfAttention.heads returns them: the dense-score path every hook goes through, for
    inspecting what a trained model attends to (value_mod changes the output, not these); keys
    outside the layer's span get 0; with the layer's `sinks`, a row sums to 1 less the sink's
    share."""
    end = q.shape[2] if end is None else end
    if encoding.remap is not None:
        q, k, is_near = _remapped_heads(q, k, pos, encoding, layer, span)
        b = torch.arange(q.shape[0], device=q.device).view(-1, 1, 1, 1)
        return _remap_probs(q[:, :, start:end], k[:, :, :end], start, b, is_near, span=span,
                            sinks=sinks)
    score_mod, row_mod, _ = bound_hooks(q, k, pos, encoding, layer, x)
    mix = encoding.mix_heads(q, k, pos, layer)[0] if encoding.mix_heads is not None else None
    b = torch.arange(q.shape[0], device=q.device).view(-1, 1, 1, 1)
    h = torch.arange(q.shape[1], device=q.device).view(1, -1, 1, 1)
    return _block_probs(q[:, :, start:end], k[:, :, :end], start, b, h, score_mod, row_mod,
                        span=span, sinks=sinks, mix_heads=mix)[0]


def remapped_attention(q, k, v, pos, encoding, layer, span: Span = GLOBAL, sinks=None):
    """Causal attention under the encoding's `remap` hook (RoPE's eval-time distance remaps,
    posbench/encodings/rope.py): the logit of query i and key j is near_q_i . near_k_j / sqrt(d)
    where is_near, else far_q_i . far_k_j / sqrt(d), exactly, from dense fp32 scores a block of
    query rows at a time (the blockwise path's memory bound), each query seeing its span."""
    q2, k2, is_near = _remapped_heads(q, k, pos, encoding, layer, span)

    def block(q, k, v, start, b, h, key_start=0):
        probs = _remap_probs(q, k, start, b, is_near, key_start, span, sinks)
        return (probs @ v.to(probs.dtype)).to(v.dtype)

    return by_row_blocks(q2, k2, v, block, span)


def _remapped_heads(q, k, pos, encoding, layer, span: Span):
    """The hook's near and far q (and k) side by side in the last dim, (B, H, T, 2d), so that
    a block of rows slices both at once, and is_near. The hook reads the layer's span: a remap
    may place keys by the cache the span keeps (StreamingLLM's)."""
    near_q, near_k, far_q, far_k, is_near = encoding.remap(q, k, pos, layer, span)
    return torch.cat((near_q, far_q), -1), torch.cat((near_k, far_k), -1), is_near


def _remap_probs(q, k, start, b, is_near, key_start=0, span: Span = GLOBAL, sinks=None):
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
    return softmax_with_sinks(scores.masked_fill(span.hidden(q_idx, kv_idx), float("-inf")),
                              sinks)


# Causal softmax(q k^T / sqrt(d) + mask) v for a float mask that needs a gradient (learned
# biases); query i of the block sits at sequence index start + i and `mask`, (B or 1, H or 1,
# Tq, Tk), is -inf past it. SDPA would take its unfused math path for such a mask on CPU. Here
# the forward stays fused, and the backward recomputes the probabilities a chunk of query rows
# at a time against only the keys those rows can see, which skips the masked half and stays in
# cache. Custom ops, so that a compiled graph (train.compile) calls them as they are: traced
# into the graph, the chunks' slice updates cost T5 15% of its step on CPU.
def _biased_forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor,
                    start: int) -> torch.Tensor:
    # detached: SDPA picks its unfused path for any mask that requires grad, even here
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask.detach().expand(
        *q.shape[:2], *mask.shape[2:]))


biased_attention = torch.library.custom_op("posbench::biased_attention",
                                           mutates_args=())(_biased_forward)
# on fake tensors the same body gives SDPA's own output layout, which the fused kernel picks
biased_attention.register_fake(_biased_forward)


@torch.library.custom_op("posbench::biased_attention_backward", mutates_args=())
def biased_attention_backward(grad_out: torch.Tensor, q: torch.Tensor, k: torch.Tensor,
                              v: torch.Tensor, mask: torch.Tensor, out: torch.Tensor,
                              start: int) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor,
                                                   torch.Tensor]:
    # contiguous once: a strided operand makes CPU bmm copy it matrix by matrix
    q, k, v, grad_out = (t.contiguous() for t in (q, k, v, grad_out))
    scale = 1 / math.sqrt(q.shape[-1])
    row_dot = (grad_out * out).sum(-1, keepdim=True)  # rowsum(dO * O)
    grad_q, grad_k, grad_v = torch.empty_like(q), torch.zeros_like(k), torch.zeros_like(v)
    grad_mask = mask.new_zeros(mask.shape)
    # the batch and head dims the mask broadcasts over: its gradient sums over them
    broadcast = [i for i in (0, 1) if mask.shape[i] == 1 and q.shape[i] > 1]
    # the chunks keep a CPU's cache warm; a GPU takes the block at once, fewer launches
    step = BACKWARD_ROWS if q.device.type == "cpu" else q.shape[2]
    for i in range(0, q.shape[2], step):
        rows, keys = slice(i, i + step), slice(0, start + i + step)
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
    return grad_q, grad_k, grad_v, grad_mask


@biased_attention_backward.register_fake
def _(grad_out, q, k, v, mask, out, start):
    return (q.new_empty(q.shape), k.new_empty(k.shape), v.new_empty(v.shape),
            mask.new_empty(mask.shape))


def _save_biased(ctx, inputs, output):
    q, k, v, mask, start = inputs
    ctx.save_for_backward(q, k, v, mask, output)
    ctx.start = start


def _biased_backward(ctx, grad_out):
    return (*biased_attention_backward(grad_out, *ctx.saved_tensors, ctx.start), None)


biased_attention.register_autograd(_biased_backward, setup_context=_save_biased)


def _learns_through(score_mod, q) -> bool:
    """Whether a gradient flows into tensors the score_mod captures (a learned bias, or one made
    from the attention's input). FlexAttention's backward adds those gradients with one atomic
    per score onto a few addresses: 48x slower than NoPE for T5 on an H100 (2026-11-25), not
    reproducible run to run, and inductor refuses FIRE's and FoX's score_mods (a tensor that
    needs a gradient, indexed twice). Such a bias takes one masked SDPA call when it is a table
    of lags (learned_lag_bias_attention), the blockwise path otherwise: both exact, the same
    every run."""
    if score_mod is None or not torch.is_grad_enabled():
        return False
    # one score at the blockwise path's index shapes, (1, 1, 1, 1): 0-d indices, as FlexAttention
    # passes them, are read on the host by a table lookup (a graph break under train.compile)
    zero = torch.zeros(1, 1, 1, 1, dtype=torch.long, device=q.device)
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


def flex_attention(q, k, v, score_mod, span: Span = GLOBAL, sinks=None):
    """FlexAttention with the span's block mask (causal for a global span); score_mod may be
    None. With `sinks` (H,), the output of each row times sigmoid(lse - s_h), its log-sum-exp
    lse as FlexAttention returns it: Z / (Z + e^{s_h}), the sink's share of the denominator
    taken out (the gradient flows through lse too)."""
    from torch.nn.attention.flex_attention import create_block_mask
    from torch.nn.attention.flex_attention import flex_attention as flex

    T = q.shape[2]
    lse = {} if sinks is None else _lse_request()
    if torch.compiler.is_compiling():  # in train.compile's graph: traced into it, no caches
        mask = create_block_mask(span.mask_mod(), span.rows, None, T, T, device=q.device)
        out = flex(q, k, v, score_mod=score_mod, block_mask=mask, **lse)
    else:
        # a segmented span's mask is the batch's own: built for each call
        mask = (_block_mask(T, str(q.device), span) if span.rows is None else
                _compiled_block_mask()(span.mask_mod(), span.rows, None, T, T, device=q.device))
        # one compile per (batch, length, grad mode): a study has more shapes than dynamo's
        # default limit of 8, past which FlexAttention runs unfused and forms the whole scores
        with torch._dynamo.config.patch(recompile_limit=FLEX_SHAPES):
            out = _compiled_flex()(q, k, v, score_mod=score_mod, block_mask=mask, **lse)
    if sinks is None:
        return out
    out, aux = out
    lse = aux if isinstance(aux, torch.Tensor) else aux.lse
    work = torch.promote_types(out.dtype, torch.float32)
    share = torch.sigmoid(lse.to(work) - sinks.to(work).view(1, -1, 1))
    return out * share.unsqueeze(-1).to(out.dtype)


def _lse_request() -> dict:
    """FlexAttention's keyword for its log-sum-exp (natural log, per query row): return_aux
    from torch 2.9, return_lse before."""
    try:
        from torch.nn.attention.flex_attention import AuxRequest
    except ImportError:
        return {"return_lse": True}
    return {"return_aux": AuxRequest(lse=True)}
