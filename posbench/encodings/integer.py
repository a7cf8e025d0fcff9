"""Integer positions added to every component of the input embedding (the HF blog's first naive
scheme): raw t, or t normalized by the current length or by the training length.

Deviation from the scheme as usually written, which adds t*1 (docs/encodings.md#absolute-family):
in this pre-LayerNorm GPT the all-ones direction is exactly what every LayerNorm subtracts with
the mean, so x_t + t*1 reaches no block and no logit (only rounding of x_t + t would). posbench
adds t*u with u = (+1, -1, +1, ...): every component still moves by t and |PE(t)| = t*sqrt(D) as
with t*1, but u is orthogonal to 1, so the position survives LayerNorm and large t swamps the
token embedding as t*1 would.
"""
from dataclasses import dataclass

import torch

from posbench.core.errors import ConfigError
from posbench.encodings.base import EncodingConfig, PositionalEncoding, register

NORM_BY = ("none", "n", "L")


def alternating_signs(dim: int, device=None) -> torch.Tensor:
    """u = (+1, -1, +1, ...) of length dim, float64."""
    return 1 - 2 * (torch.arange(dim, device=device) % 2).to(torch.float64)


@dataclass
class IntegerConfig(EncodingConfig):
    # none: t; n: t / (n - 1) with n the current length; L: t / (L - 1) with L the training length
    norm_by: str = "none"


@register("integer", "the raw position t added to every embedding component (signs alternate)")
@register("integer_norm", "t / (n - 1), n the current length, added to every embedding component",
          IntegerConfig(norm_by="n"))
class Integer(PositionalEncoding):
    family = "absolute"
    relative = False
    past_train_len = "raw values past L were never seen; normalized by n, a value changes meaning"
    reference = "HF blog, You could have designed state of the art positional encoding"
    Config = IntegerConfig

    @classmethod
    def check(cls, cfg, run_cfg):
        if cfg.norm_by not in NORM_BY:
            raise ConfigError(f"encoding.norm_by={cfg.norm_by!r} is not accepted; expected one "
                              f"of {NORM_BY}")
        if cfg.norm_by == "L" and run_cfg.train.seq_len < 2:
            raise ConfigError(f"train.seq_len={run_cfg.train.seq_len} is not accepted with "
                              "encoding.norm_by=L; expected >= 2 (PE divides by L - 1)")
        if cfg.norm_by == "n" and run_cfg.train.get("pack_documents", False):
            raise ConfigError("train.pack_documents=True is not accepted with encoding.norm_by=n; "
                              "expected false: t / (n - 1) divides by the row's length, not the "
                              "document's")

    def __init__(self, cfg, dims):
        super().__init__(cfg, dims)
        # normalizing by the current length makes every value depend on how long the input is
        self.prefix_consistent = cfg.norm_by != "n"

    def values(self, pos: torch.Tensor) -> torch.Tensor:
        """The position value at each position, (B, T) float64: t, t/(n-1) or t/(L-1)."""
        t = pos.to(torch.float64)
        if self.cfg.norm_by == "n":
            return t / max(pos.shape[-1] - 1, 1)  # a single token gets t / 1
        if self.cfg.norm_by == "L":
            return t / (self.dims.train_len - 1)
        return t

    def table(self, pos: torch.Tensor, dim: int) -> torch.Tensor:
        """PE (B, T, dim) float64: the value times (+1, -1, +1, ...)."""
        return self.values(pos).unsqueeze(-1) * alternating_signs(dim, pos.device)

    def embed(self, x, pos, layer):
        if layer > 0:
            return x
        return x + self.table(pos, x.shape[-1]).to(x.dtype)

    def flops(self, batch, length, pairs):
        # the signs 1 - 2 (c mod 2), the value times them and the sum with the input (2 per
        # coordinate of a sequence), and a division per token when normalized
        D = self.dims.d_model
        return 2 * D + 2 * batch * length * D + (self.cfg.norm_by != "none") * batch * length
