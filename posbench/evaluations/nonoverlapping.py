"""eval.protocol=nonoverlapping, the ALiBi paper's: disjoint windows, every target scored."""
from __future__ import annotations

import math

import numpy as np

from posbench.data.windows import spread
from posbench.evaluations.base import register
from posbench.evaluations.perplexity import Protocol


@register("nonoverlapping", "ceil(tokens/length) disjoint validation windows at each length, "
          "every target scored")
class Nonoverlapping(Protocol):
    whole_windows = True

    @classmethod
    def starts(cls, data, length: int, cfg) -> np.ndarray:
        """Windows of length+1 tokens laid end to end in every validation document, spread
        evenly over all that fit."""
        span = length + 1
        candidates = [start + span * np.arange(n // span)
                      for start, n in zip(data.val_docs[:-1], np.diff(data.val_docs))]
        return spread(candidates, math.ceil(cfg.tokens / length), f"windows of {span} tokens",
                      data, length, cfg.tokens)
