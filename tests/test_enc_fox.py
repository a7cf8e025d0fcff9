"""FoX, the Forgetting Transformer (docs/encodings.md#contextual-family). The oracle sums
log f_l over l = j+1..i term by term, in float64, independently of fox.py's running sum."""
import functools
import math

import pytest
import torch

import posbench
import posbench.attention.paths as attention
from posbench.attention.paths import attend
from posbench.encodings.alibi import alibi_slopes

from helpers import assert_matches_reference, assert_position_ids_are_never_read, tiny_model
from test_attention_paths import largest_in_row_blocks


build = functools.partial(tiny_model, name="fox")


def forget_bias(w, b, x):
    """D[b, h, i, j] = Σ_{l=j+1..i} log σ(w_h·x_l + b_h) for j <= i, float64, term by term."""
    T = x.shape[1]
    log_f = torch.nn.functional.logsigmoid(x.double() @ w.double().T + b.double())  # (B, T, H)
    i, j, l = torch.arange(T).view(T, 1, 1), torch.arange(T).view(1, T, 1), torch.arange(T)
    between = ((l > j) & (l <= i)).double()  # (T, T, T): l in (j, i]
    return torch.einsum("ijl,blh->bhij", between, log_f)


def bias_of(enc, x, layer=0):
    """What FoX's score_mod adds, (B, H, T, T), read on zero scores."""
    B, T, _ = x.shape
    H = enc.dims.n_head
    fn = enc.score_mod(None, None, torch.arange(T).expand(B, T), layer, x=x)
    return fn(torch.zeros(()), torch.arange(B).view(B, 1, 1, 1), torch.arange(H).view(1, H, 1, 1),
              torch.arange(T).view(1, 1, T, 1), torch.arange(T).view(1, 1, 1, T))


def test_bias_is_the_sum_of_log_forget_gates_between_key_and_query():
    enc = build().encoding.double()
    with torch.no_grad():
        enc.gate_weight.normal_(0, 0.3)
        enc.gate_bias.normal_(1, 1)
    x = torch.randn(2, 30, 64, dtype=torch.float64, generator=torch.Generator().manual_seed(0))
    got, expected = bias_of(enc, x, layer=1), forget_bias(enc.gate_weight[1], enc.gate_bias[1], x)
    causal = torch.ones(30, 30).tril().bool()
    torch.testing.assert_close(got[..., causal], expected[..., causal], rtol=1e-12, atol=1e-12)
    assert (got[..., causal] <= 0).all() and expected[..., causal].min() < -5  # a real decay


@pytest.mark.parametrize("n_head", [4, 6])
def test_constant_gate_is_alibi_with_slope_minus_log_f(n_head):
    """w = 0, b_h = logit(e^{-m_h}): every log f_l = -m_h, so D_ij = -m_h (i - j), ALiBi's bias."""
    shape = [f"model.n_head={n_head}", f"model.d_model={16 * n_head}"]
    fox, alibi = build(*shape, seed=1), build(*shape, name="alibi", seed=2)
    fox.load_state_dict(alibi.state_dict(), strict=False)
    m = torch.tensor(alibi_slopes(n_head), dtype=torch.float64)
    with torch.no_grad():
        fox.encoding.gate_weight.zero_()
        fox.encoding.gate_bias.copy_(-m - torch.log(-torch.expm1(-m)))  # logit(e^{-m})
    idx = torch.randint(0, 64, (2, 64), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        expected = alibi(idx)
        err = (fox(idx) - expected).abs().max().item()
        assert err < 1e-5, err
        assert (build(*shape, name="nope", seed=2)(idx) - expected).abs().max() > 1e-3


def test_any_constant_gate_is_a_fixed_linear_bias():
    enc = build().encoding.double()
    f = torch.tensor([0.99, 0.9, 0.5, 0.1], dtype=torch.float64)
    with torch.no_grad():
        enc.gate_weight.zero_()
        enc.gate_bias[0].copy_(torch.log(f / (1 - f)))
    x = torch.randn(1, 25, 64, dtype=torch.float64)
    lag = (torch.arange(25).view(25, 1) - torch.arange(25)).double()
    causal = lag >= 0
    expected = torch.log(f).view(4, 1, 1) * lag  # slope -log f per head
    torch.testing.assert_close(bias_of(enc, x)[0][:, causal], expected[:, causal], rtol=1e-12,
                               atol=1e-12)


def test_a_gate_changes_the_bias_only_between_earlier_keys_and_later_queries():
    enc = build().encoding.double()
    with torch.no_grad():
        enc.gate_weight.normal_(0, 0.3)
    x = torch.randn(1, 20, 64, dtype=torch.float64, generator=torch.Generator().manual_seed(3))
    moved = x.clone()
    moved[0, 8] += 3.0  # the gate of token t = 8
    changed = (bias_of(enc, moved) - bias_of(enc, x)).abs() > 1e-9
    i, j = torch.arange(20).view(20, 1), torch.arange(20).view(1, 20)
    for h in range(4):  # on the causal keys, D_ij holds f_8 exactly when j < 8 <= i
        assert torch.equal(changed[0, h] & (j <= i), (j < 8) & (8 <= i)), h


@pytest.mark.parametrize("blocks", ["one", "several"])
def test_blockwise_path_matches_dense_float64_reference(blocks, monkeypatch):
    enc = build().encoding.double()
    with torch.no_grad():
        enc.gate_weight.normal_(0, 0.2)
        enc.gate_bias.normal_(2, 1)
    B, H, T, d = 2, 4, 40, 16
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(B, H, T, d, generator=g, dtype=torch.float64, requires_grad=True)
               for _ in range(3))
    x = torch.randn(B, T, 64, generator=g, dtype=torch.float64, requires_grad=True)
    if blocks == "several":  # blocks of 16 rows, each checkpointed
        monkeypatch.setattr(attention, "BLOCK_ELEMENTS", B * H * T * 16)
    out = attend(q, k, v, torch.arange(T).expand(B, T), enc, 1, x)

    scores = q @ k.transpose(-1, -2) / math.sqrt(d) + forget_bias(enc.gate_weight[1],
                                                                   enc.gate_bias[1], x)
    causal = torch.ones(T, T).tril().bool()
    ref = torch.softmax(scores.masked_fill(~causal, float("-inf")), -1) @ v
    assert_matches_reference(out, ref, (q, k, v, x, enc.gate_weight, enc.gate_bias),
                             rtol=1e-10, atol=1e-10, grad_rtol=1e-9, grad_atol=1e-10)


def test_attend_without_the_input_is_refused():
    enc = build().encoding
    q = torch.randn(1, 4, 8, 16)
    with pytest.raises(ValueError, match="FoX's score_mod reads the attention's input"):
        attend(q, q, q, torch.arange(8).expand(1, 8), enc, 0)


def test_position_ids_are_never_read():
    assert_position_ids_are_never_read(build())


def test_gate_weights_and_bias_start_as_the_reference_initializes_them():
    enc = build("model.n_layer=4", "model.n_head=8", "model.d_model=128").encoding
    w = enc.gate_weight.detach().double()
    assert w.shape == (4, 8, 128)  # one gate per layer and head, over the layer's input
    assert w.std() == pytest.approx(0.02, rel=0.05) and abs(w.mean()) < 4 * 0.02 / 64
    assert torch.equal(enc.gate_bias.detach(), torch.zeros(4, 8))  # f starts near 1/2


def test_gate_parameters_receive_gradients():
    model = build()
    model.train()
    idx = torch.randint(0, 64, (2, 40), generator=torch.Generator().manual_seed(0))
    model(idx).logsumexp(-1).mean().backward()
    for name, p in model.encoding.named_parameters():
        assert p.grad is not None and p.grad.abs().sum() > 0, name


def test_memory_grows_with_length_not_its_square(monkeypatch):
    """At T = 1024 in blocks of 64 rows, no tensor holds more than one block's scores: the
    running sum is per token, (B, H, T)."""
    largest, block = largest_in_row_blocks(monkeypatch, build().encoding)
    assert largest <= block


def test_inspect_reads_the_gates_too():
    from posbench.reports.inspect import lag_mass

    model = build()
    idx = torch.randint(0, 64, (3, 32), generator=torch.Generator().manual_seed(0))
    mass = lag_mass(model, idx)[0]  # (layers, H, lags): every query's probabilities sum to 1
    torch.testing.assert_close(mass.sum(-1), torch.full((2, 4), 3.0 * 32, dtype=torch.float64))


def test_negative_init_std_is_one_line_config_error():
    with pytest.raises(posbench.ConfigError, match=r"^encoding.gate_init_std=-1.0 is not accepted; "
                                                  r"expected a number >= 0$"):
        posbench.compose(["encoding=fox", "encoding.gate_init_std=-1"])
