"""p-RoPE's `encoding.variant` (docs/encodings.md, `p_rope`): the paper's p-RoPE and the two
ablations of Table 2 of Barbero et al. 2024, "reversed" (the fastest pairs stop) and "partial"
(a RoPE of dimension 2R, GPT-NeoX's rotary_pct). Each is checked against a float64 rotation built
here from its definition, not from posbench's RoPE helpers."""
import math

import pytest
import torch

import posbench
from posbench.encodings import Dims
from posbench.encodings.p_rope import PRoPE
from posbench.encodings.rope import RoPE

from helpers import assert_shift_invariant, plane_rotations, tiny_model

F64 = torch.float64
BASE = 10000.0
POSITIONS = torch.tensor([[0, 1, 7, 250, 4096, 65537]])


def make(cls, head_dim, **options):
    return cls(cls.Config(name="p_rope", **options), Dims(1, 1, head_dim, 64, 128))


def random_qk(d, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(2, 2, 3, POSITIONS.shape[1], d, generator=g, dtype=F64)


def oracle_planes(variant, p, d):
    """(dim a, dim b, omega) for every plane that turns, from the definitions: RoPE's pair k is
    dims (k, k + d/2) at omega_k = b^(-2k/d). p_rope keeps the R = floor(p d/2) fastest pairs,
    reversed the R slowest. partial is GPT-NeoX's layout: the first 2R dims form a RoPE of
    dimension 2R, pairs (i, i + R) at b^(-2i/(2R)); the other d - 2R dims pass through."""
    R = math.floor(p * d / 2)
    if variant == "partial":
        return [(i, i + R, BASE ** (-2 * i / (2 * R))) for i in range(R)]
    kept = range(R) if variant == "p_rope" else range(d // 2 - R, d // 2)
    return [(k, k + d // 2, BASE ** (-2 * k / d)) for k in kept]


def oracle_rotate(x, planes, pos):
    """x turned by the block rotation M(t) of the planes, t = pos, one explicit d x d matrix per
    position (tests/helpers.py)."""
    return torch.einsum("tij,bhtj->bhti", plane_rotations(x.shape[-1], planes, pos[0].tolist()),
                        x)


def to_neox(x, p):
    """posbench's half-split layout, pair j = dims (j, j + d/2), moved to GPT-NeoX's rotary_pct
    layout (pair j = dims (j, j + R) in the first 2R dims): a fixed permutation of the head dims,
    which a model with learned q and k maps absorbs into its weights."""
    d = x.shape[-1]
    R = math.floor(p * d / 2)
    rotated = list(range(R)) + [j + d // 2 for j in range(R)]
    free = [j for j in range(d) if j not in rotated]
    return x[..., rotated + free]


@pytest.mark.parametrize("variant", ["p_rope", "reversed"])
@pytest.mark.parametrize("p, d", [(0.75, 64), (0.25, 32), (0.6, 10)])
def test_p_rope_and_reversed_rotate_q_and_k_as_the_definition(variant, p, d):
    q, k = random_qk(d)
    got_q, got_k = make(PRoPE, d, p=p, variant=variant).rotate(q, k, POSITIONS, 0)
    planes = oracle_planes(variant, p, d)
    torch.testing.assert_close(got_q, oracle_rotate(q, planes, POSITIONS), rtol=1e-10, atol=1e-10)
    torch.testing.assert_close(got_k, oracle_rotate(k, planes, POSITIONS), rtol=1e-10, atol=1e-10)


@pytest.mark.parametrize("p, d", [(0.75, 64), (0.25, 32), (0.6, 10), (0.5, 4)])
def test_partial_gives_gpt_neox_rotary_pct_logits_up_to_a_permutation_of_head_dims(p, d):
    q, k = random_qk(d, seed=1)
    got_q, got_k = make(PRoPE, d, p=p, variant="partial").rotate(q, k, POSITIONS, 0)
    planes = oracle_planes("partial", p, d)
    nq = oracle_rotate(to_neox(q, p), planes, POSITIONS)
    nk = oracle_rotate(to_neox(k, p), planes, POSITIONS)
    torch.testing.assert_close(got_q @ got_k.transpose(-2, -1), nq @ nk.transpose(-2, -1),
                               rtol=1e-10, atol=1e-9)
    torch.testing.assert_close(to_neox(got_q, p), nq, rtol=1e-10, atol=1e-10)


@pytest.mark.parametrize("variant", ["reversed", "partial"])
def test_reversed_and_partial_with_p_one_are_rope_bit_for_bit(variant):
    q, k = random_qk(32)
    enc, rope = make(PRoPE, 32, p=1.0, variant=variant), make(RoPE, 32)
    assert torch.equal(enc.inv_freq, rope.inv_freq)
    for got, expected in zip(enc.rotate(q, k, POSITIONS, 0), rope.rotate(q, k, POSITIONS, 0)):
        assert torch.equal(got, expected)


@pytest.mark.parametrize("p, d, R", [(0.75, 64, 24), (0.25, 64, 8), (0.5, 10, 2), (0.1, 16, 0)])
def test_each_variant_rotates_r_pairs_the_fastest_the_slowest_or_a_rescaled_spectrum(p, d, R):
    rope = make(RoPE, d).inv_freq
    freq = {v: make(PRoPE, d, p=p, variant=v).inv_freq for v in ("p_rope", "reversed", "partial")}
    for variant, inv_freq in freq.items():
        assert int((inv_freq > 0).sum()) == R, variant
    assert torch.equal(freq["p_rope"][:R], rope[:R]) and (freq["p_rope"][R:] == 0).all()
    assert torch.equal(freq["reversed"][d // 2 - R:], rope[d // 2 - R:])
    assert (freq["reversed"][:d // 2 - R] == 0).all()
    assert (freq["partial"][R:] == 0).all()
    if R:  # partial spans 1 .. b^(-(R-1)/R): its slowest pair is slower than p_rope's
        assert freq["partial"][0] == 1
        assert math.isclose(freq["partial"][R - 1], BASE ** (-(R - 1) / R), rel_tol=1e-14)
        assert R == 1 or freq["partial"][R - 1] < freq["p_rope"][R - 1]


def test_the_default_variant_is_the_papers_p_rope():
    cfg = posbench.compose(["encoding=p_rope"])
    assert cfg.encoding.variant == "p_rope" and PRoPE.Config().variant == "p_rope"


@pytest.mark.parametrize("variant", ["reversed", "partial"])
def test_each_variant_is_relative_a_shift_of_every_position_changes_no_logit(variant):
    # each variant's evaluation paths against its training path: tests/test_eval_paths.py
    model = tiny_model("encoding.p=0.5", f"encoding.variant={variant}", name="p_rope").double()
    idx = torch.randint(0, 64, (2, 40), generator=torch.Generator().manual_seed(0))
    assert_shift_invariant(model, idx, tol=1e-8)


def test_an_unknown_variant_is_refused_in_one_line():
    with pytest.raises(posbench.ConfigError, match=r"^encoding.variant='revresed' is not accepted; "
                                                  r"expected one of p_rope .*, reversed .*, "
                                                  r"partial .*\)$"):
        posbench.compose(["encoding=p_rope", "encoding.variant=revresed"])


@pytest.mark.parametrize("scaling", ["yarn", "ntk", "dynamic_ntk"])
def test_partial_refuses_the_scalings_that_assume_ropes_full_spectrum(scaling):
    with pytest.raises(posbench.ConfigError, match=rf"^encoding.variant='partial' is not accepted "
                                                  rf"with eval.rope_scaling={scaling}; "):
        posbench.compose(["encoding=p_rope", "encoding.variant=partial",
                          f"eval.rope_scaling={scaling}"])
    posbench.compose(["encoding=p_rope", "encoding.variant=reversed", f"eval.rope_scaling={scaling}"])
    posbench.compose(["encoding=p_rope", "encoding.variant=partial", "eval.rope_scaling=pi"])
