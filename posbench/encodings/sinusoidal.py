"""Sinusoidal absolute positions added to the input (Vaswani et al. 2017)."""
import math
from dataclasses import dataclass

import torch

from posbench.core.errors import ConfigError
from posbench.encodings.base import EncodingConfig, PositionalEncoding, register
from posbench.encodings.rope import rope_inv_freq


def sinusoid_table(pos: torch.Tensor, dim: int, base: float) -> torch.Tensor:
    """(..., dim) with sin at even and cos at odd channels; angles in float64 for long positions."""
    angles = pos.to(torch.float64).unsqueeze(-1) * rope_inv_freq(dim, base, pos.device)
    return torch.stack((angles.sin(), angles.cos()), dim=-1).flatten(-2)[..., :dim]


@register("sinusoidal", "fixed sin/cos of the absolute position added to the token embeddings")
class Sinusoidal(PositionalEncoding):
    family = "absolute"
    relative = False
    past_train_len = "defined at every position, but unseen positions shift the input distribution"
    reference = "Attention Is All You Need (Vaswani et al. 2017)"

    @dataclass
    class Config(EncodingConfig):
        base: float = 10000.0
        every_layer: bool = False
        # PE = amplitude * (sin, cos), added to the token embedding multiplied by sqrt(D): the
        # original Transformer's and fairseq's form (`embed_scale`), which the ALiBi paper's
        # sinusoidal baseline had. Without the sqrt(D), unit sinusoids drown this GPT's token
        # embeddings (init std 0.02) and training ends at the corpus's unigram loss; sinusoids at
        # the tokens' init scale keep the tokens but stay fixed while the tied embeddings grow
        # about 8x during training, so the position signal fades (docs/encodings.md).
        amplitude: float = 1.0
        scale_input: bool = True

    @classmethod
    def check(cls, cfg, run_cfg):
        if not cfg.base > 1:
            raise ConfigError(f"encoding.base={cfg.base} is not accepted; expected a number > 1")
        if not cfg.amplitude > 0:
            raise ConfigError(f"encoding.amplitude={cfg.amplitude} is not accepted; expected a "
                              "number > 0")

    def embed(self, x, pos, layer):
        if layer > 0 and not self.cfg.every_layer:
            return x
        if layer == 0 and self.cfg.scale_input:
            x = x * math.sqrt(x.shape[-1])
        pe = self.cfg.amplitude * sinusoid_table(pos, x.shape[-1], self.cfg.base)
        return x + pe.to(x.dtype)

    def flops(self, batch, length, pairs):
        # per layer it reaches: the D/2 frequencies (3 each), the angles, their sin and cos, the
        # amplitude and the sum (3.5 per coordinate of a sequence); once, the input's sqrt(D)
        D = self.dims.d_model
        layers = self.dims.n_layer if self.cfg.every_layer else 1
        return (layers * (1.5 * D + 3.5 * batch * length * D)
                + self.cfg.scale_input * batch * length * D)
