"""Softmax temperature by length (posbench/attention/temperature.py,
docs/encodings.md#softmax-temperature): each formula against an oracle written here from its
reference's definition, in float64; how the model applies it (q of each row scaled before the
logits); SSMax learned; eval.temperature."""
import math
import re

import pytest
import torch

import posbench
from posbench.attention.paths import attention_probs
from posbench.core.errors import ConfigError
from posbench.attention.span import GLOBAL, Span
from posbench.attention.temperature import LEARNED, TEMPERATURES, Temperature, temperature_factor

from test_attention_paths import encoding
from test_enc_layers import reference_logits, sharpen
from test_span import visible_by_definition

L = 16
FIXED = [kind for kind in TEMPERATURES if kind not in LEARNED and kind != "none"]


def oracle(kind, n, train_len=L, seen=None, s=None):
    """Factors of query rows 0..n-1, one float per row (per head for ssmax), from the formulas:
    seen[i] is how many keys row i sees (i + 1 without a local span)."""
    seen = seen or [i + 1 for i in range(n)]
    ratio = max(1.0, n / train_len)
    rows = []
    for i in range(n):
        if kind == "logn":  # Qwen's logn_attn
            rows.append(max(1.0, math.log(seen[i]) / math.log(train_len)))
        elif kind == "llama4_floorlog":  # Llama 4: attn_scale 0.1, floor_scale F (here L)
            rows.append(1 + 0.1 * math.log(math.floor((i + 1) / train_len) + 1))
        elif kind == "yarn":  # sqrt(1/t) = 0.1 ln s + 1 on q and on k
            rows.append((0.1 * math.log(ratio) + 1) ** 2)
        elif kind == "drope_beta":  # beta* = 1 + c ln(C_test / C_train), c = 0.412
            rows.append(1 + 0.412 * math.log(ratio))
        elif kind == "ssmax":  # s log n
            rows.append([s_h * math.log(seen[i]) for s_h in s])
    return torch.tensor(rows, dtype=torch.float64)


@pytest.mark.parametrize("n", [L // 2, L, 5 * L])
@pytest.mark.parametrize("kind", FIXED)
def test_each_fixed_formula_against_its_oracle(kind, n):
    got = temperature_factor(kind, n, L)
    torch.testing.assert_close(got.expand(1, n, 1).flatten(), oracle(kind, n), rtol=1e-12,
                               atol=1e-12)


@pytest.mark.parametrize("span", [GLOBAL, Span("sliding", 5), Span("chunked", 5)], ids=str)
def test_ssmax_is_s_log_of_the_keys_each_query_sees(span):
    n, s = 23, torch.tensor([0.43, 0.1, 1.5], dtype=torch.float64)
    i = list(range(n))
    seen = {"global": [j + 1 for j in i], "sliding": [min(j + 1, 5) for j in i],
            "chunked": [j % 5 + 1 for j in i]}[span.kind]
    got = temperature_factor("ssmax", n, L, span, s=s)
    torch.testing.assert_close(got[..., 0], oracle("ssmax", n, seen=seen, s=s.tolist()).T)
    if span.kind != "global":  # logn reads the same counts
        torch.testing.assert_close(temperature_factor("logn", n, L, span).flatten(),
                                   oracle("logn", n, seen=seen))


@pytest.mark.parametrize("span", [GLOBAL, Span("sliding", 8)], ids=str)
def test_ssmax_with_s_one_over_log_n_is_plain_softmax(span):
    """At the rows that see n keys, s = 1/ln n makes SSMax's factor 1: the same probabilities as
    plain softmax; rows that see fewer keys differ."""
    B, H, T, d = 1, 2, 24, 8
    n = T if span.is_global else span.width
    g = torch.Generator().manual_seed(0)
    q, k = (torch.randn(B, H, T, d, generator=g, dtype=torch.float64) for _ in range(2))
    temperature = Temperature("ssmax", H, span).double()
    with torch.no_grad():
        temperature.s.fill_(1 / math.log(n))
    nope, pos = encoding("nope"), torch.arange(T).expand(B, T)
    ssmax = attention_probs(temperature(q, L), k, pos, nope, 0, span=span)
    plain = attention_probs(q, k, pos, nope, 0, span=span)
    full = torch.tensor([len(range(span.first_key(i), i + 1)) == n for i in range(T)])
    torch.testing.assert_close(ssmax[:, :, full], plain[:, :, full], rtol=1e-12, atol=1e-12)
    assert not torch.allclose(ssmax[:, :, ~full], plain[:, :, ~full], atol=1e-3)


def built(*overrides, n_layer=2):
    cfg = posbench.compose(["encoding=nope", f"model.n_layer={n_layer}", "model.d_model=32",
                            "model.n_head=2", f"train.seq_len={L}", *overrides])
    posbench.config.check(cfg)
    torch.manual_seed(0)
    m = posbench.build_model(cfg, 64).eval()
    sharpen(m)
    return m


@pytest.mark.parametrize("kind", FIXED)
def test_the_model_scales_each_query_row_before_its_logits(kind):
    """model.temperature in every layer against the float64 forward with q scaled by the
    oracle's factors; at the training length the fixed kinds change nothing (floorlog: but its
    last row, as Llama 4's at position 8191)."""
    n = 3 * L
    m, plain = built(f"model.temperature={kind}"), built()
    idx = torch.randint(0, 64, (2, n), generator=torch.Generator().manual_seed(0))
    factor = oracle(kind, n).view(1, n, 1)
    with torch.no_grad():
        out = m(idx)
        torch.testing.assert_close(out.double(), reference_logits(m, idx, [False] * 2,
                                                                  q_scale=[factor] * 2),
                                   rtol=1e-5, atol=1e-5)
        short = L - 1 if kind == "llama4_floorlog" else L
        assert torch.equal(m(idx[:, :short]), plain(idx[:, :short]))


def test_ssmax_is_learned_per_head_and_layer():
    m = built("model.temperature=ssmax")
    scales = [block.attn.temperature.s for block in m.blocks]
    assert all(s.shape == (2,) and (s == 0.43).all() for s in scales)
    assert {id(s) for s in scales} <= {id(p) for p in m.parameters()}
    idx = torch.randint(0, 64, (2, 20), generator=torch.Generator().manual_seed(0))
    m.train()
    m(idx, targets=idx).mean().backward()
    assert all(s.grad is not None and s.grad.abs().min() > 0 for s in scales)


def test_a_pattern_sets_the_temperature_per_layer_kind():
    m = built("encoding=layers", "encoding.pattern=[rope,nope]",
              "encoding.temperature=[none,llama4_floorlog]", "model.temperature=logn",
              n_layer=4)
    assert [block.attn.temperature.kind for block in m.blocks] == [
        "none", "llama4_floorlog", "none", "llama4_floorlog"]
    assert [block.attn.temperature.kind for block in built("model.temperature=logn").blocks] \
        == ["logn", "logn"]


def test_eval_temperature_replaces_the_fixed_ones_and_keeps_a_learned_one():
    n = 3 * L
    idx = torch.randint(0, 64, (1, n), generator=torch.Generator().manual_seed(0))
    plain, logn = built(), built("model.temperature=logn")
    plain.encoding.set_eval_options(temperature="logn")
    with torch.no_grad():
        assert torch.equal(plain(idx), logn(idx))
    # irope: no temperature in its RoPE layers, floorlog in its NoPE ones; drope_beta in all
    irope = built("encoding=irope", n_layer=4)
    irope.encoding.set_eval_options(temperature="drope_beta")
    chunk = Span("chunked", L // 4)
    local = [lambda i, j: visible_by_definition(chunk, i, j)] * 3 + [None]
    with torch.no_grad():
        torch.testing.assert_close(irope(idx).double(), reference_logits(
            irope, idx, [True, True, True, False], visible=local,
            q_scale=[oracle("drope_beta", n).view(1, n, 1)] * 4), rtol=1e-5, atol=1e-5)
    ssmax = built("model.temperature=ssmax")
    with torch.no_grad():
        before = ssmax(idx)
        ssmax.encoding.set_eval_options(temperature="logn")
        assert torch.equal(ssmax(idx), before)


@pytest.mark.parametrize("overrides, message", [
    (["model.temperature=ssmaxx"], "model.temperature='ssmaxx' is not accepted; expected one of"),
    (["eval.temperature=ssmax"], "a learned temperature is trained: model.temperature"),
    (["eval.temperature=logm"], "(did you mean 'logn'?)"),
    (["encoding=layers", "encoding.temperature=[yarn,logn]"], "one value per entry"),
    (["encoding=layers", "encoding.temperature=[hot]"], "entry 'hot' is not accepted"),
    (["model.temperature=logn", "train.seq_len=1", "eval.lengths=[4]"], "it divides by ln L"),
])
def test_bad_temperatures_are_refused_in_one_line(overrides, message):
    with pytest.raises(ConfigError, match=re.escape(message)):
        posbench.config.check(posbench.compose(overrides))


def test_a_run_saved_with_logn_scaling_checks_as_eval_temperature_logn():
    from omegaconf import OmegaConf

    saved = OmegaConf.to_container(posbench.compose(["encoding=alibi"]))
    del saved["eval"]["temperature"]
    for flag, expected in ((True, "logn"), (False, None)):
        old = OmegaConf.create({**saved, "eval": {**saved["eval"], "logn_scaling": flag}})
        OmegaConf.set_struct(old, True)  # as Hydra loads a run dir's .hydra/config.yaml
        posbench.config.check(old)
        assert "logn_scaling" not in old.eval and old.eval.get("temperature") == expected
