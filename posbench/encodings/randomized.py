"""Randomized positions (Ruoss et al. 2023): a wrapper that trains its base encoding on sorted
random positions from [0, M), so that distances up to M are seen at a short training length.

In training, every forward call draws n distinct positions from [0, M) uniformly, sorts them, and
shares them across the batch, as google-deepmind/randomized_positional_encodings does.

At evaluation posbench feeds the plain positions 0..n-1 (what the caller passes), where the
released code and ENCODINGS.md §2.6 draw there too (the spec: seeded draws, mean of 3 seeds).
Why: evaluation stays deterministic and prefix-consistent, needs no seed loop in evaluate(), and
0..n-1 is itself a subset of [0, M) whose distances were all trained. The cost: consecutive
tokens sit 1 apart at evaluation but about M/n apart in training draws, a shift of the gap
distribution that the released evaluation avoids; at n = M the two protocols coincide.
"""
import dataclasses
from dataclasses import dataclass

import torch

from posbench.config import ConfigError
from posbench.encodings.base import EncodingConfig, PositionalEncoding, register, registry

HOOKS = ("embed", "rotate", "score_mod", "row_mod", "value_mod")


def sorted_draws(n: int, max_len: int, device=None) -> torch.Tensor:
    """n distinct integers from [0, max_len), uniformly without replacement, ascending."""
    return torch.randperm(max_len, device=device)[:n].sort().values


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
        base = entries[cfg.base]
        if run_cfg.eval.rope_scaling != "none" and not base.cls.rotary:
            raise ConfigError(f"eval.rope_scaling={run_cfg.eval.rope_scaling!r} is not accepted; "
                              f"expected 'none' for encoding.base={cfg.base}, which does not "
                              "rotate q and k")
        base.cls.check(base.config, run_cfg)

    def __init__(self, cfg, dims):
        super().__init__(cfg, dims)
        entry = registry()[cfg.base]
        # a learned base needs a row for every draw
        self.base = entry.cls(entry.config, dataclasses.replace(dims, max_len=max(dims.max_len,
                                                                                  cfg.max_len)))
        self.relative = self.base.relative
        self.prefix_consistent = self.base.prefix_consistent
        for hook in HOOKS:
            setattr(self, hook, getattr(self.base, hook))

    def positions(self, pos):
        if self.training:
            B, T = pos.shape
            pos = sorted_draws(T, self.cfg.max_len, pos.device).expand(B, T)
        return self.base.positions(pos) if self.base.positions is not None else pos

    def set_eval_options(self, rope_scaling="none", logn_scaling=False):
        super().set_eval_options(rope_scaling, logn_scaling)
        self.base.set_eval_options(rope_scaling)

    def notes(self):
        return self.base.notes()
