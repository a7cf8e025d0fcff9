"""Resonance RoPE (docs/encodings.md#rotary-family): RoPE's wavelengths rounded to whole tokens,
under every eval-time scaling too. The oracles compute the wavelengths in Python floats."""
import math

import pytest
import torch

import posbench
from posbench.encodings import Dims
from posbench.encodings.resonance_rope import ResonanceRoPE
from posbench.encodings.rope import RoPE

F64 = torch.float64
D, L = 32, 64


def make(cls=ResonanceRoPE, scaling="none", factor=None, d=D, train_len=L):
    enc = cls(cls.Config(name=cls.__name__, base=1e4), Dims(1, 1, d, train_len, 8 * train_len))
    enc.set_eval_options(scaling, rope_scaling_factor=factor)
    return enc


def rounded(inv_freq):
    """2π / round(2π/θ) pair by pair, in Python floats."""
    return torch.tensor([2 * math.pi / round(2 * math.pi / t) for t in inv_freq.tolist()],
                        dtype=F64)


def test_wavelengths_are_ropes_rounded_to_whole_tokens():
    inv_freq, factor = make().frequencies(L)
    rope = [1e4 ** (-2 * p / D) for p in range(D // 2)]
    torch.testing.assert_close(inv_freq, rounded(torch.tensor(rope)), rtol=1e-15, atol=0)
    wavelengths = 2 * math.pi / inv_freq
    torch.testing.assert_close(wavelengths, wavelengths.round(), rtol=1e-12, atol=0)
    # hand-checked: λ_0 = 2π = 6.28 -> 6, λ_1 = 2π·10^(1/4) = 11.17 -> 11, λ_15 = 2π·10^(15/4)
    assert wavelengths[:2].tolist() == pytest.approx([6, 11], rel=1e-12)
    assert wavelengths[15].item() == pytest.approx(35333, rel=1e-12) and factor == 1.0


def test_pairs_of_wavelength_up_to_l_repeat_their_training_angles_exactly():
    """q̃·k̃ of pair p at lag Δ + λ̃_p equals that at Δ: a pair with λ̃_p <= L met every angle
    during training. RoPE's pairs never repeat exactly."""
    q, k = torch.randn(2, 1, 1, 1, D, dtype=F64, generator=torch.Generator().manual_seed(0))

    def pair_logits(enc, i, j):
        pos = torch.tensor([[i, j]])
        qt, kt = enc.rotate(q.expand(1, 1, 2, D), k.expand(1, 1, 2, D), pos, 0)
        product = qt[0, 0, 0] * kt[0, 0, 1]
        return product[:D // 2] + product[D // 2:]  # per pair

    enc, rope = make(), make(RoPE)
    wavelengths = (2 * math.pi / enc.frequencies(L)[0]).round().long()
    short = wavelengths <= L
    assert short.sum() == 5  # 6, 11, 20, 35, 63 tokens
    for i, j in ((10, 3), (5000, 4000)):
        for p in short.nonzero().flatten().tolist():
            later = i + 7 * int(wavelengths[p])  # seven turns further
            torch.testing.assert_close(pair_logits(enc, later, j)[p], pair_logits(enc, i, j)[p],
                                       rtol=0, atol=1e-9)
            assert (pair_logits(rope, later, j)[p] - pair_logits(rope, i, j)[p]).abs() > 1e-3


@pytest.mark.parametrize("scaling,factor", [("pi", 4.0), ("ntk", 4.0), ("yarn", 4.0),
                                            ("yarn", None), ("dynamic_ntk", None)])
def test_eval_scaling_rounds_the_scaled_frequencies(scaling, factor):
    """As Resonance-YaRN: the scaled RoPE frequencies, then whole wavelengths; YaRN's attention
    factor unchanged."""
    n = 4 * L
    got, got_factor = make(scaling=scaling, factor=factor).frequencies(n)
    scaled, rope_factor = make(RoPE, scaling=scaling, factor=factor).frequencies(n)
    assert not torch.allclose(scaled, make(RoPE).frequencies(n)[0])  # the scaling acts
    torch.testing.assert_close(got, rounded(scaled), rtol=1e-15, atol=0)
    assert got_factor == rope_factor


def test_logits_follow_the_rounded_frequencies_and_are_shift_invariant_up_to_10k():
    enc = make()
    inv_freq = rounded(torch.tensor([1e4 ** (-2 * p / D) for p in range(D // 2)]))
    q, k = torch.randn(2, 1, 1, 40, D, dtype=F64, generator=torch.Generator().manual_seed(1))
    pos = torch.arange(40).view(1, 40)

    def logits(offset):
        qt, kt = enc.rotate(q, k, pos + offset, 0)
        return qt[0, 0] @ kt[0, 0].T

    lag = (pos.view(40, 1) - pos.view(1, 40)).double()
    (q1, q2), (k1, k2) = q[0, 0].chunk(2, -1), k[0, 0].chunk(2, -1)
    # pair p: q_p^T R(-Δθ_p) k_p summed over the pairs
    angle = lag.unsqueeze(-1) * inv_freq
    expected = ((q1.unsqueeze(1) * k1 + q2.unsqueeze(1) * k2) * angle.cos()
                + (q1.unsqueeze(1) * k2 - q2.unsqueeze(1) * k1) * angle.sin()).sum(-1)
    torch.testing.assert_close(logits(0), expected, rtol=1e-12, atol=1e-12)
    for c in (1, 17, 1000, 10**4):
        torch.testing.assert_close(logits(c), logits(0), rtol=0, atol=1e-10)


def test_accepts_eval_rope_scaling_and_refuses_a_base_of_one_in_one_line():
    posbench.compose(["encoding=resonance_rope", "eval.rope_scaling=yarn"])
    with pytest.raises(posbench.ConfigError, match=r"^encoding.base=1.0 is not accepted; "
                                                  r"expected a number > 1$"):
        posbench.compose(["encoding=resonance_rope", "encoding.base=1"])
