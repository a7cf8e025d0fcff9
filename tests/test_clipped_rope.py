"""Clipped RoPE (docs/encodings.md, `clipped_rope`), the paper's CoPE (Li et al. 2026): the N
slowest pairs of RoPE turn at θ_j·w_k, w_k = (1 + cos(πk/(N-1)))/2, a soft clip to 0 (hrlics/CoPE's
LlamaRotaryEmbedding); `variant=hard` is the paper's HardClip, those pairs at 0. Each is checked
against a float64 oracle built here from that definition with Python floats, at positions up to
16L."""
import math

import pytest
import torch

import posbench
from posbench.encodings import Dims
from posbench.encodings.clipped_rope import ClippedRoPE
from posbench.encodings.p_rope import PRoPE
from posbench.encodings.rope import RoPE

from helpers import (assert_shift_invariant, assert_turned_by, finite_at_16l, plane_rotations,
                     tiny_model)

F64 = torch.float64
BASE = 10000.0
L = 128
POSITIONS = torch.tensor([[0, 1, 7, L - 1, L, 5 * L + 3, 16 * L - 1, 16 * L]])


def make(cls, head_dim, name="clipped_rope", **options):
    return cls(cls.Config(name=name, **options), Dims(1, 1, head_dim, L, 16 * L))


def oracle_weights(d, clip, variant):
    """w_j per pair j = 0..d/2-1: 1, except on the N = floor(clip d/2) slowest, where pair
    d/2 - N + k takes (1 + cos(π k/(N-1)))/2 (soft; 1 when N = 1, the reference's one-step
    linspace) or 0 (hard)."""
    n = d // 2
    N = math.floor(clip * d / 2)
    w = [1.0] * n
    for k in range(N):
        if variant == "hard":
            w[n - N + k] = 0.0
        else:
            w[n - N + k] = 1.0 if N == 1 else (1 + math.cos(math.pi * k / (N - 1))) / 2
    return w


def oracle_matrices(d, clip, variant, pos):
    """M(t) per position: RoPE's pair j is dims (j, j + d/2), turned by t b^(-2j/d) w_j."""
    w = oracle_weights(d, clip, variant)
    planes = [(j, j + d // 2, BASE ** (-2 * j / d) * w[j]) for j in range(d // 2)]
    return plane_rotations(d, planes, pos[0].tolist())


def random_qk(d, seed=0):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(2, 3, POSITIONS.shape[1], d, generator=g, dtype=F64),
            torch.randn(2, 3, POSITIONS.shape[1], d, generator=g, dtype=F64))


@pytest.mark.parametrize("variant", ["soft", "hard"])
@pytest.mark.parametrize("d, clip", [(128, 20 / 64), (32, 20 / 64), (16, 0.5), (10, 0.6),
                                     (32, 1.0)])
def test_rotates_q_and_k_as_the_definition_up_to_16l_forward_and_gradient(variant, d, clip):
    q, k = random_qk(d)
    q.requires_grad_(True)
    mats = oracle_matrices(d, clip, variant, POSITIONS)
    got_q, got_k = make(ClippedRoPE, d, clip=clip, variant=variant).rotate(q, k, POSITIONS, 0)
    assert_turned_by(mats, q, k, got_q, got_k)


def test_the_references_taper_on_a_head_of_128_runs_from_1_to_0_over_its_20_slowest_pairs():
    theta = make(ClippedRoPE, 128).inv_freq / make(RoPE, 128).inv_freq
    assert torch.equal(theta[:45], torch.ones(45, dtype=F64))  # pair 44 is the taper's w = 1
    assert theta[63] == 0 and 0 < theta[62] < theta[61] < theta[45] < 1
    torch.testing.assert_close(theta[44:] + theta[44:].flip(0), torch.ones(20, dtype=F64),
                               rtol=0, atol=1e-15)  # the half cosine is odd about its middle


@pytest.mark.parametrize("variant", ["soft", "hard"])
def test_clip_zero_is_rope_bit_for_bit(variant):
    q, k = random_qk(32)
    enc, rope = make(ClippedRoPE, 32, clip=0.0, variant=variant), make(RoPE, 32, name="rope")
    assert torch.equal(enc.inv_freq, rope.inv_freq)
    for got, expected in zip(enc.rotate(q, k, POSITIONS, 0), rope.rotate(q, k, POSITIONS, 0)):
        assert torch.equal(got, expected)


def test_one_soft_clipped_pair_is_rope_as_in_the_reference_and_one_hard_one_stops():
    rope = make(RoPE, 32, name="rope").inv_freq
    assert torch.equal(make(ClippedRoPE, 32, clip=1 / 16).inv_freq, rope)  # N = 1
    hard = make(ClippedRoPE, 32, clip=1 / 16, variant="hard").inv_freq
    assert torch.equal(hard[:15], rope[:15]) and hard[15] == 0


def test_hard_clip_of_every_pair_is_nope_and_of_a_quarter_is_p_rope_at_three_quarters():
    q, k = random_qk(32)
    nope = make(ClippedRoPE, 32, clip=1.0, variant="hard")
    for got, expected in zip(nope.rotate(q, k, POSITIONS, 0), (q, k)):
        assert torch.equal(got, expected)
    hard = make(ClippedRoPE, 32, clip=0.25, variant="hard").inv_freq
    assert torch.equal(hard, make(PRoPE, 32, name="p_rope", p=0.75).inv_freq)


@pytest.mark.parametrize("scaling", ["pi", "ntk", "dynamic_ntk", "yarn"])
@pytest.mark.parametrize("variant", ["soft", "hard"])
def test_eval_scalings_scale_the_clipped_frequencies_pair_by_pair(scaling, variant):
    enc, rope = make(ClippedRoPE, 32, variant=variant), make(RoPE, 32, name="rope")
    for e in (enc, rope):
        e.set_eval_options(scaling, None, 4.0)
    (theta, factor), (rope_theta, rope_factor) = enc.frequencies(512), rope.frequencies(512)
    weights = torch.tensor(oracle_weights(32, 20 / 64, variant), dtype=F64)
    assert factor == rope_factor
    torch.testing.assert_close(theta, rope_theta * weights, rtol=1e-14, atol=0)


@pytest.mark.parametrize("variant", ["soft", "hard"])
def test_a_shift_of_every_position_changes_no_logit(variant):
    # its evaluation paths against its training path: tests/test_eval_paths.py
    model = tiny_model("train.seq_len=32", "eval.lengths=[96]", f"encoding.variant={variant}",
                       name="clipped_rope").double()
    idx = torch.randint(0, 64, (2, 96), generator=torch.Generator().manual_seed(0))
    assert_shift_invariant(model, idx, tol=1e-8)


@pytest.mark.parametrize("variant", ["soft", "hard"])
def test_finite_logits_at_16l_on_model_tiny(variant):
    assert finite_at_16l("encoding=clipped_rope", f"encoding.variant={variant}")


def test_defaults_are_the_references_soft_clip_of_20_in_64_pairs():
    cfg = posbench.compose(["encoding=clipped_rope"])
    assert (cfg.encoding.clip, cfg.encoding.variant, cfg.encoding.base) == (0.3125, "soft", 1e4)


@pytest.mark.parametrize("override, message", [
    ("encoding.clip=1.5", r"^encoding.clip=1.5 is not accepted; expected 0 <= clip <= 1 \(.*\)$"),
    ("encoding.clip=-0.1", r"^encoding.clip=-0.1 is not accepted; expected 0 <= clip <= 1 "),
    ("encoding.variant=medium", r"^encoding.variant='medium' is not accepted; expected soft "
                                r"\(.*\) or hard \(.*\)$"),
])
def test_bad_values_are_refused_in_one_line(override, message):
    with pytest.raises(posbench.ConfigError, match=message) as err:
        posbench.compose(["encoding=clipped_rope", override])
    assert "\n" not in str(err.value)
