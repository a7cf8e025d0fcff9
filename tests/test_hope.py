"""HoPE (docs/encodings.md, `hope`): RoPE on the pairs whose wavelength 2π/θ_j is at most the
training length L, the slower pairs position-free (Chen et al., ACL 2025). The rotation is checked
against a float64 oracle built here from that definition with Python floats, not from posbench's
RoPE helpers, at positions up to 16L."""
import math

import pytest
import torch

import posbench
from posbench.encodings import Dims
from posbench.encodings.hope import HoPE
from posbench.encodings.rope import RoPE

from helpers import (assert_shift_invariant, assert_turned_by, finite_at_16l, plane_rotations,
                     tiny_model)

F64 = torch.float64


def make(cls, head_dim, train_len, original_len=None, **options):
    return cls(cls.Config(name="hope", **options),
               Dims(1, 1, head_dim, train_len, 16 * train_len, original_len=original_len))


def positions(L):
    return torch.tensor([[0, 1, 7, L - 1, L, 5 * L + 3, 16 * L - 1, 16 * L]])


def oracle_planes(d, L, base):
    """(dim a, dim b, omega) of every plane that turns: RoPE's pair j is dims (j, j + d/2) at
    omega_j = b^(-2j/d), and HoPE keeps it when it completes a turn within L tokens,
    2π/omega_j <= L."""
    planes = []
    for j in range(d // 2):
        omega = base ** (-2 * j / d)
        if 2 * math.pi / omega <= L:
            planes.append((j, j + d // 2, omega))
    return planes


def random_qk(d, T, seed=0):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(2, 3, T, d, generator=g, dtype=F64),
            torch.randn(2, 3, T, d, generator=g, dtype=F64))


@pytest.mark.parametrize("d, L, base", [(32, 128, 1e4), (64, 512, 1e4), (16, 100, 500.0),
                                        (10, 64, 10.0)])
def test_rotates_q_and_k_as_the_definition_up_to_16l_forward_and_gradient(d, L, base):
    pos = positions(L)
    q, k = random_qk(d, pos.shape[1])
    q.requires_grad_(True)
    mats = plane_rotations(d, oracle_planes(d, L, base), pos[0].tolist())
    got_q, got_k = make(HoPE, d, L, base=base).rotate(q, k, pos, 0)
    assert_turned_by(mats, q, k, got_q, got_k)


def test_head_of_32_at_l_128_keeps_its_6_fastest_pairs_as_ropes_bit_for_bit():
    # wavelengths 2π·10^(j/4): pair 5 turns in 111.7 tokens, pair 6 in 198.7 > 128
    hope, rope = make(HoPE, 32, 128).inv_freq, make(RoPE, 32, 128).inv_freq
    assert torch.equal(hope[:6], rope[:6]) and (hope[6:] == 0).all()
    assert 2 * math.pi / rope[5] < 128 < 2 * math.pi / rope[6]
    assert make(HoPE, 32, 128).notes() == ["6 of 16 pairs rotate (those that turn within L=128 "
                                           "tokens); the others carry no position"]


def test_is_rope_once_every_pair_turns_within_l_and_nope_below_2pi():
    # d = 8, b = 10: the slowest pair, θ_3 = 10^(-3/4), turns in 35.33 tokens
    q, k = random_qk(8, positions(36).shape[1])
    rope = make(RoPE, 8, 36, base=10.0)
    for L in (36, 1000):
        hope = make(HoPE, 8, L, base=10.0)
        assert torch.equal(hope.inv_freq, rope.inv_freq)
        for got, expected in zip(hope.rotate(q, k, positions(36), 0),
                                 rope.rotate(q, k, positions(36), 0)):
            assert torch.equal(got, expected)
    assert int((make(HoPE, 8, 35, base=10.0).inv_freq > 0).sum()) == 3
    nope = make(HoPE, 8, 6, base=10.0)  # even θ_0 = 1 needs 2π > 6 tokens for a turn
    assert (nope.inv_freq == 0).all()
    for got, expected in zip(nope.rotate(q, k, positions(36), 0), (q, k)):
        assert torch.equal(got, expected)


def test_an_extension_keeps_the_cut_of_the_first_runs_length():
    first = make(HoPE, 32, 128).inv_freq
    extended = make(HoPE, 32, 512, original_len=128).inv_freq
    assert torch.equal(extended, first)
    assert int((make(HoPE, 32, 512).inv_freq > 0).sum()) == 8  # a run trained at 512 keeps 8


@pytest.mark.parametrize("scaling", ["pi", "ntk", "dynamic_ntk", "yarn"])
def test_eval_scalings_keep_the_position_free_pairs_at_zero_and_scale_the_kept_ones(scaling):
    hope, rope = make(HoPE, 32, 128), make(RoPE, 32, 128)
    for enc in (hope, rope):
        enc.set_eval_options(scaling, None, 4.0)
    (theta, factor), (rope_theta, rope_factor) = hope.frequencies(512), rope.frequencies(512)
    assert factor == rope_factor and (theta[6:] == 0).all()
    torch.testing.assert_close(theta[:6], rope_theta[:6], rtol=1e-14, atol=0)
    assert not torch.equal(theta[:6], hope.inv_freq[:6])


def test_a_shift_of_every_position_changes_no_logit():
    # its evaluation paths against its training path: tests/test_eval_paths.py
    model = tiny_model("train.seq_len=32", "eval.lengths=[96]", name="hope").double()
    idx = torch.randint(0, 64, (2, 96), generator=torch.Generator().manual_seed(0))
    assert_shift_invariant(model, idx, tol=1e-8)


def test_finite_logits_at_16l_on_model_tiny():
    assert finite_at_16l("encoding=hope")


def test_defaults_and_refusals():
    cfg = posbench.compose(["encoding=hope"])
    assert cfg.encoding.base == 10000.0 and set(cfg.encoding) == {"name", "base"}
    with pytest.raises(posbench.ConfigError, match=r"^encoding.base=1.0 is not accepted; "):
        posbench.compose(["encoding=hope", "encoding.base=1"])
    for scaling in ("pi", "ntk", "dynamic_ntk", "yarn", "rerope", "self_extend", "shifted_rope",
                    "dca"):
        posbench.compose(["encoding=hope", f"eval.rope_scaling={scaling}"])
