"""LongRoPE's rescaled frequencies (Ding et al. 2024, arXiv 2402.13753; microsoft/LongRoPE): each
rotary pair i turns at theta_i / lambda_i, the factors lambda found by an evolutionary search at a
target length N (posbench/runs/longrope_search.py), and cos and sin are multiplied by the magnitude
factor sqrt(1 + ln(N/L) / ln L), the reference's "su" policy, which Hugging Face's `longrope`
rope type computes as its default `attention_factor`. The factors come from a JSON file
(eval.longrope_factors, or train.longrope_factors to fine-tune with them, as the paper does):
`factors` (one per pair, each >= 1) and `length` (N, above the training length L), and optionally
`attention_factor` in place of the default. On a model trained without them RoPE applies them past
L only, as Hugging Face switches from its short factors to its long ones past the original
length; on one trained with them, at every length, as the reference's rotary embedding does
(posbench/encodings/rope.py: RoPE.frequencies)."""
from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Optional, Sequence, Tuple

import torch

from posbench.attention.decoupled_rope import rotary_width
from posbench.core.errors import ConfigError, require

HOW = "(`posbench longrope RUN_DIR --length N` writes one)"


def magnitude(length: int, train_len: int) -> float:
    """The reference's "su" magnitude factor at scale s = N/L: sqrt(1 + ln s / ln L), 1 for
    s <= 1. cos and sin carry it, so the logits scale by its square."""
    s = length / train_len
    return 1.0 if s <= 1 else math.sqrt(1 + math.log(s) / math.log(train_len))


@dataclass(frozen=True)
class LongRoPE:
    """Per-pair factors lambda (pair 0, the fastest, first), the target length N they were
    chosen for, and the factor on cos and sin."""
    factors: Tuple[float, ...]
    length: int
    attention_factor: float

    @classmethod
    def at(cls, factors: Sequence[float], length: int, train_len: int) -> "LongRoPE":
        """Factors at target length N with the default magnitude factor."""
        return cls(tuple(float(f) for f in factors), length, magnitude(length, train_len))

    def inv_freq(self, inv_freq: torch.Tensor) -> torch.Tensor:
        """theta_i / lambda_i; a pair at theta = 0 stays 0."""
        return inv_freq / torch.tensor(self.factors, dtype=inv_freq.dtype,
                                       device=inv_freq.device)

    def record(self) -> dict:
        return {"factors": list(self.factors), "length": self.length,
                "attention_factor": self.attention_factor}


def read_factors(path: str, pairs: int, train_len: int,
                 key: str = "eval.longrope_factors") -> LongRoPE:
    """The factors file at `path` for a model with `pairs` rotary pairs trained at `train_len`;
    ConfigError in one line, naming `key`, for a file that is missing, not JSON, or whose values
    do not fit."""
    try:
        data = json.loads(Path(path).read_text())
    except (OSError, ValueError) as err:
        reason = err.strerror if isinstance(err, OSError) else "not JSON"
        raise ConfigError(f"{key}={path!r} is not accepted ({reason}); expected a JSON file of "
                          f"LongRoPE factors {HOW}") from None
    factors = data.get("factors") if isinstance(data, dict) else None
    require(isinstance(factors, list) and all(is_number(f) for f in factors), key, path,
            f"a JSON object whose `factors` is a list of numbers {HOW}")
    require(len(factors) == pairs, key, path, f"{pairs} factors, one per rotary pair of the "
            f"head's {2 * pairs} dimensions; the file holds {len(factors)}")
    require(all(math.isfinite(f) and f >= 1 for f in factors), key, path,
            f"factors that are finite and >= 1 (a pair turns at theta / factor, never faster "
            f"than trained); the file holds {min(factors)}")
    length = data.get("length")
    require(isinstance(length, int) and not isinstance(length, bool) and length > train_len,
            key, path, f"a `length` above the training length {train_len}: the target length N "
            f"the factors were chosen for, which sets the magnitude factor; the file holds "
            f"{length!r}")
    attention: Optional[float] = data.get("attention_factor")
    require(attention is None or is_number(attention) and math.isfinite(attention)
            and attention > 0, key, path, "an `attention_factor` > 0, or none (the default "
            f"sqrt(1 + ln(N/L) / ln L)); the file holds {attention!r}")
    found = LongRoPE.at(factors, length, train_len)
    return found if attention is None else LongRoPE(found.factors, length, float(attention))


def run_factors(cfg, prefix: str = "eval") -> LongRoPE:
    """The file that eval.longrope_factors (prefix "train": train.longrope_factors) names, read
    for the run's rotary head (MLA's rotary part under model.decoupled_rope) and its L (an
    extension's first length)."""
    head_dim = rotary_width(cfg.model) or cfg.model.d_model // cfg.model.n_head
    return read_factors(cfg[prefix].longrope_factors, head_dim // 2,
                        cfg.train.get("original_len") or cfg.train.seq_len,
                        f"{prefix}.longrope_factors")


def is_number(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)
