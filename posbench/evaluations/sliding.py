"""eval.protocol=sliding: a window every eval.stride tokens, each scoring its last stride targets,
which so get at least length - stride tokens of context."""
from __future__ import annotations

import math
from typing import Optional

import numpy as np

from posbench.data.windows import spread
from posbench.core.errors import require
from posbench.evaluations.base import register
from posbench.evaluations.perplexity import Protocol


@register("sliding", "windows every eval.stride tokens, each scoring its last stride targets "
          "(context at least length - stride)")
class Sliding(Protocol):
    @classmethod
    def check(cls, cfg, run_cfg) -> None:
        require(cfg.stride is not None, "eval.stride", cfg.stride,
                "a positive integer with eval.protocol=sliding (tokens scored per window)")
        super().check(cfg, run_cfg)

    @classmethod
    def stride(cls, cfg) -> Optional[int]:
        return cfg.stride or min(cfg.lengths)

    @classmethod
    def starts(cls, data, length: int, cfg) -> np.ndarray:
        """ceil(tokens/stride) windows, spread over all that start a multiple of the stride into
        a validation document."""
        block = cls.stride(cfg)
        docs = zip(data.val_docs[:-1], np.diff(data.val_docs))
        return spread([s + block * np.arange((n - length - 1) // block + 1)
                       for s, n in docs if n > length], math.ceil(cfg.tokens / block),
                      f"windows of {length + 1} tokens every {block}", data, length, cfg.tokens)
