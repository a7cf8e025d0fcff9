"""Randomized positions (Ruoss et al. 2023): a wrapper that trains its base encoding on sorted
random positions from [0, M), so that distances up to M are seen at a short training length.

In training, every forward call draws n distinct positions from [0, M) uniformly, sorts them, and
shares them across the batch, as google-deepmind/randomized_positional_encodings does.

At evaluation, eval.randomized_positions chooses (docs/encodings.md):
- `random` (the default): sorted draws below M again, the reference's protocol. The default because
  it is the distribution the model was trained on: with M = 2048 and n = 128, neighbouring tokens
  sat about M/n = 16 apart in every training draw, so plain positions, 1 apart, would be a shift
  of the input even at the training length, and the parity check there would charge the encoding
  for a protocol its authors did not use. Each evaluated window draws its own positions from a
  generator seeded by (EVAL_SEED, n, its index among the windows of length n), never from the
  global RNG: every run and re-evaluation scores the same windows at the same positions, whatever
  eval.batch_tokens and the other lengths are. (The reference shares one draw across a batch; the
  positions of any one window are distributed the same.) A window longer than M has no room for n
  distinct draws below M and reads 0..n-1, which is what n sorted draws below n are.
- `plain`: 0..n-1, as the caller passes them; prefix-consistent, but the gaps between
  neighbours are ones the model rarely saw below n = M.
"""
import dataclasses
from dataclasses import dataclass

import numpy as np
import torch

from posbench.core.errors import ConfigError
from posbench.encodings.base import EncodingConfig, PositionalEncoding, register, registry

# evaluation draws never depend on the run's seed: every run is scored at the same positions
EVAL_SEED = 1


def sorted_draws(n: int, max_len: int, device=None, generator=None) -> torch.Tensor:
    """n distinct integers from [0, max_len), uniformly without replacement, ascending: from the
    global RNG on `device`, or from a CPU `generator`, then moved to `device`."""
    if generator is None:
        return torch.randperm(max_len, device=device)[:n].sort().values
    return torch.randperm(max_len, generator=generator)[:n].sort().values.to(device)


def window_generator(n: int, window: int) -> torch.Generator:
    """The CPU generator of evaluation window `window` (counted from 0) among those of length n."""
    seed = np.random.SeedSequence([EVAL_SEED, n, window]).generate_state(1)[0]
    return torch.Generator().manual_seed(int(seed))


@register("randomized", "trains its base encoding (default RoPE) on sorted random positions < M")
class Randomized(PositionalEncoding):
    family = "absolute"
    relative = True  # as its default base, RoPE; an instance takes its base's value
    rotary = True  # eval.rope_scaling is accepted when the base rotates (see check)
    past_train_len = "distances up to M were seen in training; lengths up to M are in distribution"
    reference = "Randomized Positional Encodings Boost Length Generalization (Ruoss et al. 2023)"

    @dataclass
    class Config(EncodingConfig):
        # the wrapped encoding, with its registered defaults
        base: str = "rope"
        # M: training positions are drawn from [0, M)
        max_len: int = 2048

    @classmethod
    def check(cls, cfg, run_cfg):
        entries = registry()
        if cfg.base not in entries or cfg.base == "randomized":
            raise ConfigError(f"encoding.base={cfg.base!r} is not accepted; expected one of: "
                              + ", ".join(n for n in entries if n != "randomized"))
        if cfg.max_len < run_cfg.train.seq_len:
            raise ConfigError(f"encoding.max_len={cfg.max_len} is not accepted; expected >= "
                              f"train.seq_len={run_cfg.train.seq_len} (n distinct draws from M)")
        if run_cfg.train.get("pack_documents", False):
            raise ConfigError("train.pack_documents=True is not accepted; expected false for "
                              "encoding=randomized: its training positions are one sorted draw "
                              "per row, not per document")
        base = entries[cfg.base]
        if run_cfg.eval.rope_scaling != "none" and not base.cls.rotary:
            raise ConfigError(f"eval.rope_scaling={run_cfg.eval.rope_scaling!r} is not accepted; "
                              f"expected 'none' for encoding.base={cfg.base}, which does not "
                              "rotate q and k")
        base.cls.check(base.config, run_cfg)

    def __init__(self, cfg, dims):
        super().__init__(cfg, dims)
        entry = registry()[cfg.base]
        # a learned base needs a row for every draw, and training's draws lie below M
        self.base = entry.cls(entry.config, dataclasses.replace(
            dims, max_len=max(dims.max_len, cfg.max_len),
            train_span=max(dims.train_span or 0, cfg.max_len)))
        # the base's hooks and flags, but positions of its own, and no rotation-only options:
        # rotary stays the class's (check refuses rope_scaling for a base that does not rotate),
        # and remaps are refused (rope_remaps)
        for name in self.HOOKS + self.FLAGS:
            if name not in ("positions", "remap", "rotary"):
                setattr(self, name, getattr(self.base, name))

    def at_layer(self, layer):
        return self.base.at_layer(layer)  # a pattern's own encoding per layer

    def flops(self, batch, length, pairs):
        return self.base.flops(batch, length, pairs)

    def attention_options(self, layer):
        return self.base.attention_options(layer)  # a pattern's spans and temperatures

    def positions(self, pos):
        B, T = pos.shape
        if self.training:
            pos = sorted_draws(T, self.cfg.max_len, pos.device).expand(B, T)
        elif self.randomized_positions == "random":
            first = self.windows_drawn.get(T, 0)
            self.windows_drawn[T] = first + B
            span = max(self.cfg.max_len, T)  # n > M: n sorted draws below n are 0..n-1
            pos = torch.stack([sorted_draws(T, span, generator=window_generator(T, window))
                               for window in range(first, first + B)]).to(pos.device)
        return self.base.positions(pos) if self.base.positions is not None else pos

    def set_eval_options(self, rope_scaling="none", temperature=None, rope_scaling_factor=None,
                         randomized_positions="plain", rope_window=None, rope_shift=None,
                         rope_chunk=None, longrope_factors=None):
        super().set_eval_options(rope_scaling, temperature, rope_scaling_factor,
                                 randomized_positions, rope_window, rope_shift)
        self.base.set_eval_options(rope_scaling, rope_scaling_factor=rope_scaling_factor,
                                   longrope_factors=longrope_factors)
        # evaluation windows drawn so far, per length: window i of length n always gets the same
        # positions, counted from here
        self.windows_drawn = {}

    def notes(self):
        return self.base.notes()
