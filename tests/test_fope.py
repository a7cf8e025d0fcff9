"""FoPE (docs/encodings.md, `fope`), Hua et al. 2025: pair m of each head is multiplied by
w(t) = Σ_k A[k, m] cos(ω_k t) + i Σ_k B[k, m] sin(ω_k t) over the frequencies ω_k that turn
within L, queries and keys alike; the pairs past them carry no position. The rotation is checked
against a float64 oracle built here from that formula (Python floats for the frequencies and
their cosines, a d x d matrix per head and position), forward and gradients, at positions up to
16L."""
import argparse
import math

import pytest
import torch

import posbench
from posbench.encodings import Dims
from posbench.encodings.fope import FoPE
from posbench.encodings.hope import HoPE
from posbench.encodings.rope import RoPE, rope_tables
from posbench.runs.train import make_optimizer

from helpers import finite_at_16l, tiny_model

F64 = torch.float64
HEADS, LAYERS = 3, 2


def make(cls, head_dim, train_len, original_len=None, n_head=HEADS, n_layer=LAYERS, **options):
    return cls(cls.Config(name=cls.__name__.lower(), **options),
               Dims(n_layer, n_head, head_dim * n_head, train_len, 16 * train_len,
                    original_len=original_len))


def positions(L):
    return torch.tensor([[0, 1, 7, L - 1, L, 5 * L + 3, 16 * L - 1, 16 * L]])


def random_qk(d, T, seed=0):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(2, HEADS, T, d, generator=g, dtype=F64),
            torch.randn(2, HEADS, T, d, generator=g, dtype=F64))


def oracle_frequencies(d, L, base, clip=True):
    """ω_k = b^(-2k/d) of every pair k, kept when it completes a turn within L tokens."""
    omegas = [base ** (-2 * k / d) for k in range(d // 2)]
    return [w for w in omegas if 2 * math.pi / w <= L] if clip else omegas


def oracle_maps(d, L, base, A, B, pos, clip=True, free_sin=1.0):
    """M (H, T, d, d) per head and position: pair m (dims m, m + d/2) multiplied by c + i s,
    c = Σ_k A[h, k, m] cos(ω_k t) and s = Σ_k B[h, k, m] sin(ω_k t) for m < K; c = 1, s = free_sin
    on the other pairs."""
    omegas, half = oracle_frequencies(d, L, base, clip), d // 2
    K = len(omegas)
    cos = torch.tensor([[math.cos(t * w) for w in omegas] for t in pos], dtype=F64)
    sin = torch.tensor([[math.sin(t * w) for w in omegas] for t in pos], dtype=F64)
    c = torch.einsum("tk,hkm->htm", cos, A)
    s = torch.einsum("tk,hkm->htm", sin, B)
    H, T = A.shape[0], len(pos)
    c = torch.cat((c, torch.ones(H, T, half - K, dtype=F64)), -1)
    s = torch.cat((s, torch.full((H, T, half - K), free_sin, dtype=F64)), -1)
    P_cos, P_sin = torch.zeros(half, d, d, dtype=F64), torch.zeros(half, d, d, dtype=F64)
    for m in range(half):
        a, b = m, m + half
        P_cos[m, a, a] = P_cos[m, b, b] = 1  # [[c, -s], [s, c]] on (x_a, x_b)
        P_sin[m, b, a], P_sin[m, a, b] = 1, -1
    return torch.einsum("htm,mij->htij", c, P_cos) + torch.einsum("htm,mij->htij", s, P_sin)


@pytest.mark.parametrize("d, L, base, options", [
    (64, 512, 1e4, {}),  # the authors' 60M head at their L = 512: 16 of 32 frequencies kept
    (32, 128, 1e4, {"free_pairs": "zero_frequency"}),
    (16, 100, 500.0, {"sigma": 0.6}),
    (10, 64, 10.0, {"clip": False}),
])
def test_maps_q_and_k_as_the_formula_up_to_16l_forward_and_gradients(d, L, base, options):
    enc = make(FoPE, d, L, base=base, learnable=True, **options).double()
    layer, pos = 1, positions(L)
    q, k = random_qk(d, pos.shape[1])
    q.requires_grad_(True), k.requires_grad_(True)
    A, B = (enc.cos_coef[layer].detach().clone().requires_grad_(True),
            enc.sin_coef[layer].detach().clone().requires_grad_(True))
    free_sin = 0.0 if options.get("free_pairs") == "zero_frequency" else 1.0
    M = oracle_maps(d, L, base, A, B, pos[0].tolist(), options.get("clip", True), free_sin)
    expected = [torch.einsum("htij,bhtj->bhti", M, x) for x in (q, k)]
    got = enc.rotate(q, k, pos, layer)
    for g, e in zip(got, expected):
        torch.testing.assert_close(g, e, rtol=1e-10, atol=1e-10)
    gen = torch.Generator().manual_seed(1)
    weights = [torch.randn(x.shape, generator=gen, dtype=F64) for x in got]

    def grads(outputs, coefs):
        loss = sum((o * w).sum() for o, w in zip(outputs, weights))
        return torch.autograd.grad(loss, [q, k, *coefs])

    got_grads = grads(got, [enc.cos_coef, enc.sin_coef])
    expected_grads = grads(expected, [A, B])
    for g, e in zip(got_grads[:2], expected_grads[:2]):
        torch.testing.assert_close(g, e, rtol=1e-10, atol=1e-10)
    for g, e in zip(got_grads[2:], expected_grads[2:]):  # only the layer used has a gradient
        torch.testing.assert_close(g[layer], e, rtol=1e-10, atol=1e-10)
        assert (g[1 - layer] == 0).all()


def test_the_authors_60m_head_at_l_512_keeps_16_frequencies_and_the_coefficients_are_per_head():
    enc = make(FoPE, 64, 512, n_head=8, n_layer=8)
    assert enc.kept == 16 and len(oracle_frequencies(64, 512, 1e4)) == 16
    assert enc.cos_coef.shape == enc.sin_coef.shape == (8, 8, 16, 16)
    assert make(FoPE, 32, 128).kept == 6  # HoPE's worked example: wavelengths 6.3 ... 111.7


def test_identity_coefficients_without_the_clip_are_rope_bit_for_bit():
    pos = positions(128)
    q, k = random_qk(32, pos.shape[1])
    fope, rope = make(FoPE, 32, 128, sigma=0.0, clip=False), make(RoPE, 32, 128)
    assert torch.equal(fope.cos_coef, torch.eye(16).expand(LAYERS, HEADS, 16, 16))
    for got, expected in zip(fope.rotate(q, k, pos, 1), rope.rotate(q, k, pos, 1)):
        assert torch.equal(got, expected)


def test_identity_coefficients_with_the_clip_are_hope_and_the_references_pad_doubles_free_pairs():
    pos = positions(128)
    q, k = random_qk(32, pos.shape[1])
    hope = make(HoPE, 32, 128).rotate(q, k, pos, 0)
    zero = make(FoPE, 32, 128, sigma=0.0, free_pairs="zero_frequency").rotate(q, k, pos, 0)
    for got, expected in zip(zero, hope):
        assert torch.equal(got, expected)
    padded = make(FoPE, 32, 128, sigma=0.0).rotate(q, k, pos, 0)
    kept = torch.cat((torch.arange(6), torch.arange(6) + 16))
    a, b = torch.arange(6, 16), torch.arange(22, 32)  # the free pairs' two coordinates
    for got, x, expected in zip(padded, (q, k), hope):
        assert torch.equal(got[..., kept], expected[..., kept])
        torch.testing.assert_close(got[..., a], x[..., a] - x[..., b], rtol=0, atol=0)
        torch.testing.assert_close(got[..., b], x[..., a] + x[..., b], rtol=0, atol=0)
    # turned by π/4 and scaled by √2 alike: the free pairs' share of q·k is doubled
    free = torch.cat((a, b))
    torch.testing.assert_close((padded[0][..., free] * padded[1][..., free]).sum(-1),
                               2 * (q[..., free] * k[..., free]).sum(-1), rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("free_pairs", ["reference", "zero_frequency"])
def test_dropped_frequencies_leave_their_pairs_position_free(free_pairs):
    T = 64
    pos = torch.arange(T).unsqueeze(0) * 97
    x = torch.randn(1, HEADS, 1, 32, dtype=F64).expand(2, HEADS, T, 32)
    got_q, got_k = make(FoPE, 32, 128, free_pairs=free_pairs).rotate(x, x, pos, 0)
    free = torch.cat((torch.arange(6, 16), torch.arange(22, 32)))
    for got in (got_q, got_k):  # the same vector at every position maps to one vector there
        assert torch.equal(got[..., free], got[..., :1, free].expand_as(got[..., free]))
        assert not torch.allclose(got[..., :6], got[..., :1, :6].expand_as(got[..., :6]))


def test_logits_depend_on_both_positions_once_mixed_and_on_the_lag_alone_at_identity():
    pos = torch.arange(40).unsqueeze(0)
    q, k = random_qk(32, 40)

    def logits(enc, shift):
        q2, k2 = enc.rotate(q, k, pos + shift, 0)
        return q2 @ k2.transpose(-2, -1)

    mixed, identity = make(FoPE, 32, 128), make(FoPE, 32, 128, sigma=0.0)
    for shift in (1, 17, 1000):
        assert (logits(mixed, shift) - logits(mixed, 0)).abs().max() > 1e-2
        torch.testing.assert_close(logits(identity, shift), logits(identity, 0), rtol=1e-10,
                                   atol=1e-10)


def test_init_is_identity_plus_xavier_noise_apart_for_cos_sin_layer_and_head():
    torch.manual_seed(0)
    enc = make(FoPE, 64, 512, n_head=8, n_layer=4)  # K = 16: 4·8·256 draws of each
    std = 0.3 * math.sqrt(2 / (16 * 16 + 8 * 16))  # xavier_normal_ of (H, K, K), gain 0.3
    noise = [c - torch.eye(16) for c in (enc.cos_coef, enc.sin_coef)]
    for n in noise:
        assert abs(n.std().item() / std - 1) < 0.05 and abs(n.mean().item()) < 0.05 * std
    assert not torch.equal(noise[0], noise[1])
    assert not torch.equal(noise[0][0], noise[0][1]) and not torch.equal(noise[0][0, 0],
                                                                          noise[0][0, 1])


def test_fixed_coefficients_are_saved_buffers_and_learnable_ones_position_parameters():
    fixed = tiny_model(name="fope")
    assert not list(fixed.encoding.parameters())
    assert {"encoding.cos_coef", "encoding.sin_coef"} <= set(fixed.state_dict())
    model = tiny_model("encoding.learnable=true", name="fope")
    coefs = {id(model.encoding.cos_coef), id(model.encoding.sin_coef)}
    optimizer = make_optimizer(model, argparse.Namespace(lr=1e-3, weight_decay=0.1,
                                                          position_lr_mult=10.0),
                               torch.device("cpu"))
    (group,) = [g for g in optimizer.param_groups if coefs & {id(p) for p in g["params"]}]
    assert {id(p) for p in group["params"]} == coefs
    assert group["weight_decay"] == 0.0 and group["lr_mult"] == 10.0


def test_pi_scaling_divides_the_kept_frequencies_and_keeps_the_coefficients():
    torch.manual_seed(0)
    plain = make(FoPE, 32, 128)
    scaled = make(FoPE, 32, 128)
    scaled.load_state_dict(plain.state_dict())
    scaled.set_eval_options("pi", None, 4.0)
    pos = positions(128)
    for got, expected in zip(scaled.tables(4 * pos, 1, 512, F64), plain.tables(pos, 1, 512, F64)):
        torch.testing.assert_close(got, expected, rtol=1e-9, atol=1e-9)


@pytest.mark.parametrize("scaling", ["ntk", "yarn"])
def test_identity_coefficients_are_hope_under_ntk_and_yarn_its_factor_on_every_pair(scaling):
    fope = make(FoPE, 32, 128, sigma=0.0, free_pairs="zero_frequency")
    hope = make(HoPE, 32, 128)
    for enc in (fope, hope):
        enc.set_eval_options(scaling, None, 4.0)
    pos = positions(128)
    expected = rope_tables(pos, *hope.frequencies(512)[:1], F64, hope.frequencies(512)[1])
    for got, e in zip(fope.tables(pos, 0, 512, F64), expected):
        torch.testing.assert_close(got, e.expand_as(got), rtol=1e-12, atol=1e-12)
    if scaling == "yarn":  # the position-free pairs carry the factor too: cos = 0.1 ln 4 + 1
        torch.testing.assert_close(fope.tables(pos, 0, 512, F64)[0][..., 6:16],
                                   torch.full((1, HEADS, 8, 10), 0.1 * math.log(4) + 1, dtype=F64))


def test_an_extension_keeps_the_frequencies_of_the_first_runs_length():
    assert make(FoPE, 32, 512, original_len=128).kept == 6 and make(FoPE, 32, 512).kept == 8


def test_builds_on_the_meta_device_as_the_estimate_sizes_a_model():
    with torch.device("meta"):
        enc = make(FoPE, 32, 128)
    assert enc.kept == 6 and enc.cos_coef.is_meta


def test_causal_future_tokens_change_nothing_before_them():
    model = tiny_model("train.seq_len=32", "eval.lengths=[48]", name="fope").double()
    idx = torch.randint(0, 64, (1, 48), generator=torch.Generator().manual_seed(2))
    changed = idx.clone()
    changed[0, 30] = (idx[0, 30] + 1) % 64
    with torch.no_grad():
        a, b = model(idx), model(changed)
    torch.testing.assert_close(a[:, :30], b[:, :30], rtol=1e-12, atol=1e-12)
    assert not torch.allclose(a[:, 30:], b[:, 30:])


@pytest.mark.parametrize("extra", [(), ("encoding.free_pairs=zero_frequency",
                                        "encoding.learnable=true")])
def test_finite_logits_at_16l_on_model_tiny(extra):
    assert finite_at_16l("encoding=fope", *extra)


def test_defaults_and_refusals():
    cfg = posbench.compose(["encoding=fope"])
    assert dict(cfg.encoding) == {"name": "fope", "base": 1e4, "sigma": 0.3, "clip": True,
                                  "learnable": False, "free_pairs": "reference"}
    for scaling in ("pi", "ntk", "dynamic_ntk", "yarn"):
        posbench.compose(["encoding=fope", f"eval.rope_scaling={scaling}"])
    for override, message in [
            ("encoding.sigma=-0.1", r"^encoding.sigma=-0.1 is not accepted; expected a number "
                                    r">= 0"),
            ("encoding.free_pairs=one", r"^encoding.free_pairs='one' is not accepted; expected "
                                        r"reference \(.*\) or zero_frequency \(.*\)$"),
            ("encoding.base=1", r"^encoding.base=1.0 is not accepted; "),
            ("eval.rope_scaling=rerope", r"^eval.rope_scaling='rerope' is not accepted; ")]:
        with pytest.raises(posbench.ConfigError, match=message) as err:
            posbench.compose(["encoding=fope", override])
        assert "\n" not in str(err.value)
