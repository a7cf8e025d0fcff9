"""Eval-time options without retraining (docs/encodings.md, "Eval-time options"): PI, NTK, HF's
dynamic NTK and YaRN on the rotary encodings, static or dynamic scale, the log-n temperature on
any encoding; how evaluate() and `posbench eval` apply them. Every formula is checked against an
oracle written here from the reference's definition, in float64."""
import json
import math

import pytest
import torch
import torch.nn.functional as F
from omegaconf import OmegaConf

import posbench
from posbench.attention.paths import CausalSelfAttention
from posbench.encodings import Dims
from posbench.encodings.nope import NoPE
from posbench.encodings.p_rope import PRoPE
from posbench.encodings.rope import (RoPE, apply_rotary, llama3_inv_freq, rope_inv_freq,
                                     rope_tables)
from posbench.encodings.xpos import XPos
from posbench.evaluations.perplexity import evaluate
from posbench.attention.temperature import temperature_factor
from helpers import posbench_cli

F64 = torch.float64
D, L, BASE = 64, 512, 1e4
SCALINGS = ("pi", "ntk", "dynamic_ntk", "yarn", "llama3")


def rope(scaling="none", factor=None, cls=RoPE, head_dim=D, train_len=L, base=BASE, **options):
    enc = cls(cls.Config(name="rope", base=base, **options),
              Dims(1, 1, head_dim, train_len, 8 * train_len))
    enc.set_eval_options(scaling, rope_scaling_factor=factor)
    return enc


def theta(base=BASE, d=D):
    return base ** (-torch.arange(0, d, 2, dtype=F64) / d)


def reference_yarn(d, base, train_len, s, beta_fast=32, beta_slow=1):
    """HF's _compute_yarn_parameters and jquesnelle/yarn's LlamaYaRNScaledRotaryEmbedding.yarn,
    one pair at a time in Python floats: (inv_freq, attention factor, extrapolation weights)."""
    def correction_dim(turns):  # the pair index that turns `turns` times in train_len tokens
        return d * math.log(train_len / (turns * 2 * math.pi)) / (2 * math.log(base))

    low = max(math.floor(correction_dim(beta_fast)), 0)
    high = min(math.ceil(correction_dim(beta_slow)), d - 1)
    if low == high:
        high += 0.001
    inv_freq, extrapolation = [], []
    for pair in range(d // 2):
        ramp = min(1.0, max(0.0, (pair - low) / (high - low)))
        w = 1 - ramp  # HF's inv_freq_extrapolation_factor
        extrapolated = 1 / base ** (2 * pair / d)
        interpolated = 1 / (s * base ** (2 * pair / d))
        inv_freq.append(interpolated * (1 - w) + extrapolated * w)
        extrapolation.append(w)
    return torch.tensor(inv_freq, dtype=F64), 0.1 * math.log(s) + 1, extrapolation


def hf_dynamic_ntk(d, base, train_len, n, alpha):
    """HF's _compute_dynamic_ntk_parameters (its `factor` is alpha)."""
    n = max(n, train_len)
    b = base * ((alpha * n / train_len) - (alpha - 1)) ** (d / (d - 2))
    return torch.tensor([1 / b ** (2 * i / d) for i in range(d // 2)], dtype=F64)


def scores(enc, q, k, pos):
    q, k = enc.rotate(q, k, pos, 0)
    return q @ k.transpose(-2, -1)


# --- the scale s: static or dynamic --------------------------------------------------------------
def test_dynamic_scale_is_n_over_l_past_l_and_1_up_to_it():
    for scaling in ("pi", "ntk", "yarn", "llama3"):
        enc = rope(scaling)
        assert [enc.scale(n) for n in (1, L // 2, L, L + 1, 4 * L)] == [1, 1, 1, (L + 1) / L, 4]


def test_static_scale_is_the_factor_at_every_length():
    for scaling in ("pi", "ntk", "yarn", "llama3"):
        enc = rope(scaling, factor=4.0)
        assert [enc.scale(n) for n in (1, L, 2 * L, 16 * L)] == [4.0] * 4


def test_static_factor_changes_rope_at_and_below_the_training_length_dynamic_does_not():
    x = torch.randn(1, 2, L, D, generator=torch.Generator().manual_seed(0))
    pos = torch.arange(L).unsqueeze(0)
    plain = rope().rotate(x, x, pos, 0)[0]
    for scaling in SCALINGS:
        for n in (L // 2, L):
            dynamic = rope(scaling).rotate(x[:, :, :n], x[:, :, :n], pos[:, :n], 0)[0]
            assert torch.equal(dynamic, plain[:, :, :n]), (scaling, n)
        assert not torch.equal(rope(scaling).frequencies(L + 1)[0], theta()), scaling
    for scaling in ("pi", "ntk", "yarn", "llama3"):
        static = rope(scaling, factor=2.0).rotate(x, x, pos, 0)[0]
        assert not torch.allclose(static[:, :, 1:], plain[:, :, 1:], atol=1e-3), scaling


def test_static_and_dynamic_agree_only_where_s_agrees():
    for scaling in ("pi", "ntk", "yarn", "llama3"):
        static, dynamic = rope(scaling, factor=4.0), rope(scaling)
        assert torch.equal(static.frequencies(4 * L)[0], dynamic.frequencies(4 * L)[0])
        assert static.frequencies(4 * L)[1] == dynamic.frequencies(4 * L)[1]
        # one static s for every length; the dynamic one follows n
        assert torch.equal(static.frequencies(2 * L)[0], static.frequencies(4 * L)[0])
        assert not torch.equal(dynamic.frequencies(2 * L)[0], dynamic.frequencies(4 * L)[0])


# --- Position Interpolation --------------------------------------------------------------------
@pytest.mark.parametrize("factor", [None, 4.0])
def test_pi_is_rope_at_position_t_over_s(factor):
    n, s = 4 * L, 4.0
    x = torch.randn(1, 2, n, D, dtype=F64, generator=torch.Generator().manual_seed(0))
    pos = torch.arange(n).unsqueeze(0)
    got, _ = rope("pi", factor).rotate(x, x, pos, 0)
    want = apply_rotary(x, *rope_tables(pos.double() / s, rope_inv_freq(D, BASE), F64))
    torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)
    inv_freq, factor = rope("pi", factor).frequencies(n)
    # the largest angle at n equals RoPE's at L
    torch.testing.assert_close(n * inv_freq, L * theta(), rtol=1e-15, atol=0)
    assert factor == 1.0


def test_static_pi_at_the_training_length_is_rope_at_t_over_s():
    x = torch.randn(1, 2, L, D, dtype=F64, generator=torch.Generator().manual_seed(1))
    pos = torch.arange(L).unsqueeze(0)
    got, _ = rope("pi", 8.0).rotate(x, x, pos, 0)
    want = apply_rotary(x, *rope_tables(pos.double() / 8, rope_inv_freq(D, BASE), F64))
    torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)


# --- NTK ---------------------------------------------------------------------------------------
@pytest.mark.parametrize("factor", [None, 4.0])
def test_ntk_keeps_the_fastest_pair_and_divides_the_slowest_by_s(factor):
    s = 4.0
    inv_freq, table_factor = rope("ntk", factor).frequencies(int(s * L))
    base = theta()
    assert inv_freq[0] == base[0] == 1.0 and table_factor == 1.0
    torch.testing.assert_close(inv_freq[-1], base[-1] / s, rtol=1e-13, atol=0)
    assert (inv_freq[1:-1] < base[1:-1]).all() and (inv_freq[1:-1] > base[1:-1] / s).all()


def test_ntk_base_for_d64_s4_is_41829():
    b_prime = BASE * 4 ** (D / (D - 2))  # the formula, b' = b s^(d/(d-2))
    assert round(b_prime) == 41829
    for enc, n in ((rope("ntk"), 4 * L), (rope("ntk", 4.0), L // 4)):
        torch.testing.assert_close(enc.frequencies(n)[0], theta(b_prime), rtol=1e-13, atol=0)


@pytest.mark.parametrize("alpha", [None, 2.0, 8.0])
def test_dynamic_ntk_is_hf_dynamic_ntk_with_factor_alpha(alpha):
    enc = rope("dynamic_ntk", alpha)
    for n in (L // 2, L, L + 1, 2 * L, 3 * L, 8 * L):
        torch.testing.assert_close(enc.frequencies(n)[0],
                                   hf_dynamic_ntk(D, BASE, L, n, alpha or 1.0),
                                   rtol=1e-12, atol=0, msg=f"n={n}")
    assert torch.equal(enc.frequencies(L)[0], theta())


def test_dynamic_ntk_with_alpha_2_at_2l_is_ntk_with_s_3():
    # alpha n/L - (alpha - 1) = 2*2 - 1 = 3
    torch.testing.assert_close(rope("dynamic_ntk", 2.0).frequencies(2 * L)[0],
                               theta(BASE * 3 ** (D / (D - 2))), rtol=1e-13, atol=0)
    # alpha = 1 (null) is ntk with a dynamic s
    assert torch.equal(rope("dynamic_ntk").frequencies(3 * L)[0],
                       rope("ntk").frequencies(3 * L)[0])


# --- YaRN --------------------------------------------------------------------------------------
@pytest.mark.parametrize("d, base, train_len, s", [
    (64, 1e4, 512, 4.0),   # the paper's regime: ramp over pairs 3..16
    (32, 1e4, 128, 4.0),   # posbench's default head
    (32, 1e4, 128, 16.0),
    (32, 5e5, 128, 8.0),   # a Llama-3 base
    (8, 10.0, 128, 2.0),   # the beta_slow bound (pair 6) lies past the last pair (3)
    (4, 2.0, 128, 4.0),    # ... and past d-1, where the references clamp it
    (32, 1e4, 4, 4.0),     # both bounds clamped to pair 0: the min == max guard
])
def test_yarn_equals_the_reference_implementations(d, base, train_len, s):
    want, attention_factor, _ = reference_yarn(d, base, train_len, s)
    for enc, n in ((rope("yarn", s, head_dim=d, train_len=train_len, base=base), train_len),
                   (rope("yarn", head_dim=d, train_len=train_len, base=base), int(s * train_len))):
        inv_freq, factor = enc.frequencies(n)
        torch.testing.assert_close(inv_freq, want, rtol=1e-13, atol=0)
        assert factor == pytest.approx(attention_factor, rel=1e-15)


def test_yarn_hand_checked_head_32_l_128_s_4():
    # pair index turning beta times in 128 tokens: 32 ln(128 / (2 pi beta)) / (2 ln 1e4)
    # beta = 32: -0.784 -> floor -1 -> clamped to 0; beta = 1: 5.236 -> ceil 6
    _, _, weights = reference_yarn(32, 1e4, 128, 4.0)
    assert weights == pytest.approx([1, 5 / 6, 4 / 6, 3 / 6, 2 / 6, 1 / 6] + [0] * 10, abs=1e-15)
    inv_freq, factor = rope("yarn", 4.0, head_dim=32, train_len=128).frequencies(512)
    base = theta(d=32)
    assert inv_freq[0] == base[0] == 1.0  # the fastest pair keeps RoPE exactly
    torch.testing.assert_close(inv_freq[3], (base[3] + base[3] / 4) / 2, rtol=1e-15, atol=0)
    torch.testing.assert_close(inv_freq[6:], base[6:] / 4, rtol=1e-15, atol=0)
    assert factor == pytest.approx(1 + 0.1 * math.log(4))


def test_yarn_bounds_of_the_paper_example_are_pairs_3_and_16():
    s = 4.0
    inv_freq, _ = rope("yarn").frequencies(int(s * L))
    assert torch.equal(inv_freq[:4], theta()[:4])  # pairs <= low = 3: kept
    torch.testing.assert_close(inv_freq[16:], theta()[16:] / s, rtol=1e-15, atol=0)
    between = (inv_freq[4:16] < theta()[4:16]) & (inv_freq[4:16] > theta()[4:16] / s)
    assert between.all()


def test_yarn_weights_fall_linearly_in_the_pair_index_not_in_the_rotations():
    s = 4.0
    inv_freq, _ = rope("yarn").frequencies(int(s * L))
    w = (inv_freq - theta() / s) / (theta() - theta() / s)
    torch.testing.assert_close(w[3:17].diff(), torch.full((13,), -1 / 13, dtype=F64),
                               rtol=1e-12, atol=1e-14)


@pytest.mark.parametrize("factor", [None, 4.0])
def test_yarn_multiplies_logits_by_the_square_of_0_1_ln_s_plus_1(factor):
    n = 4 * L
    g = torch.Generator().manual_seed(0)
    q, k = torch.randn(2, 1, 2, n, D, generator=g, dtype=F64)
    pos = torch.arange(n).unsqueeze(0)
    enc = rope("yarn", factor)
    inv_freq, _, _ = reference_yarn(D, BASE, L, 4.0)
    cos, sin = rope_tables(pos, inv_freq, F64)  # the reference's frequencies, no factor
    unscaled = apply_rotary(q, cos, sin) @ apply_rotary(k, cos, sin).transpose(-2, -1)
    expected = (0.1 * math.log(4) + 1) ** 2
    assert round(expected, 4) == 1.2965
    torch.testing.assert_close(scores(enc, q, k, pos), expected * unscaled, rtol=1e-10, atol=1e-10)


# --- Llama 3.1 (HF's llama3) --------------------------------------------------------------------
def reference_llama3(d, base, train_len, s, low=1.0, high=4.0):
    """HF's _compute_llama3_parameters, one pair at a time in Python floats: by wavelength, below
    train_len/high kept, above train_len/low divided by s, smoothed between (edges included)."""
    inv_freq = []
    for pair in range(d // 2):
        theta_p = 1 / base ** (2 * pair / d)
        wavelen = 2 * math.pi / theta_p
        if wavelen < train_len / high:
            inv_freq.append(theta_p)
        elif wavelen > train_len / low:
            inv_freq.append(theta_p / s)
        else:
            smooth = (train_len / wavelen - low) / (high - low)
            inv_freq.append((1 - smooth) * theta_p / s + smooth * theta_p)
    return torch.tensor(inv_freq, dtype=F64)


@pytest.mark.parametrize("d, base, train_len, s", [
    (64, 1e4, 512, 4.0),
    (32, 1e4, 128, 4.0),   # posbench's default head
    (32, 5e5, 128, 8.0),   # Llama 3's base
    (128, 5e5, 8192, 8.0),  # Llama 3.1 8B itself
])
def test_llama3_equals_the_reference_formula(d, base, train_len, s):
    want = reference_llama3(d, base, train_len, s)
    for enc, n in ((rope("llama3", s, head_dim=d, train_len=train_len, base=base), train_len),
                   (rope("llama3", head_dim=d, train_len=train_len, base=base), int(s * train_len))):
        inv_freq, factor = enc.frequencies(n)
        torch.testing.assert_close(inv_freq, want, rtol=1e-13, atol=0)
        assert factor == 1.0
    # the test's cases reach all three bands
    wavelen = 2 * math.pi / theta(base, d)
    assert (wavelen < train_len / 4).any() and (wavelen > train_len).any()
    assert ((wavelen >= train_len / 4) & (wavelen <= train_len)).any()


def test_llama3_keeps_fast_pairs_divides_slow_ones_and_is_rope_at_s_1():
    inv_freq, _ = rope("llama3").frequencies(4 * L)
    wavelen = 2 * math.pi / theta()
    fast, slow = wavelen < L / 4, wavelen > L
    assert torch.equal(inv_freq[fast], theta()[fast])
    torch.testing.assert_close(inv_freq[slow], rope("pi").frequencies(4 * L)[0][slow],
                               rtol=1e-15, atol=0)
    band = ~fast & ~slow
    assert ((inv_freq[band] <= theta()[band]) & (inv_freq[band] >= theta()[band] / 4)).all()
    assert torch.equal(llama3_inv_freq(theta(), 1.0, L), theta())
    assert torch.equal(rope("llama3").frequencies(L)[0], theta())  # dynamic: s = 1 up to L


def test_llama3_leaves_pairs_that_do_not_rotate_at_zero():
    inv_freq, _ = rope("llama3", 4.0, cls=PRoPE).frequencies(L)
    base = rope(cls=PRoPE).inv_freq
    assert (inv_freq[base == 0] == 0).all()
    torch.testing.assert_close(inv_freq[base > 0], reference_llama3(D, BASE, L, 4.0)[base > 0],
                               rtol=1e-13, atol=0)


def test_rotary_subclasses_scale_their_rotation():
    n = 2 * L
    inv_freq, _ = rope("pi", cls=PRoPE).frequencies(n)
    base = rope(cls=PRoPE).inv_freq
    assert (base == 0).sum() == 8 and torch.equal(inv_freq, base / 2)
    inv_freq, _ = rope("ntk", cls=PRoPE).frequencies(n)
    assert torch.equal(inv_freq == 0, base == 0)  # NoPE pairs stay NoPE under the new base
    inv_freq, _ = rope("yarn", 2.0, cls=PRoPE).frequencies(L)
    yarn, _, _ = reference_yarn(D, BASE, L, 2.0)
    torch.testing.assert_close(inv_freq[base > 0], yarn[base > 0], rtol=1e-13, atol=0)
    assert (inv_freq[base == 0] == 0).all()
    x = torch.randn(1, 1, n, D, generator=torch.Generator().manual_seed(0))
    pos = torch.arange(n).unsqueeze(0)
    assert not torch.allclose(rope("yarn", cls=XPos).rotate(x, x, pos, 0)[0],
                              rope(cls=XPos).rotate(x, x, pos, 0)[0], atol=1e-3)


# --- log-n -------------------------------------------------------------------------------------
def logn_scale(n, train_len):
    return temperature_factor("logn", n, train_len)[0]


def test_logn_kappa_is_one_up_to_l_and_two_at_l_squared():
    kappa = logn_scale(16 * 16, 16)[:, 0]
    assert (kappa[:16] == 1).all() and (kappa[16:] > 1).all()
    assert kappa[16 * 16 - 1].item() == pytest.approx(2.0, rel=1e-15)
    assert kappa[99].item() == pytest.approx(math.log(100) / math.log(16), rel=1e-15)


def test_logn_scaling_equals_scaling_the_queries():
    torch.manual_seed(0)
    attn = CausalSelfAttention(32, 2, layer=0)
    enc = NoPE(NoPE.Config(name="nope"), Dims(1, 2, 32, 8, 64))
    x = torch.randn(1, 40, 32)
    enc.set_eval_options(temperature="logn")
    with torch.no_grad():
        got = attn(x, torch.arange(40).unsqueeze(0), enc)
        q, k, v = attn.qkv(x).view(1, 40, 3, 2, 16).permute(2, 0, 3, 1, 4)
        q = q * logn_scale(40, 8).float()
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        want = attn.proj(y.transpose(1, 2).reshape(1, 40, 32))
        enc.set_eval_options()
        plain = attn(x, torch.arange(40).unsqueeze(0), enc)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(got[:, :8], plain[:, :8], rtol=0, atol=0)  # kappa = 1 up to L
    assert not torch.allclose(got[:, 8:], plain[:, 8:], atol=1e-4)


# --- config checks and evaluate() --------------------------------------------------------------
@pytest.mark.parametrize("encoding", ["alibi", "sinusoidal", "rope_2d"])
def test_rope_scaling_on_a_non_rotary_encoding_fails_at_compose_in_one_line(encoding):
    message = rf"^eval.rope_scaling='yarn' is not accepted; expected 'none' for encoding={encoding}"
    with pytest.raises(posbench.ConfigError, match=message) as err:
        posbench.compose([f"encoding={encoding}", "eval.rope_scaling=yarn"])
    assert "\n" not in str(err.value)


def test_unknown_rope_scaling_lists_the_accepted_values():
    with pytest.raises(posbench.ConfigError, match=r"^eval.rope_scaling='linear' is not accepted; "
                                                  r"expected one of: none, pi, ntk, dynamic_ntk, "
                                                  r"yarn, llama3, longrope, rerope, self_extend, "
                                                  r"shifted_rope, dca, streaming_llm$"):
        posbench.compose(["eval.rope_scaling=linear"])


def test_rotary_encodings_accept_every_scaling_and_any_encoding_accepts_logn():
    for encoding in ("rope", "p_rope", "xpos", "randomized"):
        for scaling in ("pi", "ntk", "dynamic_ntk", "yarn", "llama3"):
            posbench.compose([f"encoding={encoding}", f"eval.rope_scaling={scaling}"])
    posbench.compose(["encoding=alibi", "eval.temperature=logn"])
    with pytest.raises(posbench.ConfigError, match=r"^eval.rope_scaling='pi' is not accepted; "
                                                  r"expected 'none' for encoding.base=sinusoidal"):
        posbench.compose(["encoding=randomized", "encoding.base=sinusoidal",
                          "eval.rope_scaling=pi"])


@pytest.mark.parametrize("overrides, value, expected", [
    (["eval.rope_scaling=pi"], "1.0", "a finite number > 1"),
    (["eval.rope_scaling=yarn"], "0.5", "a finite number > 1"),
    (["eval.rope_scaling=ntk"], "inf", "a finite number > 1"),
    (["eval.rope_scaling=dynamic_ntk"], "1", "a finite number > 1"),
    ([], "4.0", "null with eval.rope_scaling=none"),
])
def test_bad_rope_scaling_factors_fail_at_compose_in_one_line(overrides, value, expected):
    shown = repr(float(value))
    with pytest.raises(posbench.ConfigError, match=rf"^eval.rope_scaling_factor={shown} is not "
                                                   rf"accepted; expected {expected}") as err:
        posbench.compose([*overrides, f"eval.rope_scaling_factor={value}"])
    assert "\n" not in str(err.value)


def test_rope_scaling_factor_composes_from_numbers_and_null():
    for value, want in (("4", 4.0), ("2.5", 2.5), ("null", None)):
        cfg = posbench.compose(["eval.rope_scaling=yarn", f"eval.rope_scaling_factor={value}"])
        assert cfg.eval.rope_scaling_factor == want
    assert posbench.compose([]).eval.rope_scaling_factor is None  # dynamic by default


def test_a_run_saved_before_the_factor_and_randomized_positions_existed_still_checks():
    saved = OmegaConf.to_container(posbench.compose(["encoding=randomized"]))
    del saved["eval"]["rope_scaling_factor"], saved["eval"]["randomized_positions"]
    old = OmegaConf.create(saved)
    OmegaConf.set_struct(old, True)  # as Hydra loads a run dir's .hydra/config.yaml
    posbench.config.check(old)


def test_randomized_passes_the_scaling_to_its_rotary_base():
    enc = posbench.build_model(posbench.compose(["encoding=randomized"])).encoding
    enc.set_eval_options("yarn", "logn", 4.0)
    assert enc.base.rope_scaling == "yarn" and enc.base.rope_scaling_factor == 4.0
    assert enc.temperature == "logn" and enc.base.temperature is None


def test_evaluate_applies_the_options_past_the_training_length_only(stdlib_data, toy):
    cfg = posbench.compose(toy)
    torch.manual_seed(0)
    model = posbench.build_model(cfg, stdlib_data.vocab_size)
    assert model.encoding.rope_scaling == "none"  # building the model never applies eval options
    curves = {}
    for scaling, logn in (("none", None), ("yarn", None), ("pi", None), ("none", "logn")):
        eval_cfg = OmegaConf.merge(cfg.eval, {"rope_scaling": scaling, "temperature": logn})
        curves[scaling, logn] = evaluate(model, stdlib_data, eval_cfg, torch.device("cpu"))
        assert (model.encoding.rope_scaling, model.encoding.temperature) == (scaling, logn)
    plain = curves["none", None]
    for key, curve in curves.items():
        assert curve[0]["loss"] == plain[0]["loss"], key  # length 32 = L: s = 1, kappa = 1
        if key != ("none", None):
            assert curve[1]["loss"] != plain[1]["loss"], key


def test_evaluate_with_a_static_factor_scales_every_length(stdlib_data, toy):
    cfg = posbench.compose(toy)  # L = 32, lengths 32 and 64
    torch.manual_seed(0)
    model = posbench.build_model(cfg, stdlib_data.vocab_size)
    curves = {}
    for scaling, factor in (("none", None), ("ntk", None), ("ntk", 2.0), ("ntk", 4.0)):
        eval_cfg = OmegaConf.merge(cfg.eval, {"rope_scaling": scaling,
                                              "rope_scaling_factor": factor})
        curves[scaling, factor] = [p["loss"] for p in evaluate(model, stdlib_data, eval_cfg,
                                                               torch.device("cpu"))]
        assert model.encoding.rope_scaling_factor == factor
    plain, dynamic = curves["none", None], curves["ntk", None]
    assert dynamic[0] == plain[0] and dynamic[1] != plain[1]
    assert curves["ntk", 2.0][0] != plain[0]  # static: scaled at L too
    assert curves["ntk", 2.0][1] == dynamic[1]  # s = 2 at 64 = 2L either way
    assert curves["ntk", 4.0][1] != dynamic[1]


def test_posbench_eval_writes_a_scaled_results_file_beside_the_untouched_original(tmp_path,
                                                                                 toy_run_copy):
    run_dir = toy_run_copy
    original = (run_dir / "results.json").read_bytes()
    posbench_cli("eval", str(run_dir), "eval.rope_scaling=yarn", cwd=tmp_path, in_process=True)
    assert (run_dir / "results.json").read_bytes() == original
    new_files = sorted(run_dir.glob("results.eval-*.json"))
    assert [p.name for p in new_files] == ["results.eval-rope_scaling-yarn.json"]
    old, new = json.loads(original), json.loads(new_files[0].read_text())
    assert old["eval"]["rope_scaling"] == "none" and new["eval"]["rope_scaling"] == "yarn"
    assert new["config"]["eval"]["rope_scaling"] == "yarn"
    (at_l, past_l), (new_l, new_past) = old["eval"]["curve"], new["eval"]["curve"]
    assert past_l["length"] == new_past["length"] == 64
    assert new_l["loss"] == pytest.approx(at_l["loss"], rel=1e-6)  # s = 1 at the training length
    assert new_past["loss"] != past_l["loss"]

    # a run that did not finish is refused in one line, and nothing is written
    record = json.loads(original)
    record["status"] = "failed"
    (run_dir / "results.json").write_text(json.dumps(record))
    for state in ("failed", "none"):
        before = sorted(p.name for p in run_dir.iterdir())
        bad = posbench_cli("eval", str(run_dir), "eval.rope_scaling=pi", cwd=tmp_path, ok=False,
                           in_process=True)
        assert bad.returncode == 2 and "Traceback" not in bad.stderr
        (line,) = [x for x in bad.stderr.splitlines() if x.startswith("posbench: error:")]
        assert f"no finished results.json (status {state})" in line
        assert sorted(p.name for p in run_dir.iterdir()) == before
        (run_dir / "results.json").unlink(missing_ok=True)
