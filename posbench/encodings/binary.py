"""Binary positions: bit k of t, least significant first, added to embedding dim k."""
from dataclasses import dataclass

import torch

from posbench.encodings.base import EncodingConfig, PositionalEncoding, register

# int64 positions have no set bit at or above 63; higher dims hold the constant 0 bit
POSITION_BITS = 63


def binary_table(pos: torch.Tensor, dim: int, signed: bool) -> torch.Tensor:
    """(..., dim) float64 with [k] = floor(t / 2^k) mod 2, mapped to 2b - 1 when `signed`."""
    shifts = torch.arange(min(dim, POSITION_BITS), device=pos.device)
    bits = (pos.unsqueeze(-1) >> shifts) & 1
    bits = torch.nn.functional.pad(bits, (0, dim - bits.shape[-1])).to(torch.float64)
    return 2 * bits - 1 if signed else bits


@register("binary", "the bits of t (least significant in dim 0) added to the embeddings")
class Binary(PositionalEncoding):
    family = "absolute"
    relative = False
    past_train_len = "bits k >= ceil(log2 L) were always 0 in training and switch on past L"
    reference = "HF blog, You could have designed state of the art positional encoding"

    @dataclass
    class Config(EncodingConfig):
        # bits as {-1, +1} instead of {0, 1}
        signed: bool = False

    def embed(self, x, pos, layer):
        if layer > 0:
            return x
        return x + binary_table(pos, x.shape[-1], self.cfg.signed).to(x.dtype)

    def flops(self, batch, length, pairs):
        # the bits added to the input (shifts and masks are not arithmetic), mapped to 2b - 1
        # first when signed
        return (3 if self.cfg.signed else 1) * batch * length * self.dims.d_model
