"""Learned absolute position embeddings (GPT-2): a table indexed by position."""
from dataclasses import dataclass
from typing import Optional

import torch
from torch import nn

from posbench.core.errors import ConfigError
from posbench.encodings.base import EncodingConfig, PositionalEncoding, register


INIT_STD = 0.01


@register("learned", "a learned table of absolute position vectors added to the input")
class Learned(PositionalEncoding):
    family = "absolute"
    relative = False
    past_train_len = "rows past the training length are never trained and stay at their init"
    reference = "GPT-2 (Radford et al. 2019)"

    @dataclass
    class Config(EncodingConfig):
        # rows of the table; None sizes it for the longest eval length
        max_len: Optional[int] = None
        per_layer: bool = False
        # read row min(t, L-1) past the training length L instead of an untrained row
        clamp: bool = False

    @classmethod
    def check(cls, cfg, run_cfg):
        longest = max([run_cfg.train.seq_len, *run_cfg.eval.lengths])
        if cfg.max_len is not None and cfg.max_len < longest:
            raise ConfigError(f"encoding.max_len={cfg.max_len} is not accepted; a learned table "
                              f"cannot extrapolate, expected >= {longest} (the longest length)")

    def __init__(self, cfg, dims):
        super().__init__(cfg, dims)
        rows = cfg.max_len or dims.max_len
        tables = dims.n_layer if cfg.per_layer else 1
        # GPT-2's wpe init (openai/gpt-2 initializes wpe with std 0.01, wte with 0.02)
        self.tables = nn.ParameterList(
            nn.Parameter(torch.randn(rows, dims.d_model) * INIT_STD) for _ in range(tables))

    def embed(self, x, pos, layer):
        if layer >= len(self.tables):
            return x
        table = self.tables[layer]
        if self.cfg.clamp:  # within the table, which check() sized for the training length
            pos = pos.clamp(max=self.dims.train_len - 1)
        else:
            # training's positions are bounded without reading them (no host sync per step)
            last = (self.dims.train_positions(pos.shape[1]) - 1 if self.in_training_step()
                    else int(pos.max()))
            if last >= table.shape[0]:
                raise ValueError(f"positions reach {last}, past the learned table "
                                 f"({table.shape[0]} rows); raise encoding.max_len")
        return x + table[pos].to(x.dtype)

    def flops(self, batch, length, pairs):
        # the looked-up rows added to the residual stream, at every layer with a table
        return len(self.tables) * batch * length * self.dims.d_model

    def notes(self):
        if self.cfg.clamp:
            return [f"positions >= {self.dims.train_len} read the last trained row (clamp)"]
        rows = self.tables[0].shape[0]
        return [f"learned table has {rows} rows; positions >= {self.dims.train_len} were never "
                f"trained and keep their N(0, {INIT_STD}^2) init"]
