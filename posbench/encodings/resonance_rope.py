"""Resonance RoPE (Wang et al. 2024): RoPE with every wavelength rounded to a whole number of
tokens, θ̃_p = 2π / round(2π/θ_p) (docs/encodings.md#rotary-family).

A pair whose wavelength λ̃_p = 2π/θ̃_p is an integer takes the same angle at t and t + λ̃_p, so
a pair with λ̃_p <= L has met, during training, every angle it will meet at any later position.

Eval-time scaling (eval.rope_scaling) rounds the scaled frequencies, as the reference's
Resonance-YaRN and Resonance-NTK do: the frequencies the model evaluates with are the ones whose
wavelengths must be whole.
"""
import math
from dataclasses import dataclass

import torch

from posbench.encodings.base import EncodingConfig, register
from posbench.encodings.rope import RoPE


def resonant(inv_freq: torch.Tensor) -> torch.Tensor:
    """θ̃ = 2π / round(2π/θ): the nearest frequency whose wavelength is a whole number."""
    return 2 * math.pi / torch.round(2 * math.pi / inv_freq)


@register("resonance_rope", "RoPE with each wavelength 2π/θ_p rounded to a whole number of tokens")
class ResonanceRoPE(RoPE):
    past_train_len = ("pairs with wavelength <= L repeat angles seen in training exactly; the "
                      "slower pairs still reach unseen angles")
    reference = ("Resonance RoPE: Improving Context Length Generalization of Large Language "
                 "Models (Wang et al. 2024)")

    @dataclass
    class Config(EncodingConfig):
        # sheryc/resonance_rope ResonanceRotaryEmbedding: base=10000
        base: float = 10000.0

    def frequencies(self, n):
        inv_freq, factor = super().frequencies(n)
        return resonant(inv_freq), factor
