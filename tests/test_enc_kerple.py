"""KERPLE log and power (docs/encodings.md#bias-family)."""
import gc
import math

import pytest
import torch

import posbench
import posbench.attention.paths as attention
from posbench.attention.paths import attend

from helpers import assert_matches_reference, assert_shift_invariant


def build(kernel, *extra):
    cfg = posbench.compose([f"encoding=kerple_{kernel}", "model.n_layer=2", "model.d_model=64",
                            "model.n_head=4", *extra])
    torch.manual_seed(0)
    return posbench.build_model(cfg).eval()


def bias_rows(enc, lags, layer=0):
    """bias[h, n] at lag lags[n], read through the score_mod (query at the largest position)."""
    top = int(lags.max())
    pos = (top - lags.flip(0)).view(1, -1)  # increasing positions; last query sees every lag
    T, H = pos.shape[1], enc.dims.n_head
    fn = enc.score_mod(None, None, pos, layer)
    out = fn(torch.zeros(1, H, 1, T), torch.zeros(1, 1, 1, 1, dtype=torch.long),
             torch.arange(H).view(1, H, 1, 1), torch.full((1, 1, 1, 1), T - 1),
             torch.arange(T).view(1, 1, 1, T))
    return out[0, :, 0].flip(-1)


def positions(strides, T, offset):
    """(B, T) positions offset + stride_b * t: one row expanded when the strides agree (the
    usual shared row), else one row per sequence."""
    pos = torch.arange(T) * torch.tensor(strides).view(-1, 1) + offset
    return pos[:1].expand(len(strides), T) if len(set(strides)) == 1 else pos


@pytest.mark.parametrize("kernel", ["log", "power"])
def test_bias_is_zero_at_lag_zero_and_non_increasing(kernel):
    enc = build(kernel).encoding
    with torch.no_grad():  # cover the edges of the allowed range too
        enc.r1.copy_(torch.tensor([0.01, 0.5, 2.0, 7.0]))
        enc.r2.copy_(torch.tensor([0.01, 0.3, 1.0, 2.0]))
    lags = torch.arange(0, 3000)
    bias = bias_rows(enc, lags)
    assert torch.equal(bias[:, 0], torch.zeros(4))
    assert (bias[:, 1:] - bias[:, :-1] <= 0).all()
    assert (bias[:, 1:] < 0).all()
    r1, r2 = enc.r1[2].item(), enc.r2[2].item()
    expected = -r1 * (math.log(1 + r2 * 1000) if kernel == "log" else 1000 ** r2)
    assert bias[2, 1000].item() == pytest.approx(expected, rel=1e-6)


@pytest.mark.parametrize("kernel,r1_hi,r2_hi", [("log", 2.0, 1.0), ("power", 1.0, 2.0)])
def test_init_ranges_and_parameters_shared_by_layers(kernel, r1_hi, r2_hi):
    enc = build(kernel, "model.n_head=64", "model.d_model=128").encoding
    assert sum(p.numel() for p in enc.parameters()) == 2 * 64
    assert 0.01 <= enc.r1.min() and enc.r1.max() <= r1_hi and enc.r1.max() > r1_hi / 2
    assert 0.01 <= enc.r2.min() and enc.r2.max() <= r2_hi and enc.r2.max() > r2_hi / 2
    lags = torch.arange(50)
    assert torch.equal(bias_rows(enc, lags, layer=0), bias_rows(enc, lags, layer=1))


@pytest.mark.parametrize("kernel", ["log", "power"])
@pytest.mark.parametrize("opt", [torch.optim.SGD, torch.optim.AdamW])
def test_clamps_hold_after_a_step_with_huge_gradients(kernel, opt):
    for sign in (1.0, -1.0):  # +: pushes r1, r2 far below 0.01; -: pushes them far up
        model = build(kernel)
        enc = model.encoding
        optimizer = opt(model.parameters(), lr=10.0)
        enc.r1.grad = torch.full_like(enc.r1, sign * 1e9)
        enc.r2.grad = torch.full_like(enc.r2, sign * 1e9)
        optimizer.step()
        assert (enc.r1 >= 0.01).all() and (enc.r2 >= 0.01).all()
        if sign > 0:
            assert torch.equal(enc.r1.detach(), torch.full((4,), 0.01))
        if kernel == "power":
            assert (enc.r2 <= 2.0).all()
        if kernel == "power" and sign < 0:
            assert torch.equal(enc.r2.detach(), torch.full((4,), 2.0))
        if kernel == "log" and sign < 0:
            assert (enc.r2 > 2.0).all()  # log has no upper bound


@pytest.mark.parametrize("kernel", ["log", "power"])
def test_values_set_out_of_range_by_hand_still_give_the_clamped_kernel(kernel):
    model = build(kernel)
    idx = torch.randint(0, 256, (1, 64), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        model.encoding.r1.fill_(0.01)
        model.encoding.r2.fill_(0.01)
        at_bound = model(idx)
        model.encoding.r1.fill_(-3.0)
        model.encoding.r2.fill_(-0.5)  # log1p(-0.5 * lag) would be NaN
        torch.testing.assert_close(model(idx), at_bound, rtol=0, atol=0)


def test_a_parameter_at_its_bound_still_gets_gradient():
    enc = build("power").encoding
    with torch.no_grad():
        enc.r1.fill_(0.01)
        enc.r2.fill_(2.0)
    lags = torch.arange(1, 20)
    bias_rows(enc, lags).sum().backward()
    assert (enc.r1.grad != 0).all() and (enc.r2.grad != 0).all()


def test_step_hook_goes_away_with_the_model():
    from torch.optim.optimizer import _global_optimizer_post_hooks as hooks

    gc.collect()  # models of earlier tests
    before = len(hooks)
    model = build("log")
    assert len(hooks) == before + 1
    del model
    gc.collect()
    assert len(hooks) == before


@pytest.mark.parametrize("kernel,strides", [("log", (2, 2)), ("power", (2, 2)), ("power", (2, 3))])
def test_blockwise_path_matches_dense_float64_reference(kernel, strides, monkeypatch):
    torch.manual_seed(0)
    enc = build(kernel, "model.n_head=3", "model.d_model=48").encoding
    B, H, T, d = 2, 3, 40, 16
    q, k, v = (torch.randn(B, H, T, d, dtype=torch.float64, requires_grad=True) for _ in range(3))
    pos = positions(strides, T, 7)
    monkeypatch.setattr(attention, "BLOCK_ELEMENTS", B * H * T * 16)  # three blocks, checkpointed
    out = attend(q, k, v, pos, enc, 1)

    i, j = torch.arange(T).view(T, 1), torch.arange(T).view(1, T)
    lag = (torch.tensor(strides).view(B, 1, 1, 1) * (i - j)).clamp(min=0).double()
    r1, r2 = enc.r1.double().view(H, 1, 1), enc.r2.double().view(H, 1, 1)
    bias = -r1 * (torch.log(1 + r2 * lag) if kernel == "log" else lag ** r2)
    s = q @ k.transpose(-1, -2) / math.sqrt(d) + bias
    ref = torch.softmax(s.masked_fill(j > i, float("-inf")), -1) @ v
    grads = assert_matches_reference(out, ref, (q, k, v, enc.r1, enc.r2))
    assert all(torch.isfinite(g).all() for g in grads)


@pytest.mark.parametrize("kernel", ["log", "power"])
def test_shift_leaves_model_logits_unchanged(kernel):
    model = build(kernel)
    idx = torch.randint(0, 256, (2, 64), generator=torch.Generator().manual_seed(0))
    base = assert_shift_invariant(model, idx)
    with torch.no_grad():
        assert not torch.allclose(model(idx, pos=torch.arange(64) * 2), base, atol=1e-3)


def test_unknown_kernel_is_one_line_config_error():
    match = r"encoding\.kernel='cubic' .*'log', 'power'"
    with pytest.raises(posbench.ConfigError, match=match) as err:
        posbench.compose(["encoding=kerple_log", "encoding.kernel=cubic"])
    assert "\n" not in str(err.value)
