"""PaTH and PaTH-FoX (docs/encodings.md#contextual-family). The oracle multiplies the dense d x d
reflections H_t = I - β_t w_t w_t^T in path order in float64, one query and one key at a time,
and computes w and β from the input with an explicit loop for the causal convolution,
independently of path.py's chunked UT transform."""
import functools
import math

import pytest
import torch

import posbench
import posbench.attention.paths as attention
import posbench.encodings.path as path_module
from posbench.attention.paths import attend
from posbench.encodings.path import path_logits

from helpers import assert_matches_reference, tiny_model
from test_attention_paths import largest_in_row_blocks

F64 = torch.float64


build = functools.partial(tiny_model, name="path")


def dense_path_logits(q, k, w, beta):
    """q_i^T H_i H_{i-1} ... H_{j+1} k_j, (B, H, T, T), -inf above the diagonal."""
    B, H, T, d = q.shape
    eye = torch.eye(d, dtype=F64)
    reflection = eye - beta[..., None, None] * w[..., :, None] * w[..., None, :]  # (B, H, T, d, d)
    rows = []
    for i in range(T):
        product, row = eye.expand(B, H, d, d), [None] * T
        for j in range(i, -1, -1):  # product = H_i ... H_{j+1}
            row[j] = (q[:, :, i, None, :] @ product @ k[:, :, j, :, None])[..., 0, 0]
            product = product @ reflection[:, :, j]
        row = [r if r is not None else torch.full((B, H), float("-inf"), dtype=F64) for r in row]
        rows.append(torch.stack(row, -1))
    return torch.stack(rows, -2)


def reflections_of(enc, x, layer):
    """w and β from x as the reference computes them, with the convolution as a loop."""
    B, T, _ = x.shape
    H, d = enc.dims.n_head, enc.dims.head_dim
    y = x @ enc.w_down[layer].T @ enc.w_up[layer].T  # (B, T, H d)
    c = enc.w_conv[layer]  # (H d, K); c[:, K-1] multiplies the current token
    K = c.shape[1]
    conv = torch.stack([sum(c[:, s] * y[:, t - K + 1 + s] for s in range(K) if t - K + 1 + s >= 0)
                        for t in range(T)], 1)
    y = torch.nn.functional.silu(conv).view(B, T, H, d).transpose(1, 2)
    w = y / torch.sqrt(y.square().sum(-1, keepdim=True) + 1e-6)
    beta = 2 * torch.sigmoid(x @ enc.beta_weight[layer].T + enc.beta_bias[layer]).transpose(1, 2)
    return w, beta


def random_path(B=2, H=3, T=37, d=8, seed=0):
    g = torch.Generator().manual_seed(seed)
    q, k, w = (torch.randn(B, H, T, d, generator=g, dtype=F64) for _ in range(3))
    w = w * torch.rand(B, H, T, 1, generator=g, dtype=F64)  # |w| <= 1, as the reference's
    beta = 2 * torch.rand(B, H, T, generator=g, dtype=F64)
    return q, k, w, beta


@pytest.mark.parametrize("chunk", [4, 8, 64])
@pytest.mark.parametrize("rows", [(0, 37), (13, 29), (36, 37)])
def test_logits_are_the_path_ordered_product_of_reflections(chunk, rows, monkeypatch):
    monkeypatch.setattr(path_module, "CHUNK", chunk)
    q, k, w, beta = random_path()
    expected = dense_path_logits(q, k, w, beta)
    got = path_logits(q, k, w, beta, torch.arange(*rows))
    i, j = torch.arange(*rows).view(-1, 1), torch.arange(37).view(1, -1)
    causal = (j <= i).expand_as(got)
    torch.testing.assert_close(got[causal], expected[:, :, rows[0]:rows[1]][causal], rtol=1e-10,
                               atol=1e-10)


def test_a_constant_reflection_is_a_function_of_the_lag():
    """w_t = w, β_t = β for every token: the path product is H^(i-j), the one case where PaTH
    obeys the relative law (H is then one element of a cyclic semigroup)."""
    q, k, w, beta = random_path(B=1, H=1, T=20)
    w = w[:, :, :1].expand_as(w).contiguous()
    beta = beta[:, :, :1].expand_as(beta).contiguous()
    got = path_logits(q, k, w, beta, torch.arange(20))[0, 0]
    H = torch.eye(8, dtype=F64) - beta[0, 0, 0] * torch.outer(w[0, 0, 0], w[0, 0, 0])
    for i in range(20):
        for j in range(i + 1):
            expected = q[0, 0, i] @ torch.linalg.matrix_power(H, i - j) @ k[0, 0, j]
            assert abs(got[i, j] - expected) < 1e-10, (i, j)


def test_reflections_are_read_from_the_input_through_a_causal_convolution():
    enc = build().encoding.double()
    with torch.no_grad():
        for p in enc.parameters():
            p.normal_(0, 0.3)
    x = torch.randn(2, 12, 64, dtype=F64, generator=torch.Generator().manual_seed(1))
    w, beta = enc.reflections(x, 1)
    ref_w, ref_beta = reflections_of(enc, x, 1)
    torch.testing.assert_close(w, ref_w, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(beta, ref_beta, rtol=1e-12, atol=1e-12)
    assert (beta > 0).all() and (beta < 2).all() and (w.norm(dim=-1) <= 1).all()
    moved = x.clone()
    moved[:, 5] += 1.0  # token 5 reaches w_5, w_6, w_7 (kernel 3) and β_5 only
    w2, beta2 = enc.reflections(moved, 1)
    changed_w = (w2 - w).abs().amax((0, 1, 3)) > 1e-12
    changed_beta = (beta2 - beta).abs().amax((0, 1)) > 1e-12
    assert changed_w.nonzero().flatten().tolist() == [5, 6, 7]
    assert changed_beta.nonzero().flatten().tolist() == [5]


@pytest.mark.parametrize("name", ["path", "path_fox"])
def test_beta_zero_leaves_every_key_alone(name):
    """β = 0 makes every H_t the identity: PaTH is NoPE, PaTH-FoX is FoX with its gate's sum
    divided by sqrt(d) as the rest of the logit."""
    model, nope = build(name=name, seed=1), build(name="nope", seed=2)
    model.load_state_dict(nope.state_dict(), strict=False)
    idx = torch.randint(0, 64, (2, 50), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        model.encoding.beta_weight.zero_()
        model.encoding.beta_bias.fill_(-1e4)  # 2σ(-10^4) = 0
        if name == "path":
            err = (model(idx) - nope(idx)).abs().max().item()
            assert err < 1e-5, err
        else:
            assert (model(idx) - nope(idx)).abs().max() > 1e-3  # the gate acts
            model.encoding.forget.gate_bias.fill_(1e4)  # log σ(10^4) = 0: no forgetting
            err = (model(idx) - nope(idx)).abs().max().item()
            assert err < 1e-5, err
        model.encoding.beta_bias.fill_(0.0)
        assert (model(idx) - nope(idx)).abs().max() > 1e-3  # the reflections act once β > 0


@pytest.mark.parametrize("name", ["path", "path_fox"])
def test_blockwise_path_matches_dense_float64_reference(name, monkeypatch):
    """Forward and gradients (q, k, v, x and every parameter) over several checkpointed blocks
    of rows and several chunks, against softmax((dense path logits + gate sum) / sqrt(d)) v."""
    monkeypatch.setattr(path_module, "CHUNK", 8)
    enc = build(name=name).encoding.double()
    with torch.no_grad():
        for p in enc.parameters():
            p.normal_(0, 0.3)
    B, H, T, d = 2, 4, 30, 16
    monkeypatch.setattr(attention, "BLOCK_ELEMENTS", B * H * T * 16)  # rows of 16
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(B, H, T, d, generator=g, dtype=F64, requires_grad=True)
               for _ in range(3))
    x = torch.randn(B, T, 64, generator=g, dtype=F64, requires_grad=True)
    out = attend(q, k, v, torch.arange(T).expand(B, T), enc, 1, x)

    w, beta = reflections_of(enc, x, 1)
    logits = dense_path_logits(q, k, w, beta)
    if name == "path_fox":
        log_f = torch.nn.functional.logsigmoid(x @ enc.forget.gate_weight[1].T
                                               + enc.forget.gate_bias[1])  # (B, T, H)
        i, j, l_ = (torch.arange(T).view(T, 1, 1), torch.arange(T).view(1, T, 1),
                    torch.arange(T))
        between = ((l_ > j) & (l_ <= i)).double()
        logits = logits + torch.einsum("ijl,blh->bhij", between, log_f)
    ref = torch.softmax(logits / math.sqrt(d), -1) @ v
    assert_matches_reference(out, ref, (q, k, v, x, *enc.parameters()), rtol=1e-9, atol=1e-10,
                             grad_rtol=1e-8, grad_atol=1e-9)


def test_memory_grows_with_length_not_its_square(monkeypatch):
    """At T = 1024 in blocks of 64 rows no tensor holds more than one block's scores or the chunk
    tables, T x (CHUNK + d) per head: both grow with T, where the whole logits hold T^2."""
    n, H, d = 1024, 4, 16
    largest, block = largest_in_row_blocks(monkeypatch, build(name="path_fox").encoding, n=n,
                                           H=H, d=d)
    assert block <= largest <= H * n * (path_module.CHUNK + d) < H * n * n / 8


def test_parameters_per_layer_with_the_reference_init_and_they_learn():
    enc = build("model.n_layer=3", "model.n_head=8", "model.d_model=256").encoding
    assert enc.w_down.shape == (3, 32, 256) and enc.w_up.shape == (3, 256, 32)
    assert enc.w_conv.shape == (3, 256, 3) and enc.beta_weight.shape == (3, 8, 256)
    for p in (enc.w_down, enc.w_up, enc.w_conv, enc.beta_weight):
        assert p.detach().double().std() == pytest.approx(0.02, rel=0.05)
    assert torch.equal(enc.beta_bias.detach(), torch.zeros(3, 8))  # β starts near 1
    assert enc.forget is None and build(name="path_fox").encoding.forget is not None
    model = build(name="path_fox")
    model.train()
    idx = torch.randint(0, 64, (2, 40), generator=torch.Generator().manual_seed(0))
    model(idx).logsumexp(-1).mean().backward()
    for name, p in model.encoding.named_parameters():
        assert p.grad is not None and p.grad.abs().sum() > 0, name


@pytest.mark.parametrize("override,key", [
    ("encoding.w_rank=0", "encoding.w_rank=0"),
    ("encoding.conv_size=0", "encoding.conv_size=0"),
    ("encoding.init_std=-1", "encoding.init_std=-1.0"),
])
def test_out_of_range_values_are_rejected_in_one_line(override, key):
    with pytest.raises(posbench.ConfigError) as err:
        posbench.compose(["encoding=path", override])
    message = str(err.value)
    assert message.startswith(key + " is not accepted; expected") and "\n" not in message
