"""Transformer-XL relative attention (docs/encodings.md#bias-family)."""
import math

import pytest
import torch

import posbench
import posbench.attention.paths as attention
from posbench.attention.paths import attend, blockwise_attention
from posbench.encodings import transformer_xl
from posbench.encodings.transformer_xl import lag_keys

from helpers import assert_matches_reference, assert_shift_invariant


def build(*extra):
    cfg = posbench.compose(["encoding=transformer_xl", "model.n_layer=2", "model.d_model=64",
                            "model.n_head=4", *extra])
    torch.manual_seed(0)
    model = posbench.build_model(cfg).eval()
    with torch.no_grad():  # trained-size u, v, W_R so that every term matters
        for p in model.encoding.parameters():
            p.normal_(0, 0.3)
    return model


def grid(B, H, T):
    return (torch.arange(B).view(B, 1, 1, 1), torch.arange(H).view(1, H, 1, 1),
            torch.arange(T).view(1, 1, T, 1), torch.arange(T).view(1, 1, 1, T))


def direct_logits(q, k, u, v, w_r, lag):
    """((q_i+u).k_j + (q_i+v).W_R R_{i-j})/sqrt(d) with R built per lag from its definition."""
    H, d, D = q.shape[1], q.shape[3], w_r.shape[1]
    freqs = torch.tensor([10000.0 ** (-2 * f / D) for f in range(D // 2)], dtype=torch.float64)
    angle = lag.double().unsqueeze(-1) * freqs
    r = torch.cat((angle.sin(), angle.cos()), dim=-1)  # (T, T, D)
    keys = (r @ w_r.T).view(*lag.shape, H, d).permute(2, 0, 1, 3)  # (H, T, T, d)
    content = (q + u.view(1, H, 1, d)) @ k.transpose(-1, -2)
    position = ((q + v.view(1, H, 1, d)).unsqueeze(3) * keys).sum(-1)
    return (content + position) / math.sqrt(d)


def rel_shift(x):
    """kimiyoung/transformer-xl _rel_shift on the last two dims: (..., T, T) with column m holding
    lag T-1-m becomes (..., T, T) with column j holding lag i-j (valid for j <= i)."""
    *lead, T, K = x.shape
    padded = torch.cat((x.new_zeros(*lead, T, 1), x), dim=-1).view(*lead, K + 1, T)
    return padded[..., 1:, :].reshape(*lead, T, K)


def test_gather_equals_rel_shift_and_direct_computation_over_lags():
    enc = build().encoding
    torch.manual_seed(0)
    B, H, T, d = 2, 4, 24, 16
    q, k = (torch.randn(B, H, T, d, dtype=torch.float64) for _ in range(2))
    u, v, w_r = enc.u.double(), enc.v.double(), enc.w_r[0].double()
    lag = torch.arange(T).view(T, 1) - torch.arange(T).view(1, T)
    causal = lag >= 0

    pos = torch.arange(T).expand(B, T)
    logits = enc.score_mod(q, k, pos, 0)(q @ k.transpose(-1, -2) / math.sqrt(d), *grid(B, H, T))
    expected = direct_logits(q, k, u, v, w_r, lag)
    torch.testing.assert_close(logits[..., causal], expected[..., causal], rtol=0, atol=1e-6)

    # the reference's trick: (b)+(d) for lags T-1..0, then the relative shift
    by_lag = (q + v.view(1, H, 1, d)) @ lag_keys(w_r, T, H).transpose(-1, -2)
    shifted = rel_shift(by_lag.flip(-1))
    gathered = by_lag.gather(-1, lag.clamp(min=0).expand(B, H, T, T))
    torch.testing.assert_close(shifted[..., causal], gathered[..., causal], rtol=0, atol=1e-6)


def test_position_terms_depend_only_on_the_lag():
    enc = build().encoding
    H, T, d = 4, 30, 16
    q = torch.randn(1, H, 1, d).expand(1, H, T, d)  # one query vector at every row
    k = torch.randn(1, H, T, d)
    zeros = torch.zeros(1, H, T, T)
    pos = torch.arange(T).view(1, T)
    terms = enc.score_mod(q, k, pos, 1)(zeros, *grid(1, H, T))  # (b) + (c) + (d)
    key_bias = (k @ enc.u.view(H, d, 1)).transpose(-1, -2) / math.sqrt(d)  # (c): j only
    position = terms - key_bias
    for lag in (0, 3, 17):
        diagonal = position.diagonal(offset=-lag, dim1=-2, dim2=-1)
        torch.testing.assert_close(diagonal, diagonal[..., :1].expand_as(diagonal),
                                   rtol=0, atol=1e-6)
    assert (position[0, 0, -1, -1] - position[0, 0, -1, 0]).abs() > 1e-3


def test_u_v_shared_by_layers_and_w_r_per_layer():
    enc = build("model.n_layer=3").encoding
    shapes = {n: tuple(p.shape) for n, p in enc.named_parameters()}
    assert shapes == {"u": (64,), "v": (64,), "w_r": (3, 64, 64)}


def test_blockwise_path_matches_dense_float64_reference(monkeypatch):
    enc = build("model.n_head=3", "model.d_model=48").encoding
    torch.manual_seed(0)
    B, H, T, d = 2, 3, 40, 16
    q, k, v = (torch.randn(B, H, T, d, dtype=torch.float64, requires_grad=True) for _ in range(3))
    pos = (torch.arange(T) * 2 + 9).expand(B, T)
    monkeypatch.setattr(attention, "BLOCK_ELEMENTS", B * H * T * 16)  # three blocks, checkpointed
    out = attend(q, k, v, pos, enc, 1)
    lag = 2 * (torch.arange(T).view(T, 1) - torch.arange(T).view(1, T))
    s = direct_logits(q, k, enc.u.double(), enc.v.double(), enc.w_r[1].double(), lag)
    ref = torch.softmax(s.masked_fill(lag < 0, float("-inf")), -1) @ v
    assert_matches_reference(out, ref, (q, k, v, enc.u, enc.v, enc.w_r))


def test_compiled_flex_attention_on_the_whole_table_matches_blockwise(monkeypatch, flex_traced):
    """The CUDA form (every row's lag table, looked up per score) run through FlexAttention on
    CPU, against the CPU form (a block's rows at a time) on the blockwise path."""
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention

    enc = build().encoding
    torch.manual_seed(0)
    B, H, T, d = 1, 4, 32, 16
    q, k, v = (torch.randn(B, H, T, d) for _ in range(3))
    pos = (torch.arange(T) + 5).expand(B, T)
    mask = create_block_mask(lambda b, h, i, j: i >= j, None, None, T, T, device="cpu")
    with torch.no_grad():  # FlexAttention has no backward on CPU
        by_block = enc.score_mod(q, k, pos, 0)
        monkeypatch.setattr(transformer_xl, "whole_table", lambda q: True)
        whole = enc.score_mod(q, k, pos, 0)
        flex = torch.compile(flex_attention, dynamic=False)(q, k, v, score_mod=whole,
                                                            block_mask=mask)
        monkeypatch.setattr(attention, "BLOCK_ELEMENTS", B * H * T * 8)  # four blocks
        torch.testing.assert_close(flex, blockwise_attention(q, k, v, by_block, additive=True),
                                   rtol=1e-5, atol=1e-5)


def test_shift_leaves_model_logits_unchanged():
    model = build()
    idx = torch.randint(0, 256, (2, 64), generator=torch.Generator().manual_seed(0))
    base = assert_shift_invariant(model, idx, per_sequence=True)
    with torch.no_grad():
        assert (model(idx, pos=torch.arange(64) * 2) - base).abs().max() > 1e-3


def test_odd_width_is_one_line_config_error():
    with pytest.raises(posbench.ConfigError, match=r"model\.d_model=33 .*even width") as err:
        posbench.compose(["encoding=transformer_xl", "model.d_model=33", "model.n_head=3"])
    assert "\n" not in str(err.value)
