"""eval.protocol=growing_context: the same final blocks of eval.stride targets (default the
shortest length) at every length, with `length` tokens of context: only the context grows, which
separates the use of long context from the early-token effect."""
from __future__ import annotations

import math
from typing import Optional

import numpy as np

from posbench.data.windows import spread
from posbench.evaluations.base import register
from posbench.evaluations.perplexity import Protocol


@register("growing_context", "the same final blocks of eval.stride targets scored at every length, "
          "with ever longer context")
class GrowingContext(Protocol):
    @classmethod
    def stride(cls, cfg) -> Optional[int]:
        return cfg.stride or min(cfg.lengths)

    @classmethod
    def starts(cls, data, length: int, cfg) -> np.ndarray:
        """Block ends placed where the longest context fits, the same at every length; each
        window ends at one."""
        block, longest = cls.stride(cfg), max(cfg.lengths)
        docs = zip(data.val_docs[:-1], np.diff(data.val_docs))
        ends = spread([s + longest + 1 + block * np.arange((n - longest - 1) // block + 1)
                       for s, n in docs if n > longest], math.ceil(cfg.tokens / block),
                      f"blocks of {block} tokens after {longest} of context", data, length,
                      cfg.tokens)
        return ends - length - 1
