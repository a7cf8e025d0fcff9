"""RoPE-ID (docs/encodings.md, `rope_id`; Wertheimer et al., ICLR 2026): RoPE at high frequency on a
subset of the channels, the others position-free. The subset assumed is half of them, RoPE's
fastest half of its pairs: in the half-split layout the first and third quarters of the head. The
rotation is checked against a float64 oracle built here from that definition with Python floats,
at positions up to 16L."""
import math

import pytest
import torch

import posbench
from posbench.encodings import Dims
from posbench.encodings.p_rope import PRoPE
from posbench.encodings.rope_id import RoPEID

from helpers import (assert_shift_invariant, assert_turned_by, finite_at_16l, plane_rotations,
                     tiny_model)


def make(cls, head_dim, train_len, **options):
    return cls(cls.Config(name="rope_id", **options),
               Dims(1, 1, head_dim, train_len, 16 * train_len))


def oracle_planes(d, base):
    """(dim a, dim b, omega): dims a < d/4 (the first quarter) each turned with its partner
    a + d/2 (in the third quarter) at RoPE's b^(-2a/d); dims of the second and fourth quarters
    are left alone."""
    return [(a, a + d // 2, base ** (-2 * a / d)) for a in range(d // 4)]


@pytest.mark.parametrize("d, L, base", [(32, 128, 1e4), (128, 512, 5e5), (10, 64, 10.0)])
def test_rotates_the_first_and_third_quarters_as_the_definition_up_to_16l(d, L, base):
    pos = torch.tensor([[0, 1, 7, L - 1, L, 5 * L + 3, 16 * L - 1, 16 * L]])
    g = torch.Generator().manual_seed(0)
    q = torch.randn(2, 3, pos.shape[1], d, generator=g, dtype=torch.float64, requires_grad=True)
    k = torch.randn(2, 3, pos.shape[1], d, generator=g, dtype=torch.float64)
    mats = plane_rotations(d, oracle_planes(d, base), pos[0].tolist())
    got_q, got_k = make(RoPEID, d, L, base=base).rotate(q, k, pos, 0)
    assert_turned_by(mats, q, k, got_q, got_k)


def test_is_p_rope_at_one_half_bit_for_bit():
    for d in (32, 64, 10):
        rope_id, p_rope = make(RoPEID, d, 128), make(PRoPE, d, 128, p=0.5)
        assert torch.equal(rope_id.inv_freq, p_rope.inv_freq)
        assert int((rope_id.inv_freq > 0).sum()) == d // 4


def test_notes_say_how_many_rotated_pairs_turn_within_l():
    # d = 32: 8 pairs rotate, of wavelengths 2π·10^(j/4); pairs 6 and 7 (199, 353 tokens) > 128
    assert make(RoPEID, 32, 128).notes() == ["8 of 16 pairs rotate, 6 of them at least once "
                                             "within L=128 tokens; the others carry no position"]


@pytest.mark.parametrize("scaling", ["pi", "ntk", "yarn"])
def test_eval_scalings_keep_the_position_free_half_at_zero(scaling):
    enc = make(RoPEID, 32, 128)
    enc.set_eval_options(scaling, None, 4.0)
    theta, _ = enc.frequencies(512)
    assert (theta[8:] == 0).all() and (theta[:8] > 0).all()
    assert not torch.equal(theta[:8], enc.inv_freq[:8])


def test_a_shift_of_every_position_changes_no_logit():
    model = tiny_model("train.seq_len=32", "eval.lengths=[96]", name="rope_id").double()
    idx = torch.randint(0, 64, (2, 96), generator=torch.Generator().manual_seed(0))
    assert_shift_invariant(model, idx, tol=1e-8)


def test_finite_logits_at_16l_on_model_tiny():
    assert finite_at_16l("encoding=rope_id")


def test_defaults_and_refusals():
    cfg = posbench.compose(["encoding=rope_id"])
    assert cfg.encoding.base == 10000.0 and set(cfg.encoding) == {"name", "base"}
    with pytest.raises(posbench.ConfigError, match=r"^encoding.base=1.0 is not accepted; "):
        posbench.compose(["encoding=rope_id", "encoding.base=1"])
    assert math.isclose(make(RoPEID, 32, 128).inv_freq[7].item(), 10 ** -1.75, rel_tol=1e-15)
