"""Sandwich (docs/encodings.md#bias-family): parameter-free sinusoid product, scaled per head."""
import math

import pytest
import torch

import posbench
import posbench.attention.paths as attention
from posbench.attention.paths import attend

from helpers import assert_matches_reference, assert_shift_invariant


def build(*extra):
    cfg = posbench.compose(["encoding=sandwich", "model.n_layer=2", "model.d_model=64",
                            "model.n_head=4", *extra])
    torch.manual_seed(0)
    return posbench.build_model(cfg).eval()


def bias_matrix(enc, pos):
    """The encoding's bias for every (head, i, j), read through its score_mod."""
    B, T = pos.shape
    H = enc.dims.n_head
    fn = enc.score_mod(None, None, pos, 0)
    return fn(torch.zeros(B, H, T, T), torch.arange(B).view(B, 1, 1, 1),
              torch.arange(H).view(1, H, 1, 1), torch.arange(T).view(1, 1, T, 1),
              torch.arange(T).view(1, 1, 1, T))


def direct_bias(lag, dim, h, n_head):
    """The formula of 4.7 term by term in Python floats."""
    total = sum(math.cos(lag * 10000.0 ** (-2 * k / dim)) for k in range(1, dim // 2 + 1))
    return (total - dim / 2) * n_head / (8 * h)


def positions(strides, T, offset):
    """(B, T) positions offset + stride_b * t: one row expanded when the strides agree (the
    usual shared row), else one row per sequence."""
    pos = torch.arange(T) * torch.tensor(strides).view(-1, 1) + offset
    return pos[:1].expand(len(strides), T) if len(set(strides)) == 1 else pos


# reference values (d'=64, h=1, H=8; docs/encodings.md#bias-family), decimals as listed
REFERENCE = [(0, 0.0, 1), (1, -0.62, 2), (5, -7.8, 1), (50, -16.3, 1), (500, -23.7, 1),
             (2000, -30.0, 1)]


def test_reference_values_at_the_precision_they_are_listed():
    enc = build("model.n_head=8", "encoding.dim=64").encoding
    # the query at position 2000 sees these keys at lags 2000, 500, 50, 5, 1, 0
    pos = torch.tensor([[0, 1500, 1950, 1995, 1999, 2000]])
    row = bias_matrix(enc, pos)[0, 0, -1]
    by_lag = {2000 - int(p): float(b) for p, b in zip(pos[0], row)}
    for lag, expected, decimals in REFERENCE:
        # half a unit of the last listed digit: a fixed 1e-3 is finer than -0.62 or -7.8 allow
        assert abs(by_lag[lag] - expected) <= 0.5 * 10.0 ** -decimals + 1e-6, (lag, by_lag[lag])
        assert by_lag[lag] == pytest.approx(direct_bias(lag, 64, 1, 8), abs=2e-5)


def test_bias_is_zero_at_lag_zero_nonpositive_and_bounded_per_head():
    enc = build("model.n_head=8", "model.d_model=128").encoding  # d' = head dim = 16
    T = 300
    pos = (torch.arange(T) * 17).view(1, T)  # lags up to 5083
    bias = bias_matrix(enc, pos)[0]
    causal = torch.ones(T, T, dtype=torch.bool).tril()
    assert torch.equal(bias.diagonal(dim1=-2, dim2=-1), torch.zeros(8, T))
    assert (bias[:, causal] <= 0).all()
    floor = -16 * 8 / (8 * torch.arange(1, 9.0))  # -d'H/(8h)
    assert (bias[:, causal] >= floor.view(8, 1) - 1e-5).all()
    # head h is head 1 compressed by 1/h
    torch.testing.assert_close(bias[3], bias[0] / 4, rtol=1e-6, atol=1e-6)
    assert float(bias[0, 1, 0]) == pytest.approx(direct_bias(17, 16, 1, 8), abs=1e-6)


@pytest.mark.parametrize("strides", [(3, 3), (3, 2)])
def test_blockwise_path_matches_dense_float64_reference(strides, monkeypatch):
    torch.manual_seed(0)
    enc = build("model.n_head=3", "model.d_model=48").encoding  # d' = 16
    B, H, T, d = 2, 3, 40, 16
    q, k, v = (torch.randn(B, H, T, d, dtype=torch.float64, requires_grad=True) for _ in range(3))
    pos = positions(strides, T, 5)
    monkeypatch.setattr(attention, "BLOCK_ELEMENTS", B * H * T * 16)  # three blocks, checkpointed
    out = attend(q, k, v, pos, enc, 0)

    i, j = torch.arange(T).view(T, 1), torch.arange(T).view(1, T)
    bias = torch.tensor([[[[direct_bias(max(0, s * (r - c)), 16, h, H) for c in range(T)]
                           for r in range(T)] for h in range(1, H + 1)] for s in strides],
                        dtype=torch.float64)
    s = q @ k.transpose(-1, -2) / math.sqrt(d) + bias
    ref = torch.softmax(s.masked_fill(j > i, float("-inf")), -1) @ v
    assert_matches_reference(out, ref, (q, k, v))


def test_shift_leaves_model_logits_unchanged():
    model = build()
    idx = torch.randint(0, 256, (2, 64), generator=torch.Generator().manual_seed(0))
    base = assert_shift_invariant(model, idx, per_sequence=True)
    with torch.no_grad():
        # not vacuous: other lags give other logits
        assert not torch.allclose(model(idx, pos=torch.arange(64) * 2), base, atol=1e-3)


def test_out_of_range_dim_is_one_line_config_error():
    with pytest.raises(posbench.ConfigError, match=r"encoding\.dim=7 .*even integer >= 2") as err:
        posbench.compose(["encoding=sandwich", "encoding.dim=7"])
    assert "\n" not in str(err.value)
    with pytest.raises(posbench.ConfigError, match=r"model\.d_model/model\.n_head=5"):
        posbench.compose(["encoding=sandwich", "model.d_model=20", "model.n_head=4"])
