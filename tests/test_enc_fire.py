"""FIRE (docs/encodings.md): MLP of psi(lag) / psi(max(L_thr, span)), one per layer."""
import math

import pytest
import torch

import posbench
import posbench.attention.paths as attention
import posbench.attention.lag_bias as lag_bias
from posbench.attention.paths import attend, blockwise_attention

from helpers import assert_matches_reference, assert_shift_invariant


def build(*extra):
    cfg = posbench.compose(["encoding=fire", "model.n_layer=2", "model.d_model=64",
                            "model.n_head=4", *extra])
    torch.manual_seed(0)
    return posbench.build_model(cfg).eval()


def grid(B, H, T):
    return (torch.arange(B).view(B, 1, 1, 1), torch.arange(H).view(1, H, 1, 1),
            torch.arange(T).view(1, 1, T, 1), torch.arange(T).view(1, 1, 1, T))


def reference_bias(mlp, lag, span, init_L):
    """FIRE as the port in mcleish7/arithmetic writes it: (..., H) from float64 lag and span."""
    c, thr = mlp.c.double(), (mlp.l_mult.double() * init_L).abs()
    rel = torch.log(torch.abs(c * lag) + 1)
    norm = torch.log(torch.abs(c * torch.maximum(span, thr)) + 1)
    x = (rel / (norm + 1e-6)).unsqueeze(-1)
    hidden = torch.relu(x * mlp.w1.double().T + mlp.b1.double())
    return hidden @ mlp.w2.double().T + mlp.b2.double()


def test_mlp_input_is_in_unit_interval_at_any_length(monkeypatch):
    enc = build("encoding.init_L=512").encoding
    mlp = enc.mlps[0]
    seen = []
    forward = mlp.forward
    monkeypatch.setattr(mlp, "forward", lambda x, h: seen.append(x) or forward(x, h))
    pos = torch.cat([torch.arange(0, 200), torch.arange(200, 100001, 997)]).view(1, -1)
    T = pos.shape[1]  # lags and spans up to 1e5
    causal = torch.ones(T, T, dtype=torch.bool).tril()
    for c in (0.1, 3.0, -0.5):  # learned: any sign
        for threshold in (512.0, 5.0, 0.01):
            with torch.no_grad():
                mlp.c.fill_(c)
                mlp.l_mult.fill_(-threshold / 512)  # L_thr = |L_mult * 512|
            enc.score_mod(None, None, pos, 0)(torch.zeros(1, 4, T, T), *grid(1, 4, T))
            x = seen.pop()[0, 0]
            assert x[causal].min() >= 0 and x[causal].max() <= 1, (c, threshold)
            # progressive interpolation: a long query's largest lag (to position 0) maps to 1
            # up to eps
            long = pos[0] > max(threshold, 100)
            torch.testing.assert_close(x[long, 0], torch.ones(int(long.sum())), rtol=0, atol=1e-5)


@pytest.mark.parametrize("threshold", ["encoding.init_L=16", "train.seq_len=16"])
def test_bias_depends_on_lag_alone_below_the_threshold_and_on_the_span_beyond(threshold):
    # L_thr = 16, set directly or, by default, the training length
    enc = build(threshold).encoding
    H, T = 4, 64
    pos = torch.arange(T).view(1, T)
    bias = enc.score_mod(None, None, pos, 0)(torch.zeros(1, H, T, T), *grid(1, H, T))[0]
    lag3 = bias.diagonal(offset=-3, dim1=-2, dim2=-1)  # queries 3..63 at lag 3
    # queries with span <= 16 share one absolute scale
    torch.testing.assert_close(lag3[:, :14], lag3[:, :1].expand(H, 14), rtol=0, atol=1e-6)
    # beyond, the lag is divided by the query's own span: interpolation, by design not a
    # function of the lag alone
    assert (lag3[:, 17] - lag3[:, 0]).abs().max() > 1e-3
    assert (lag3[:, 60] - lag3[:, 17]).abs().max() > 1e-3


@pytest.mark.parametrize("shared", [True, False])
def test_blockwise_path_matches_dense_float64_reference(shared, monkeypatch):
    enc = build("model.n_head=3", "model.d_model=48", "encoding.init_L=20").encoding
    torch.manual_seed(0)
    B, H, T, d = 2, 3, 40, 16
    q, k, v = (torch.randn(B, H, T, d, dtype=torch.float64, requires_grad=True) for _ in range(3))
    # spans cross L_thr = 20; one position row for the batch, or one per sequence
    stride = torch.tensor([2, 2]) if shared else torch.tensor([2, 3])
    pos = torch.arange(T) * stride.view(B, 1) + 7
    if shared:
        pos = pos[:1].expand(B, T)
    monkeypatch.setattr(attention, "BLOCK_ELEMENTS", B * H * T * 16)  # three blocks, checkpointed
    out = attend(q, k, v, pos, enc, 1)
    ref = reference_attention(q, k, v, enc.mlps[1], stride, 20.0)
    assert_matches_reference(out, ref, (q, k, v, *enc.mlps[1].parameters()))


def reference_attention(q, k, v, mlp, stride, init_L):
    """Causal attention under reference_bias, positions stride * i + 7 per sequence."""
    T = q.shape[2]
    i, j = torch.arange(T).view(T, 1).double(), torch.arange(T).view(1, T).double()
    step = stride.view(-1, 1, 1).double()
    bias = reference_bias(mlp, step * (i - j), step * i, init_L).permute(0, 3, 1, 2)
    s = q @ k.transpose(-1, -2) / math.sqrt(q.shape[-1]) + bias
    return torch.softmax(s.masked_fill(j > i, float("-inf")), -1) @ v


@pytest.mark.parametrize("shared, steps", [(True, [1, 1]), (False, [1, 1]), (True, [2, 2]),
                                           (False, [2, 3])])
def test_evaluation_reads_f_from_its_lines(shared, steps, monkeypatch):
    """Without a gradient, the CPU path evaluates f as the line it is between its breakpoints
    (FireMLP.lines), never unit by unit: the same attention as the float64 reference, with a
    unit that never bends (w1 = 0) and breakpoints inside and outside the range of x; by query
    row and lag (lag_rows) where positions step by one, else through the score_mod."""
    enc = build("model.n_head=3", "model.d_model=48", "encoding.init_L=20").encoding.double()
    mlp = enc.mlps[1]
    with torch.no_grad():
        mlp.w1[:3, 0] = torch.tensor([0.0, 1.0, 1.0])
        mlp.b1[1:3] = torch.tensor([-0.5, 3.0])  # bends at x = 0.5, and at -3 (always on)
    monkeypatch.setattr(type(mlp), "forward", lambda *args: pytest.fail("f unit by unit"))
    B, H, T, d = 2, 3, 40, 16
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(B, H, T, d, generator=g, dtype=torch.float64) for _ in range(3))
    stride = torch.tensor(steps)
    pos = torch.arange(T) * stride.view(B, 1) + torch.tensor([[7], [7 if shared else 1000]])
    if shared:
        pos = pos[:1].expand(B, T)
    monkeypatch.setattr(attention, "BLOCK_ELEMENTS", B * H * T * 16)  # three blocks
    monkeypatch.setattr(lag_bias, "ROWS", 16)
    with torch.no_grad():
        out = attend(q, k, v, pos, enc, 1)
    torch.testing.assert_close(out, reference_attention(q, k, v, mlp, stride, 20.0),
                               rtol=1e-10, atol=1e-10)


def test_compiled_flex_attention_matches_blockwise(flex_traced):
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention

    enc = build("encoding.width=4", "encoding.init_L=8").encoding
    torch.manual_seed(0)
    B, H, T, d = 1, 4, 32, 16
    q, k, v = (torch.randn(B, H, T, d) for _ in range(3))
    pos = (torch.arange(T) + 3).expand(B, T)
    mask = create_block_mask(lambda b, h, i, j: i >= j, None, None, T, T, device="cpu")
    with torch.no_grad():  # FlexAttention has no backward on CPU
        fn = enc.score_mod(q, k, pos, 0)
        flex = torch.compile(flex_attention, dynamic=False)(q, k, v, score_mod=fn, block_mask=mask)
        torch.testing.assert_close(flex, blockwise_attention(q, k, v, fn), rtol=1e-5, atol=1e-5)


def test_shift_leaves_model_logits_unchanged_even_past_the_threshold():
    model = build()
    idx = torch.randint(0, 256, (2, 64), generator=torch.Generator().manual_seed(0))
    # 1000 puts every position past L_thr = 512
    base = assert_shift_invariant(model, idx, per_sequence=True)
    with torch.no_grad():
        assert (model(idx, pos=torch.arange(64) * 2) - base).abs().max() > 1e-4


def test_prefix_logits_do_not_depend_on_the_length():
    model = build("encoding.init_L=8")  # spans cross L_thr inside the prefix
    idx = torch.randint(0, 256, (1, 80), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        torch.testing.assert_close(model(idx[:, :30]), model(idx)[:, :30], rtol=1e-5, atol=1e-5)


def test_one_module_per_layer_with_reference_init():
    enc = build("model.n_layer=3").encoding
    assert len(enc.mlps) == 3
    assert enc.mlps[0].w1.data_ptr() != enc.mlps[1].w1.data_ptr()
    for mlp in enc.mlps:
        assert mlp.c.item() == pytest.approx(0.1) and mlp.l_mult.item() == 1.0
        assert mlp.w1.shape == (32, 1) and mlp.w2.shape == (4, 32)
        assert mlp.w1.abs().max() <= 1 and mlp.w2.abs().max() <= 1 / math.sqrt(32)


@pytest.mark.parametrize("key,value,accepted", [("width", "0", "integer >= 1"),
                                                ("init_c", "0.0", "number > 0"),
                                                ("init_L", "-512.0", "number > 0")])
def test_out_of_range_values_are_one_line_config_errors(key, value, accepted):
    with pytest.raises(posbench.ConfigError, match=rf"encoding\.{key}={value} .*{accepted}") as err:
        posbench.compose(["encoding=fire", f"encoding.{key}={value}"])
    assert "\n" not in str(err.value)
