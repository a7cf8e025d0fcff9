"""Defining tests of the one-parameter group family exp(tX) (docs/encodings.md#group-family).

The reference generators here are built from that section's formulas, independently of
posbench/encodings/group.py: X = a I + ⊕_b (I_k ⊗ C(0, -θ_b) + ε N_k ⊗ I_2) in the half-split
layout, where pair p is the coordinates (p, p + d/2).
"""
import dataclasses
import math

import pytest
import scipy.linalg
import torch

import posbench
from posbench.core.errors import ConfigError
from posbench.encodings import Dims, registry
from posbench.encodings.alibi import alibi_slopes
from posbench.encodings.group import GroupConfig, GroupPE, exp_map
from posbench.encodings.rope import apply_rotary, rope_tables

from helpers import assert_shift_invariant

PRESETS = ["decay", "damped_rope", "alibi_as_group", "jordan_real", "jordan_rope",
           "generator_learned"]
TIMES = [-7.5, 0.0, 1.0, 3.2, 100.0]
# (block size k, θ per chain): C_k blocks rotate, J_k blocks (θ = 0) do not
BLOCKS = {"C_2": (2, [0.7, 0.05]), "C_3": (3, [0.9, 0.2]), "C_4": (4, [0.3, 1.1]),
          "J_2": (2, [0.0, 0.0]), "J_3": (3, [0.0, 0.0])}
EPS, DECAY = 0.25, -0.02


def generator(k, theta, eps, a=0.0):
    """Dense X in the half-split layout, straight from the definition; ε: one or one per chain."""
    n = len(theta)
    eps = eps if isinstance(eps, list) else [eps] * n
    d = 2 * n * k
    h = d // 2
    X = a * torch.eye(d, dtype=torch.float64)
    for b, w in enumerate(theta):
        for r in range(k):
            p = b * k + r
            X[p, p + h], X[p + h, p] = w, -w  # C(0, -θ) = [[0, θ], [-θ, 0]] on (x_p, y_p)
            if r < k - 1:  # ε N_k ⊗ I_2: pair p picks up pair p + 1
                X[p, p + 1] = X[p + h, p + 1 + h] = eps[b]
    return X


def closed_form(t, k, theta, eps, a=0.0, transpose=False):
    """exp(tX) (or exp(tX^T)) from the module's closed form, applied to the identity."""
    d = 2 * len(theta) * k
    eye = torch.eye(d, dtype=torch.float64)
    theta = torch.tensor(theta, dtype=torch.float64)
    eps = torch.full_like(theta, eps)
    rows = exp_map(eye, torch.tensor(float(t), dtype=torch.float64), theta, eps, k, transpose)
    return math.exp(a * t) * rows.T  # row i is (exp(tY) e_i)^T


def rel_err(a, b):
    return ((a - b).norm() / b.norm().clamp(min=1.0)).item()


def module(preset, n_head=1, d=16, train_len=128, **changes):
    """GroupPE of a preset for one layer of `n_head` heads of size d."""
    cfg = dataclasses.replace(registry()[preset].config, **changes)
    return GroupPE(cfg, Dims(n_layer=1, n_head=n_head, d_model=n_head * d, train_len=train_len,
                             max_len=4096))


def randomize(enc, std=0.3, seed=0):
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in enc.parameters():
            p.copy_(torch.randn(p.shape, generator=gen) * std)


def map_matrices(enc, t, dtype=torch.float64):
    """F(t) and G(t) per head, (H, d, d), from the module's rotate at position t."""
    d = enc.dims.head_dim
    eye = torch.eye(d, dtype=dtype).view(d, 1, 1, d).expand(d, enc.dims.n_head, 1, d)
    pos = torch.full((d, 1), t, dtype=torch.long)
    q, k = enc.rotate(eye, eye, pos, 0)
    return q[:, :, 0].permute(1, 2, 0), k[:, :, 0].permute(1, 2, 0)  # columns: images of e_i


def build(encoding, *extra, seed=0):
    cfg = posbench.compose([f"encoding={encoding}", "model.n_layer=2", "model.d_model=64",
                            "model.n_head=4", *extra])
    torch.manual_seed(seed)
    return posbench.build_model(cfg, vocab_size=64).eval()


# --- the closed form and the group law (fp64) -------------------------------------------------
@pytest.mark.parametrize("block", BLOCKS)
def test_closed_form_equals_matrix_exp(block):
    k, theta = BLOCKS[block]
    X = generator(k, theta, EPS, DECAY)
    for t in TIMES:
        M = closed_form(t, k, theta, EPS, DECAY)
        assert rel_err(M, torch.linalg.matrix_exp(t * X)) < 1e-10, t
        assert rel_err(M, torch.from_numpy(scipy.linalg.expm(t * X.numpy()))) < 1e-10, t
        Mt = closed_form(t, k, theta, EPS, DECAY, transpose=True)
        assert rel_err(Mt, torch.linalg.matrix_exp(t * X.T)) < 1e-10, t


@pytest.mark.parametrize("block", BLOCKS)
def test_group_law(block):
    k, theta = BLOCKS[block]
    M = {t: closed_form(t, k, theta, EPS, DECAY) for t in TIMES}
    eye = torch.eye(M[0.0].shape[0], dtype=torch.float64)
    assert torch.equal(M[0.0], eye)
    for s in TIMES:
        inverse = closed_form(-s, k, theta, EPS, DECAY)
        assert rel_err(inverse @ M[s], eye) < 1e-10, s  # M(-t) = M(t)^-1
        for t in TIMES:
            scale = M[s].norm() * M[t].norm()
            err = (M[s] @ M[t] - closed_form(s + t, k, theta, EPS, DECAY)).norm() / scale
            assert err < 1e-10, (s, t)


def test_factorization_query_map_transposed_times_key_map_is_exp_of_lag():
    enc = module("generator_learned", n_head=2, d=8)
    randomize(enc)  # per-head θ and ε differ from the preset's
    theta, eps = enc.frequencies(), enc.shears()
    for i in (0, 5, 37, 1000):
        F, _ = map_matrices(enc, i)
        for j in (0, 3, 37, 999):
            _, G = map_matrices(enc, j)
            for h in range(2):
                X = generator(2, theta[h].tolist(), eps[h].tolist())
                expected = torch.linalg.matrix_exp((i - j) * X)
                assert rel_err(F[h].T @ G[h], expected) < 1e-10, (i, j, h)


def test_query_and_key_maps_differ_unless_the_generator_is_skew():
    F, G = map_matrices(module("jordan_rope"), 50)
    assert (F - G).abs().max() > 0.1
    F, G = map_matrices(module("jordan_rope", block_size=1), 50)
    torch.testing.assert_close(F, G, rtol=0, atol=1e-12)


# --- the exotic class ------------------------------------------------------------------------
@pytest.mark.parametrize("block", BLOCKS)
def test_generator_of_the_closed_form_is_defective(block):
    k, theta = BLOCKS[block]
    h = 1e-4  # central difference recovers X from the module's exp(tX) to O(h^2)
    X = (closed_form(h, k, theta, EPS, DECAY) - closed_form(-h, k, theta, EPS, DECAY)) / (2 * h)
    assert rel_err(X, generator(k, theta, EPS, DECAY)) < 1e-7
    shear = X - generator(k, theta, 0.0, DECAY)  # X - λI with λI = I_k ⊗ C(a, ω) on each block
    assert torch.linalg.matrix_power(shear, k - 1).abs().max() > 0.5 * EPS ** (k - 1)
    assert torch.linalg.matrix_power(shear, k).abs().max() < 1e-7


@pytest.mark.parametrize("block", BLOCKS)
def test_not_norm_preserving_and_norm_grows_like_t_to_the_k_minus_1(block):
    k, theta = BLOCKS[block]
    norms = {t: torch.linalg.matrix_norm(closed_form(t, k, theta, 1.0), ord=2).item()
             for t in (1.0, 1e3, 1e4)}
    assert norms[1.0] > 1.2  # some unit vector is stretched
    slope = math.log(norms[1e4] / norms[1e3]) / math.log(10)
    assert slope == pytest.approx(k - 1, abs=0.01)
    assert norms[1e4] / 1e4 ** (k - 1) == pytest.approx(1 / math.factorial(k - 1), rel=0.01)


def lag_profile(k, lags):
    """ℓ(Δ) = q̃_i · k̃_j with content fixed, a = ω = 0, from the module's rotate (fp64)."""
    enc = module("jordan_real", d=4 * k, block_size=k, chains=None)
    gen = torch.Generator().manual_seed(1)
    q, key = torch.randn(2, 1, 1, 1, 4 * k, dtype=torch.float64, generator=gen)
    i = 60
    out = []
    for lag in lags:
        pos = torch.tensor([[i, i - lag]])
        qt, kt = enc.rotate(torch.cat((q, q), 2), torch.cat((key, key), 2), pos, 0)
        out.append((qt[0, 0, 0] * kt[0, 0, 1]).sum())
    return torch.stack(out)


def test_polynomial_signature_degree_k_minus_1():
    lags = list(range(0, 40))
    two, three = lag_profile(2, lags), lag_profile(3, lags)
    scale = three.abs().max()
    assert two.diff(n=1).abs().max() > 1e-3  # linear in Δ, not constant
    assert two.diff(n=2).abs().max() < 1e-12 * scale
    assert three.diff(n=2).abs().max() > 1e-6  # quadratic, not linear
    assert three.diff(n=3).abs().max() < 1e-12 * scale


def test_orthogonal_case_preserves_norm_in_fp32():
    torch.manual_seed(0)
    x = torch.randn(2, 4, 50, 32)
    pos = (torch.arange(50) * 997).expand(2, 50)
    q, k = module("jordan_rope", n_head=4, d=32, block_size=1).rotate(x, x, pos, 0)
    torch.testing.assert_close(q.norm(dim=-1), x.norm(dim=-1), rtol=1e-6, atol=0)
    torch.testing.assert_close(k.norm(dim=-1), x.norm(dim=-1), rtol=1e-6, atol=0)
    q, _ = module("jordan_rope", n_head=4, d=32).rotate(x, x, pos, 0)
    assert (q.norm(dim=-1) / x.norm(dim=-1) - 1).abs().max() > 0.1  # C_2 blocks are not


# --- reductions and the ALiBi corner (whole model) ---------------------------------------------
def test_single_pair_blocks_reproduce_rope_bit_for_bit():
    idx = torch.randint(0, 64, (2, 40), generator=torch.Generator().manual_seed(0))
    group = build("jordan_rope", "encoding.block_size=1")
    rope = build("rope")
    assert group.encoding.score_mod is None  # same fused path as RoPE
    assert torch.equal(group(idx), rope(idx))
    pos = torch.arange(40) + 12345
    torch.testing.assert_close(group(idx, pos=pos), rope(idx, pos=pos), rtol=0, atol=1e-6)


def test_zero_generator_reproduces_nope():
    idx = torch.randint(0, 64, (2, 40), generator=torch.Generator().manual_seed(0))
    group = build("jordan_rope", "encoding.block_size=1", "encoding.frequencies=none")
    assert group.encoding.rotate is None and group.encoding.score_mod is None
    assert torch.equal(group(idx), build("nope")(idx))


def test_alibi_as_group_bias_is_the_nilpotent_block_on_augmented_coordinates():
    enc = module("alibi_as_group", n_head=8)
    T = 30
    pos = torch.arange(T).expand(1, T)
    lag = torch.arange(T).view(T, 1) - torch.arange(T).view(1, T)
    b, h = torch.zeros(1, 1, 1, 1, dtype=torch.long), torch.arange(8).view(1, 8, 1, 1)
    i, j = torch.arange(T).view(1, 1, T, 1), torch.arange(T).view(1, 1, 1, T)
    bias = enc.score_mod(None, None, pos, 0)(torch.zeros(1, 8, T, T), b, h, i, j)
    N = torch.tensor([[0.0, 1.0], [0.0, 0.0]], dtype=torch.float64)
    q_bar = torch.tensor([1.0, 0.0], dtype=torch.float64)
    for h, m in enumerate(alibi_slopes(8)):
        k_bar = torch.tensor([0.0, -m], dtype=torch.float64)
        expected = torch.stack([q_bar @ torch.linalg.matrix_exp(float(d) * N) @ k_bar
                                for d in range(-T + 1, T)])[lag + T - 1]
        torch.testing.assert_close(bias[0, h].double(), expected, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("n_head", [8, 12])
def test_alibi_as_group_logits_equal_alibi(n_head):
    shape = [f"model.n_head={n_head}", f"model.d_model={8 * n_head}"]
    group, alibi = build("alibi_as_group", *shape, seed=1), build("alibi", *shape, seed=2)
    group.load_state_dict(alibi.state_dict(), strict=False)
    idx = torch.randint(0, 64, (2, 50), generator=torch.Generator().manual_seed(0))
    for pos in (None, torch.arange(50) + 300):
        expected = alibi(idx, pos=pos)
        torch.testing.assert_close(group(idx, pos=pos), expected, rtol=0, atol=1e-6)
    assert (build("nope", *shape, seed=2)(idx) - expected).abs().max() > 1e-4  # ALiBi matters


# --- the fast path against the reference path -------------------------------------------------
def reference_logits(enc, q, k, rows):
    """The reference path for the query `rows` of one head, in float64:
    ℓ = Σ_r (Δ^r / r!) e^{aΔ} ⊙ S_r with S_r the RoPE scores (rope.py) of q against the keys
    shifted along each chain by (ε_b N)^r."""
    size, d, T = enc.cfg.block_size, q.shape[-1], q.shape[0]
    theta, eps = enc.frequencies()[0], enc.shears()[0]
    m = theta.shape[0] * size  # pairs under the generator; the rest are NoPE
    inv_freq = torch.cat((theta.repeat_interleave(size), theta.new_zeros(d // 2 - m)))
    cos, sin = rope_tables(torch.arange(T).view(1, T), inv_freq, torch.float64)
    rope_q = apply_rotary(q.view(1, 1, T, d), cos, sin)[0, 0, rows]
    lag = (torch.arange(T)[rows].view(-1, 1) - torch.arange(T).view(1, -1)).double()
    halves = k.view(T, 2, d // 2)[..., :m].reshape(T, 2, -1, size)
    out = torch.zeros(rope_q.shape[0], T, dtype=torch.float64)
    for r in range(size):
        shifted = torch.nn.functional.pad(halves[..., r:], (0, r)) * eps.view(-1, 1) ** r
        keys = torch.nn.functional.pad(shifted.reshape(T, 2, m), (0, d // 2 - m)).reshape(T, d)
        rope_k = apply_rotary(keys.view(1, 1, T, d), cos, sin)[0, 0]
        out += lag ** r / math.factorial(r) * (rope_q @ rope_k.T)
    rates = enc.decay_rates()
    if rates is not None:
        out *= torch.exp(rates[0].double() * lag.clamp(min=0))
    return out / math.sqrt(d), lag


@pytest.mark.parametrize("preset,changes", [("jordan_rope", {}),
                                            ("jordan_rope", {"decay": "retnet"}),
                                            ("generator_learned", {}),
                                            ("jordan_rope", {"block_size": 3, "train_len": 1024})])
def test_fast_path_equals_reference_path_at_4096(preset, changes):
    T, d = 4096, 12 if changes.get("block_size") == 3 else 16
    enc = module(preset, d=d, **changes)
    randomize(enc)
    gen = torch.Generator().manual_seed(0)
    q, k = torch.randn(2, T, d, dtype=torch.float64, generator=gen)
    pos = torch.arange(T).view(1, T)
    qt, kt = enc.rotate(q.float().view(1, 1, T, d), k.float().view(1, 1, T, d), pos, 0)
    rows = torch.arange(T - 1, -1, -8)  # every 8th query, the last included, against all keys
    fast = (qt[0, 0, rows] @ kt[0, 0].T / math.sqrt(d)).view(1, 1, -1, T)
    if enc.score_mod is not None:
        zero = torch.zeros(1, 1, 1, 1, dtype=torch.long)
        fast = enc.score_mod(None, None, pos, 0)(fast, zero, zero, rows.view(1, 1, -1, 1),
                                                 torch.arange(T).view(1, 1, 1, T))
    ref, lag = reference_logits(enc, q, k, rows)
    causal = lag >= 0
    err = (fast[0, 0].double() - ref).abs() / ref.abs().clamp(min=1.0)
    assert err[causal].max() < 1e-4


def tf32(x):
    """x (fp32) with its mantissa cut to TF32's 10 bits, as a tensor core reads an fp32 operand
    (truncation: the larger of its two roundings' errors)."""
    return (x.contiguous().view(torch.int32) & ~0x1FFF).view(torch.float32)


def test_tf32_costs_the_sheared_logits_a_fifth_of_bf16s_error():
    """On CUDA with TF32 allowed (training allows it) FlexAttention and fp32 matmuls read the
    sheared q and k at TF32's precision: docs/encodings.md#group-family gives these errors. The
    last query of 8192 at L = 128 against every key, one head of 64 of jordan_rope (C_2 blocks,
    as generator_learned's), against the float64 reference."""
    T, d = 8192, 64
    enc = module("jordan_rope", d=d)
    gen = torch.Generator().manual_seed(0)
    q, k = torch.randn(2, T, d, dtype=torch.float64, generator=gen)
    qt, kt = enc.rotate(q.float().view(1, 1, T, d), k.float().view(1, 1, T, d),
                        torch.arange(T).view(1, T), 0)
    rows = torch.tensor([T - 1])
    ref, _ = reference_logits(enc, q, k, rows)
    errors = {}
    for name, cast in (("fp32", lambda x: x), ("tf32", tf32),
                       ("bf16", lambda x: x.bfloat16().float())):
        logits = cast(qt[0, 0, rows]).double() @ cast(kt[0, 0]).double().T / math.sqrt(d)
        errors[name] = (logits - ref).abs().max().item()
    assert errors["fp32"] < 0.01 and errors["tf32"] < 0.25 < errors["bf16"], errors
    assert errors["tf32"] < errors["bf16"] / 3, errors


# --- the whole model: SHIFT and large offsets ---------------------------------------------------
def sharpened(encoding, *extra):
    """The model with larger q/k weights, so that attention, and so position, moves the logits."""
    model = build(encoding, *extra)
    randomize(model.encoding, std=0.2)
    with torch.no_grad():
        for block in model.blocks:
            block.attn.qkv.weight[: 2 * 64] *= 15
    return model


@pytest.mark.parametrize("preset", PRESETS)
def test_shift_invariance_of_the_whole_model(preset):
    model = sharpened(preset)
    idx = torch.randint(0, 64, (2, 40), generator=torch.Generator().manual_seed(0))
    base = assert_shift_invariant(model, idx)
    with torch.no_grad():
        stretched = model(idx, pos=2 * torch.arange(40))  # every lag doubled: not a shift
    assert (stretched - base).abs().max() > 1e-3


@pytest.mark.parametrize("preset", PRESETS)
def test_finite_logits_and_gradients_at_offset_65536(preset):
    model = sharpened(preset)
    model.train()
    idx = torch.randint(0, 64, (2, 40), generator=torch.Generator().manual_seed(0))
    logits = model(idx, pos=torch.arange(40) + 65536)
    assert torch.isfinite(logits).all()
    logits.logsumexp(-1).mean().backward()
    assert all(torch.isfinite(p.grad).all() for p in model.parameters() if p.grad is not None)
    with torch.no_grad():  # the fp32 error of the shear terms stays small at εt = 512
        base = model(idx)
    assert ((logits.detach() - base).abs() <= 1e-3 * base.abs().clamp(min=1.0)).all()


def test_learned_decay_gradient_is_finite_where_future_factors_would_overflow():
    enc = module("generator_learned")
    T = 3000  # |a_0| T > 88: e^{-aΔ} on the masked future lags would overflow fp32
    pos = torch.arange(T).view(1, T)
    i, j = torch.arange(T).view(1, 1, T, 1), torch.arange(T).view(1, 1, 1, T)
    zero = torch.zeros(1, 1, 1, 1, dtype=torch.long)
    scores = enc.score_mod(None, None, pos, 0)(torch.ones(1, 1, T, T), zero, zero, i, j)
    probs = torch.softmax(scores.masked_fill(j > i, float("-inf")), dim=-1)
    (probs * (i - j).clamp(min=0)).sum().backward()
    assert torch.isfinite(enc.decay_shift.grad).all() and enc.decay_shift.grad.abs().sum() > 0


# --- presets and config checks -----------------------------------------------------------------
def test_presets_are_registered_with_their_spec_defaults():
    entries = registry()
    for name in PRESETS:
        entry = entries[name]
        assert entry.cls is GroupPE and isinstance(entry.config, GroupConfig)
        assert entry.cls.family == "group" and entry.cls.relative
    for text in (GroupPE.past_train_len, GroupPE.reference):
        assert text and "\n" not in text
    d, L = 32, 128
    jordan = module("jordan_rope", n_head=4, d=d, train_len=L)
    p = torch.arange(d // 4, dtype=torch.float64)
    torch.testing.assert_close(jordan.frequencies()[0], 10000.0 ** (-2 * p / (d / 2)))
    torch.testing.assert_close(jordan.shears(), torch.full((1, d // 4), 1 / L, dtype=torch.float64))
    assert jordan.decay_rates() is None and jordan.score_mod is None
    damped = module("damped_rope", n_head=4, d=d)
    expected = [math.log(1 - 2.0 ** (-5 - h)) for h in range(4)]
    assert damped.decay_rates().tolist() == pytest.approx(expected, rel=1e-6)
    torch.testing.assert_close(damped.frequencies()[0],
                               10000.0 ** -torch.linspace(0, 1, d // 2, dtype=torch.float64))
    assert module("decay", n_head=4).rotate is None
    assert module("alibi_as_group", n_head=4).rotate is None
    learned = module("generator_learned", n_head=4)
    assert {n for n, _ in learned.named_parameters()} == {"frequency_shift", "shear_shift",
                                                           "decay_shift"}
    randomize(learned, std=5.0)
    assert (learned.decay_rates() <= 0).all()


def test_learned_generator_parameters_receive_gradients():
    model = build("generator_learned")
    model.train()
    idx = torch.randint(0, 64, (2, 40), generator=torch.Generator().manual_seed(0))
    model(idx).logsumexp(-1).mean().backward()
    for name, p in model.encoding.named_parameters():
        assert p.grad is not None and p.grad.abs().sum() > 0, name


@pytest.mark.parametrize("overrides,key", [
    (["encoding=jordan_rope", "encoding.block_size=3"], "encoding.block_size=3"),
    (["encoding=jordan_rope", "encoding.block_size=0"], "encoding.block_size=0"),
    (["encoding=jordan_real", "encoding.chains=9"], "encoding.chains=9"),
    (["encoding=decay", "encoding.decay=growth"], "encoding.decay='growth'"),
    (["encoding=jordan_rope", "encoding.frequencies=linear"], "encoding.frequencies='linear'"),
    (["encoding=jordan_rope", "encoding.base=1.0"], "encoding.base=1.0"),
    (["encoding=jordan_real", "encoding.learn_frequencies=true"],
     "encoding.learn_frequencies=True"),
    (["encoding=damped_rope", "encoding.learn_shear=true"], "encoding.learn_shear=True"),
    (["encoding=jordan_rope", "model.d_model=132"], "model.d_model/model.n_head=33"),
])
def test_out_of_range_values_are_rejected_in_one_line(overrides, key):
    with pytest.raises(ConfigError) as err:
        posbench.compose(overrides)
    message = str(err.value)
    assert message.startswith(key) and "expected" in message and "\n" not in message


def test_decay_needs_no_pairs():
    cfg = posbench.compose(["encoding=decay", "model.d_model=132"])  # head dim 33 is fine here
    assert posbench.build_model(cfg, vocab_size=64).encoding.rotate is None
