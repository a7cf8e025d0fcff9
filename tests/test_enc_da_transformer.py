"""DA-Transformer (docs/encodings.md#contextual-family): ReLU(q.k) times a sigmoid of |lag|."""
import math

import pytest
import torch

import posbench
import posbench.attention.paths as attention
from posbench.attention.paths import attend
from posbench.encodings.da_transformer import distance_rescale

from helpers import assert_matches_reference, assert_shift_invariant


def build(*extra):
    cfg = posbench.compose(["encoding=da_transformer", "model.n_layer=2", "model.d_model=64",
                            "model.n_head=4", *extra])
    torch.manual_seed(0)
    model = posbench.build_model(cfg).eval()
    with torch.no_grad():  # trained-looking slopes and offsets of both signs
        for w, v in zip(model.encoding.w, model.encoding.v):
            w.copy_(torch.tensor([0.3, -0.2, 0.05, -1.0]))
            v.copy_(torch.tensor([0.0, 1.5, -2.0, 0.7]))
    return model


def positions(strides, T, offset):
    """(B, T) positions offset + stride_b * t: one row expanded when the strides agree (the
    usual shared row), else one row per sequence."""
    pos = torch.arange(T) * torch.tensor(strides).view(-1, 1) + offset
    return pos[:1].expand(len(strides), T) if len(set(strides)) == 1 else pos


def test_rescale_is_one_at_zero_and_strictly_between_zero_and_its_ceiling():
    v = torch.tensor([-3.0, -0.5, 0.0, 0.5, 2.0, 4.0], dtype=torch.float64).view(-1, 1)
    r = torch.linspace(-30, 30, 601, dtype=torch.float64).view(1, -1)
    rescale = distance_rescale(r, v)
    torch.testing.assert_close(distance_rescale(torch.zeros_like(v), v), torch.ones_like(v),
                               rtol=0, atol=1e-15)
    assert (rescale > 0).all() and (rescale < 1 + v.exp()).all()
    torch.testing.assert_close(rescale, (1 + v.exp()) / (1 + torch.exp(v - r)), rtol=1e-12, atol=0)
    # w > 0 rises toward 1 + e^v (long-range head), w < 0 decays toward 0 (local head)
    assert (rescale.diff(dim=-1) > 0).all()
    assert (rescale[:, -1] > 0.99 * (1 + v.exp().flatten())).all() and (rescale[:, 0] < 1e-10).all()


def test_unmasked_logits_are_nonnegative_and_zero_where_qk_is_negative():
    enc = build().encoding
    T, H = 30, 4
    pos = torch.arange(T).view(1, T)
    fn = enc.score_mod(None, None, pos, 0)
    score = torch.randn(1, H, T, T, generator=torch.Generator().manual_seed(0)) * 3
    out = fn(score, torch.zeros(1, 1, 1, 1, dtype=torch.long), torch.arange(H).view(1, H, 1, 1),
             torch.arange(T).view(1, 1, T, 1), torch.arange(T).view(1, 1, 1, T))
    assert (out >= 0).all()
    assert torch.equal(out[score <= 0], torch.zeros(int((score <= 0).sum())))
    # at lag 0 the rescale is 1: the logit is ReLU(q.k)/sqrt(d) itself
    diag = torch.arange(T)
    torch.testing.assert_close(out[..., diag, diag], score.relu()[..., diag, diag])


@pytest.mark.parametrize("strides", [(2, 2), (2, 3)])
def test_blockwise_path_matches_dense_float64_reference(strides, monkeypatch):
    torch.manual_seed(0)
    enc = build("model.n_head=4").encoding
    B, H, T, d = 2, 4, 40, 16
    q, k, v = (torch.randn(B, H, T, d, dtype=torch.float64, requires_grad=True) for _ in range(3))
    pos = positions(strides, T, 11)
    monkeypatch.setattr(attention, "BLOCK_ELEMENTS", B * H * T * 16)  # three blocks, checkpointed
    out = attend(q, k, v, pos, enc, 1)

    i, j = torch.arange(T).view(T, 1), torch.arange(T).view(1, T)
    dist = (torch.tensor(strides).view(B, 1, 1, 1) * (i - j)).abs().double()
    w, off = enc.w[1].double().view(H, 1, 1), enc.v[1].double().view(H, 1, 1)
    rescale = (1 + off.exp()) / (1 + torch.exp(off - w * dist))
    s = torch.relu(q @ k.transpose(-1, -2)) * rescale / math.sqrt(d)
    ref = torch.softmax(s.masked_fill(j > i, float("-inf")), -1) @ v
    assert_matches_reference(out, ref, (q, k, v, enc.w[1], enc.v[1]))


def test_shift_leaves_model_logits_unchanged():
    model = build()
    idx = torch.randint(0, 256, (2, 64), generator=torch.Generator().manual_seed(0))
    base = assert_shift_invariant(model, idx)
    with torch.no_grad():
        # not vacuous: other lags give other logits (small at init, but well above 1e-5)
        assert (model(idx, pos=torch.arange(64) * 2) - base).abs().max() > 2e-5


def test_parameters_are_per_layer_and_head_with_documented_init():
    cfg = posbench.compose(["encoding=da_transformer", "model.n_layer=3", "model.n_head=4"])
    torch.manual_seed(0)
    enc = posbench.build_model(cfg).encoding
    assert [tuple(p.shape) for p in enc.parameters()] == [(4,)] * 6
    assert all(torch.equal(v, torch.zeros(4)) for v in enc.v)
    assert all(0 < w.abs().max() < 0.05 for w in enc.w)
