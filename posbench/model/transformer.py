"""A small GPT: pre-LayerNorm causal decoder with tied input and output embeddings.

The positional encoding is a module passed in; the model only calls its hooks (see
posbench/encodings/base.py), so there is no encoding-specific branch here.
"""
from __future__ import annotations

import math
from typing import List, Optional

import torch
import torch.nn.functional as F
from omegaconf import DictConfig
from torch import nn

from posbench.attention.decoupled_rope import rotary_width
from posbench.attention.paths import CausalSelfAttention, LayerAttention
from posbench.encodings import Dims, PositionalEncoding, build_encoding, positions_for
from posbench.model.schedule import switched_encoding
from posbench.attention.span import GLOBAL, Span, default_width


class MLP(nn.Module):
    def __init__(self, d_model: int, ratio: int):
        super().__init__()
        self.up = nn.Linear(d_model, ratio * d_model, bias=False)
        self.down = nn.Linear(ratio * d_model, d_model, bias=False)

    def forward(self, x):
        return self.down(F.gelu(self.up(x)))


class Block(nn.Module):
    def __init__(self, d_model: int, n_head: int, mlp_ratio: int, layer: int,
                 options: LayerAttention = LayerAttention()):
        super().__init__()
        self.ln_1 = nn.LayerNorm(d_model)
        self.attn = CausalSelfAttention(d_model, n_head, layer, options)
        self.ln_2 = nn.LayerNorm(d_model)
        self.mlp = MLP(d_model, mlp_ratio)

    def forward(self, x, pos, encoding, segments=None, pos_is_index=False):
        x = x + self.attn(self.ln_1(x), pos, encoding, segments, pos_is_index)
        return x + self.mlp(self.ln_2(x))


class GPT(nn.Module):
    def __init__(self, vocab_size: int, n_layer: int, n_head: int, d_model: int, mlp_ratio: int,
                 encoding: PositionalEncoding, layers: Optional[List[LayerAttention]] = None):
        super().__init__()
        layers = layers or [LayerAttention()] * n_layer  # each layer's span and temperature
        self.tok_emb = nn.Embedding(vocab_size, d_model)
        self.blocks = nn.ModuleList(Block(d_model, n_head, mlp_ratio, i, layers[i])
                                    for i in range(n_layer))
        self.ln_f = nn.LayerNorm(d_model)
        self.head = nn.Linear(d_model, vocab_size, bias=False)
        self.head.weight = self.tok_emb.weight  # weight tying
        self.apply(self._init)
        self.encoding = encoding  # after the GPT's init: an encoding initializes its own modules
        for name, p in self.named_parameters():  # GPT-2: scale residual projections by depth
            if name.endswith(("attn.proj.weight", "mlp.down.weight")):
                nn.init.normal_(p, 0.0, 0.02 / math.sqrt(2 * n_layer))

    @staticmethod
    def _init(module):
        if isinstance(module, (nn.Linear, nn.Embedding)):
            nn.init.normal_(module.weight, 0.0, 0.02)
        elif isinstance(module, CausalSelfAttention) and module.sinks is not None:
            # gpt-oss's sinks as Hugging Face initializes them: N(0, initializer_range^2)
            nn.init.normal_(module.sinks, 0.0, 0.02)

    def hidden(self, idx: torch.Tensor, pos: Optional[torch.Tensor] = None,
               segments: Optional[torch.Tensor] = None) -> torch.Tensor:
        """Final hidden states (B, T, D), before the output head; `segments` (B, T): attention
        within each segment too (posbench/attention/span.py: Segmented)."""
        enc = self.encoding
        # known here, so that attention need not read pos (a host sync, or a compiled graph's break)
        pos_is_index = pos is None and enc.positions is None
        pos = positions_for(idx, pos)
        if enc.positions is not None:
            pos = enc.positions(pos)
        x = self.tok_emb(idx)
        for i, block in enumerate(self.blocks):
            layer_enc, layer = enc.at_layer(i)
            if layer_enc.embed is not None:
                x = layer_enc.embed(x, pos, layer)
            x = block(x, pos, enc, segments, pos_is_index)
        return self.ln_f(x)

    def forward(self, idx: torch.Tensor, pos: Optional[torch.Tensor] = None,
                targets: Optional[torch.Tensor] = None,
                segments: Optional[torch.Tensor] = None) -> torch.Tensor:
        """Logits (B, T, V). `pos`: optional (T,) or (B, T) position ids, default 0..T-1. With
        `targets` (B, T), the per-token losses instead (what training and DDP call).
        `segments` (B, T): training's documents or windows, attended within (None: none)."""
        if targets is not None:
            return self.token_losses(idx, targets, pos, segments)
        return self.head(self.hidden(idx, pos, segments))

    def token_losses(self, idx, targets, pos=None, segments=None,
                     chunk: int = 4096) -> torch.Tensor:
        """Per-token cross-entropy in nats (B, T), computed in chunks of the sequence so that
        the (B, T, V) logits never exist at once at long lengths."""
        h = self.hidden(idx, pos, segments)
        # (tokens, V) rows: cross_entropy's fast path, where (B, V, T) takes the 2-d one, 4x slower
        losses = [F.cross_entropy(self.head(h[:, s:s + chunk]).float().flatten(0, 1),
                                  targets[:, s:s + chunk].flatten(), reduction="none")
                  .view(idx.shape[0], -1) for s in range(0, idx.shape[1], chunk)]
        return torch.cat(losses, dim=1)

    def num_params(self) -> int:
        return sum(p.numel() for p in self.parameters())


def build_model(cfg: DictConfig, vocab_size: Optional[int] = None):
    """The GPT with the config's encoding. vocab_size defaults to the dataset tokenizer's."""
    from posbench.data import vocab_size as dataset_vocab

    m = cfg.model
    t = cfg.train
    dims = Dims(n_layer=m.n_layer, n_head=m.n_head, d_model=m.d_model, train_len=t.seq_len,
                max_len=max([t.seq_len, t.get("pose_span") or 0, *cfg.eval.lengths]),
                original_len=t.get("original_len"), train_span=t.get("pose_span"),
                train_scaling=t.get("rope_scaling", "none"), rotary_dim=rotary_width(m))
    encoding = switched_encoding(build_encoding(cfg, dims), cfg.train, dims)
    return GPT(vocab_size or dataset_vocab(cfg.dataset), m.n_layer, m.n_head, m.d_model,
               m.mlp_ratio, encoding, layer_attention(cfg, encoding))


def layer_attention(cfg: DictConfig, encoding: PositionalEncoding) -> List[LayerAttention]:
    """Each layer's span and temperature: model.attention and model.temperature, or what the
    encoding sets for that layer (a `layers` pattern's per-kind values); spans of width
    model.attention_window (null: L/4); model.qk_norm, model.attn_gate, model.attn_sinks and
    model.decoupled_rope in every layer."""
    m = cfg.model
    # runs saved before these keys existed: global attention, no temperature
    defaults = {"attention": m.get("attention", "global"),
                "temperature": m.get("temperature", "none")}
    width = m.get("attention_window") or default_width(cfg.train.seq_len)
    layers = []
    for layer in range(m.n_layer):
        options = {**defaults, **encoding.attention_options(layer)}
        kind = options["attention"]
        layers.append(LayerAttention(GLOBAL if kind == "global" else Span(kind, width),
                                     options["temperature"], m.get("qk_norm", False),
                                     m.get("attn_gate", "none"), m.get("attn_sinks", False),
                                     rotary_width(m) or 0))
    return layers
