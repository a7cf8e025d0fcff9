"""Eval-time options without retraining (shared/ENCODINGS.md §6): PI, NTK, dynamic NTK, YaRN on the
rotary encodings, log-n scaling on any encoding; how evaluate() and `posbench eval` apply them."""
import json
import math

import pytest
import torch
import torch.nn.functional as F
from omegaconf import OmegaConf

import posbench
from posbench.attention import CausalSelfAttention, logn_scale
from posbench.encodings import Dims
from posbench.encodings.nope import NoPE
from posbench.encodings.p_rope import PRoPE
from posbench.encodings.rope import RoPE, apply_rotary, rope_inv_freq, rope_tables
from posbench.encodings.xpos import XPos
from posbench.evaluate import evaluate
from helpers import posbench_cli

F64 = torch.float64
D, L, BASE = 64, 512, 1e4


def rope(scaling="none", cls=RoPE, head_dim=D, train_len=L, **options):
    enc = cls(cls.Config(name="rope", **options), Dims(1, 1, head_dim, train_len, 8 * train_len))
    enc.set_eval_options(scaling)
    return enc


def theta(base=BASE, d=D):
    return base ** (-torch.arange(0, d, 2, dtype=F64) / d)


def rotations(inv_freq):
    """r_p = L / lambda_p: turns of pair p within the training window."""
    return L * inv_freq / (2 * math.pi)


# --- Position Interpolation --------------------------------------------------------------------
def test_pi_is_rope_at_position_t_over_s():
    n, s = 4 * L, 4.0
    x = torch.randn(1, 2, n, D, dtype=F64, generator=torch.Generator().manual_seed(0))
    pos = torch.arange(n).unsqueeze(0)
    got, _ = rope("pi").rotate(x, x, pos, 0)
    want = apply_rotary(x, *rope_tables(pos.double() / s, rope_inv_freq(D, BASE), F64))
    torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)
    inv_freq, factor = rope("pi").frequencies(n)
    # the largest angle at n equals RoPE's at L
    torch.testing.assert_close(n * inv_freq, L * theta(), rtol=1e-15, atol=0)
    assert factor == 1.0


def test_scalings_leave_rope_alone_up_to_the_training_length():
    x = torch.randn(1, 2, L, D, generator=torch.Generator().manual_seed(0))
    pos = torch.arange(L).unsqueeze(0)
    plain = rope().rotate(x, x, pos, 0)[0]
    for scaling in ("pi", "ntk", "dynamic_ntk", "yarn"):
        for n in (L // 2, L):
            assert torch.equal(rope(scaling).rotate(x[:, :, :n], x[:, :, :n], pos[:, :n], 0)[0],
                               plain[:, :, :n]), (scaling, n)
        assert not torch.equal(rope(scaling).frequencies(L + 1)[0], theta()), scaling


# --- NTK ---------------------------------------------------------------------------------------
def test_ntk_keeps_the_fastest_pair_and_divides_the_slowest_by_s():
    s = 4.0
    inv_freq, factor = rope("ntk").frequencies(int(s * L))
    base = theta()
    assert inv_freq[0] == base[0] == 1.0 and factor == 1.0
    torch.testing.assert_close(inv_freq[-1], base[-1] / s, rtol=1e-13, atol=0)
    assert (inv_freq[1:-1] < base[1:-1]).all() and (inv_freq[1:-1] > base[1:-1] / s).all()


def test_ntk_base_for_d64_s4_is_41829():
    b_prime = BASE * 4 ** (D / (D - 2))  # the formula, b' = b s^(d/(d-2))
    assert round(b_prime) == 41829
    inv_freq, _ = rope("ntk").frequencies(4 * L)
    torch.testing.assert_close(inv_freq, theta(b_prime), rtol=1e-13, atol=0)


def test_dynamic_ntk_is_rope_up_to_l_and_ntk_with_s_2_at_2l():
    assert torch.equal(rope("dynamic_ntk").frequencies(L)[0], theta())
    inv_freq, _ = rope("dynamic_ntk").frequencies(2 * L)
    torch.testing.assert_close(inv_freq, theta(BASE * 2 ** (D / (D - 2))), rtol=1e-13, atol=0)
    assert not torch.allclose(inv_freq, theta())


# --- YaRN --------------------------------------------------------------------------------------
def test_yarn_at_s_1_is_rope_with_factor_1():
    inv_freq, factor = rope("yarn").frequencies(L)
    assert torch.equal(inv_freq, theta()) and factor == 1.0


def test_yarn_keeps_fast_pairs_interpolates_slow_ones_and_ramps_in_between():
    s = 4.0
    inv_freq, _ = rope("yarn").frequencies(int(s * L))
    base = theta()
    r = rotations(base)
    fast, slow, mid = r > 32, r < 1, (r >= 1) & (r <= 32)
    assert fast.any() and slow.any() and mid.any()
    assert torch.equal(inv_freq[fast], base[fast])
    torch.testing.assert_close(inv_freq[slow], base[slow] / s, rtol=1e-15, atol=0)
    gamma = (r[mid] - 1) / 31
    torch.testing.assert_close(inv_freq[mid], (1 - gamma) * base[mid] / s + gamma * base[mid],
                               rtol=1e-13, atol=0)


def test_yarn_agrees_with_hf_pair_bounds_low_3_high_16():
    low = math.floor(D * math.log(L / (2 * math.pi * 32)) / (2 * math.log(BASE)))
    high = math.ceil(D * math.log(L / (2 * math.pi * 1)) / (2 * math.log(BASE)))
    assert (low, high) == (3, 16)
    s = 4.0
    inv_freq, _ = rope("yarn").frequencies(int(s * L))
    assert torch.equal(inv_freq[:low + 1], theta()[:low + 1])  # pairs <= low: kept
    torch.testing.assert_close(inv_freq[high:], theta()[high:] / s, rtol=1e-15, atol=0)


def test_yarn_multiplies_logits_by_the_square_of_0_1_ln_s_plus_1():
    n = 4 * L
    g = torch.Generator().manual_seed(0)
    q, k = torch.randn(2, 1, 2, n, D, generator=g)
    pos = torch.arange(n).unsqueeze(0)
    enc = rope("yarn")
    yq, yk = enc.rotate(q, k, pos, 0)
    inv_freq, factor = enc.frequencies(n)
    cos, sin = rope_tables(pos, inv_freq, torch.float32)  # same frequencies, no temperature
    ratio = (yq @ yk.transpose(-2, -1)) / (apply_rotary(q, cos, sin) @ apply_rotary(k, cos, sin)
                                           .transpose(-2, -1))
    expected = (0.1 * math.log(4) + 1) ** 2
    assert round(expected, 4) == 1.2965
    assert factor == pytest.approx(0.1 * math.log(4) + 1, rel=1e-15)
    torch.testing.assert_close(ratio.median(), torch.tensor(expected), rtol=1e-6, atol=0)


def test_rotary_subclasses_scale_their_rotation():
    n = 2 * L
    inv_freq, _ = rope("pi", cls=PRoPE).frequencies(n)
    base = rope(cls=PRoPE).inv_freq
    assert (base == 0).sum() == 8 and torch.equal(inv_freq, base / 2)
    inv_freq, _ = rope("ntk", cls=PRoPE).frequencies(n)
    assert torch.equal(inv_freq == 0, base == 0)  # NoPE pairs stay NoPE under the new base
    x = torch.randn(1, 1, n, D, generator=torch.Generator().manual_seed(0))
    pos = torch.arange(n).unsqueeze(0)
    assert not torch.allclose(rope("yarn", cls=XPos).rotate(x, x, pos, 0)[0],
                              rope(cls=XPos).rotate(x, x, pos, 0)[0], atol=1e-3)


# --- log-n -------------------------------------------------------------------------------------
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
    enc.set_eval_options(logn_scaling=True)
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
                                                  r"expected one of \('none', 'pi', 'ntk', "
                                                  r"'dynamic_ntk', 'yarn'\)$"):
        posbench.compose(["eval.rope_scaling=linear"])


def test_rotary_encodings_accept_every_scaling_and_any_encoding_accepts_logn():
    for encoding in ("rope", "p_rope", "xpos", "randomized"):
        for scaling in ("pi", "ntk", "dynamic_ntk", "yarn"):
            posbench.compose([f"encoding={encoding}", f"eval.rope_scaling={scaling}"])
    posbench.compose(["encoding=alibi", "eval.logn_scaling=true"])
    with pytest.raises(posbench.ConfigError, match=r"^eval.rope_scaling='pi' is not accepted; "
                                                  r"expected 'none' for encoding.base=sinusoidal"):
        posbench.compose(["encoding=randomized", "encoding.base=sinusoidal",
                          "eval.rope_scaling=pi"])


def test_randomized_passes_the_scaling_to_its_rotary_base():
    enc = posbench.build_model(posbench.compose(["encoding=randomized"])).encoding
    enc.set_eval_options("yarn", True)
    assert enc.base.rope_scaling == "yarn" and enc.logn_scaling and not enc.base.logn_scaling


def test_evaluate_applies_the_options_past_the_training_length_only(stdlib_data, toy):
    cfg = posbench.compose(toy)
    torch.manual_seed(0)
    model = posbench.build_model(cfg, stdlib_data.vocab_size)
    assert model.encoding.rope_scaling == "none"  # building the model never applies eval options
    curves = {}
    for scaling, logn in (("none", False), ("yarn", False), ("pi", False), ("none", True)):
        eval_cfg = OmegaConf.merge(cfg.eval, {"rope_scaling": scaling, "logn_scaling": logn})
        curves[scaling, logn] = evaluate(model, stdlib_data, eval_cfg, torch.device("cpu"))
        assert (model.encoding.rope_scaling, model.encoding.logn_scaling) == (scaling, logn)
    plain = curves["none", False]
    for key, curve in curves.items():
        assert curve[0]["loss"] == plain[0]["loss"], key  # length 32 = L: s = 1, kappa = 1
        if key != ("none", False):
            assert curve[1]["loss"] != plain[1]["loss"], key


def test_posbench_eval_writes_a_scaled_results_file_beside_the_untouched_original(tmp_path, toy):
    run_dir = tmp_path / "run"
    posbench_cli("train", *toy, f"hydra.run.dir={run_dir}", cwd=tmp_path)
    original = (run_dir / "results.json").read_bytes()
    posbench_cli("eval", str(run_dir), "eval.rope_scaling=yarn", cwd=tmp_path)
    assert (run_dir / "results.json").read_bytes() == original
    new_files = sorted(run_dir.glob("results.eval-*.json"))
    assert [p.name for p in new_files] == ["results.eval-rope_scaling=yarn.json"]
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
        bad = posbench_cli("eval", str(run_dir), "eval.rope_scaling=pi", cwd=tmp_path, ok=False)
        assert bad.returncode == 2 and "Traceback" not in bad.stderr
        (line,) = [x for x in bad.stderr.splitlines() if x.startswith("posbench: error:")]
        assert f"no finished results.json (status {state})" in line
        assert sorted(p.name for p in run_dir.iterdir()) == before
        (run_dir / "results.json").unlink(missing_ok=True)
