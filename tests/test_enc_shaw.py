"""Shaw et al. relative keys and values (docs/encodings.md#bias-family)."""
import math

import pytest
import torch

import posbench
import posbench.attention.paths as attention
from posbench.attention.paths import attend

from helpers import assert_matches_reference, assert_shift_invariant


def build(*extra):
    cfg = posbench.compose(["encoding=shaw", "model.n_layer=2", "model.d_model=64",
                            "model.n_head=4", *extra])
    torch.manual_seed(0)
    model = posbench.build_model(cfg).eval()
    with torch.no_grad():  # vectors of trained size, so that position effects are visible
        for p in model.encoding.parameters():
            p.normal_()
    return model


def idx_grid(B, H, Tq, Tk, start=0):
    return (torch.arange(B).view(B, 1, 1, 1), torch.arange(H).view(1, H, 1, 1),
            torch.arange(start, start + Tq).view(1, 1, Tq, 1), torch.arange(Tk).view(1, 1, 1, Tk))


def test_positional_terms_are_equal_beyond_the_clip():
    enc = build("encoding.k=4").encoding
    H, d = 4, 16
    # one query at position 200 and keys at lags k+100, k+1, k-1, k-2, 0
    pos = torch.tensor([[96, 195, 197, 198, 200]])
    q = torch.randn(1, H, 5, d)
    keys = enc.score_mod(q, None, pos, 1)(torch.zeros(1, H, 5, 5), *idx_grid(1, H, 5, 5))[0, :, -1]
    torch.testing.assert_close(keys[:, 0], keys[:, 1], rtol=0, atol=0)  # lags 104 and 5
    assert (keys[:, 1] - keys[:, 2]).abs().min() > 1e-3  # lags 5 (clipped to 4) and 3 differ
    assert (keys[:, 2] - keys[:, 3]).abs().min() > 1e-3  # lags 3 and 2
    w_k = enc.w_k[1]
    torch.testing.assert_close(keys[:, 0], (q[0, :, -1] * w_k[:, 4]).sum(-1) / math.sqrt(d))

    onehot = torch.eye(5)[[0, 1]].view(1, 1, 2, 5).expand(1, H, 2, 5)  # two rows: mass on key 0, 1
    pos2 = torch.tensor([[96, 195, 200, 200, 200]])  # both rows read from a query at position 200
    values = enc.value_mod(onehot, pos2, 1, q_idx=torch.tensor([2, 3]).view(1, 1, 2, 1),
                           kv_idx=torch.arange(5).view(1, 1, 1, 5))
    torch.testing.assert_close(values[0, :, 0], values[0, :, 1], rtol=0, atol=0)


def test_one_hot_attention_returns_value_plus_its_lag_vector():
    enc = build("encoding.k=3").encoding
    B, H, T, d = 1, 4, 9, 16
    pos = torch.arange(T).view(1, T) + 50
    v = torch.randn(B, H, T, d)
    js = torch.tensor([0, 1, 1, 3, 2, 5, 6, 2, 8])  # the key each query attends to, j <= i
    probs = torch.nn.functional.one_hot(js, T).float().expand(B, H, T, T)
    _, _, q_idx, kv_idx = idx_grid(B, H, T, T)
    z = probs @ v + enc.value_mod(probs, pos, 0, q_idx=q_idx, kv_idx=kv_idx)
    for i, j in enumerate(js.tolist()):
        expected = v[0, :, j] + enc.w_v[0, :, min(i - j, 3)]
        torch.testing.assert_close(z[0, :, i], expected, rtol=1e-6, atol=1e-6)


def dense_reference(q, k, v, w_k, w_v, lag, clip):
    """Logits and outputs of 4.2 with the full a^K_ij, a^V_ij tensors (H, T, T, d)."""
    T, d = q.shape[2], q.shape[3]
    a_k = w_k[:, lag.clamp(0, clip)]
    a_v = w_v[:, lag.clamp(0, clip)]
    e = (q.unsqueeze(3) * (k.unsqueeze(2) + a_k)).sum(-1) / math.sqrt(d)
    future = torch.ones(T, T, dtype=torch.bool).triu(1)
    alpha = torch.softmax(e.masked_fill(future, float("-inf")), -1)
    return alpha @ v + (alpha.unsqueeze(-1) * a_v).sum(-2)


@pytest.mark.parametrize("share_heads,share_layers", [(False, False), (True, False), (True, True)])
def test_blockwise_path_matches_dense_float64_reference(share_heads, share_layers, monkeypatch):
    enc = build("model.n_head=3", "model.d_model=48", "encoding.k=5",
                f"encoding.share_heads={share_heads}",
                f"encoding.share_layers={share_layers}").encoding
    torch.manual_seed(0)
    B, H, T, d = 2, 3, 40, 16
    q, k, v = (torch.randn(B, H, T, d, dtype=torch.float64, requires_grad=True) for _ in range(3))
    pos = (torch.arange(T) * 2 + 3).expand(B, T)  # lag 2(i-j): clipped beyond i-j = 2
    monkeypatch.setattr(attention, "BLOCK_ELEMENTS", B * H * T * 16)  # three blocks, checkpointed
    out = attend(q, k, v, pos, enc, 1)
    lag = 2 * (torch.arange(T).view(T, 1) - torch.arange(T).view(1, T))
    table = 0 if share_layers else 1  # layer 1 reads the one table when the layers share it
    ref = dense_reference(q, k, v, enc.w_k[table].double(), enc.w_v[table].double(), lag, 5)
    assert_matches_reference(out, ref, (q, k, v, enc.w_k, enc.w_v))


def test_flags_change_the_parameters_and_hooks():
    full = build().encoding
    assert full.w_k.shape == full.w_v.shape == (2, 4, 17, 16) and full.value_mod is not None
    lean = build("encoding.values=false", "encoding.share_heads=true").encoding
    assert [n for n, _ in lean.named_parameters()] == ["w_k"] and lean.w_k.shape == (2, 1, 17, 16)
    assert lean.value_mod is None
    shared = build("encoding.share_layers=true").encoding
    assert shared.w_k.shape == shared.w_v.shape == (1, 4, 17, 16)


@pytest.mark.parametrize("values", [True, False])
def test_shift_leaves_model_logits_unchanged(values):
    model = build(f"encoding.values={values}")
    idx = torch.randint(0, 256, (2, 64), generator=torch.Generator().manual_seed(0))
    base = assert_shift_invariant(model, idx)
    with torch.no_grad():
        assert (model(idx, pos=torch.arange(64) * 2) - base).abs().max() > 1e-3


def test_clip_below_one_is_one_line_config_error():
    with pytest.raises(posbench.ConfigError, match=r"encoding\.k=0 .*integer >= 1") as err:
        posbench.compose(["encoding=shaw", "encoding.k=0"])
    assert "\n" not in str(err.value)
