"""DAPE and DAPE-v2 (docs/encodings.md): A + B + f([A; B]), f an MLP over the heads at each
(query, key) or two 1 x k convolutions along the keys, through the mix_heads hook."""
import math

import pytest
import torch
import torch.nn.functional as F

import posbench
import posbench.attention.paths as attention
from posbench.attention.paths import attend
from posbench.attention.span import Span
from posbench.core.errors import ConfigError
from test_attention_paths import LargestTensor

B, H, T, d = 2, 3, 24, 8


def encoding(name, *extra, n_head=H):
    cfg = posbench.compose([f"encoding={name}", "model.n_layer=2", f"model.d_model={n_head * d}",
                            f"model.n_head={n_head}", "train.seq_len=16", "eval.lengths=[256]",
                            *extra])
    torch.manual_seed(0)
    enc = posbench.build_model(cfg, 64).encoding.double()
    with torch.no_grad():  # weights large enough that f's nonlinearity matters
        for p in (enc.w1, enc.b1, enc.w2, enc.b2):
            p.mul_(3)
    return enc


def inputs(n=T, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(B, H, n, d, generator=g, dtype=torch.float64).requires_grad_()
            for _ in range(3)]


def leaky(x):
    return torch.where(x > 0, x, 0.01 * x)


def oracle_logits(enc, q, k, layer):
    """(B, H, T, T) logits of the definition, row by row and key by key in float64: A from q and
    k, B KERPLE's -r1 ln(1 + r2 lag), row i's 2H channels zero at keys past i and before 0, the
    hidden channels at keys 0..i + k//2 (zero before 0), then f's output at keys 0..i."""
    n = q.shape[2]
    A = q @ k.transpose(-2, -1) / math.sqrt(q.shape[-1])
    lag = (torch.arange(n).view(n, 1) - torch.arange(n)).clamp(min=0).double()
    r1, r2 = enc.base.r1.view(H, 1, 1), enc.base.r2.view(H, 1, 1)
    bias = (-r1 * torch.log1p(r2 * lag)).expand(B, H, n, n)
    w1, b1, w2, b2 = (w[layer] for w in (enc.w1, enc.b1, enc.w2, enc.b2))
    taps, pad = w1.shape[-1], w1.shape[-1] // 2
    out = torch.zeros(B, H, n, n, dtype=torch.float64)
    for i in range(n):
        x = torch.cat((A[:, :, i, :i + 1], bias[:, :, i, :i + 1]), 1)  # (B, 2H, i + 1)

        def x_at(j):
            return x[:, :, j] if 0 <= j <= i else torch.zeros(B, 2 * H, dtype=torch.float64)

        hidden = {j: leaky(b1 + sum(w1[:, :, 0, t] @ x_at(j + t - pad).T
                                    for t in range(taps)).T)
                  for j in range(i + pad + 1)}
        for j in range(i + 1):
            f = b2 + sum(hidden[j + t - pad] @ w2[:, :, 0, t].T
                         for t in range(taps) if j + t - pad >= 0)
            out[:, :, i, j] = A[:, :, i, j] + bias[:, :, i, j] + f
    return out


def oracle_attention(logits, v):
    n = logits.shape[-1]
    future = torch.ones(n, n, dtype=torch.bool).triu(1)
    return torch.softmax(logits.masked_fill(future, float("-inf")), -1) @ v


@pytest.mark.parametrize("layer", [0, 1])
@pytest.mark.parametrize("name", ["dape", "dape_v2"])
def test_attention_and_gradients_match_the_definition_in_float64(name, layer, monkeypatch):
    monkeypatch.setattr(attention, "BLOCK_ELEMENTS", 0)  # the fewest rows, 16: two blocks
    enc = encoding(name)
    q, k, v = inputs()
    pos = torch.arange(T).expand(B, T)
    out = attend(q, k, v, pos, enc, layer)
    ref = oracle_attention(oracle_logits(enc, q, k, layer), v)
    torch.testing.assert_close(out, ref, rtol=1e-10, atol=1e-10)
    probe = torch.randn_like(ref)
    wrt = (q, k, v, enc.w1, enc.b1, enc.w2, enc.b2, enc.base.r1, enc.base.r2)
    grads = torch.autograd.grad((out * probe).sum(), wrt)
    ref_grads = torch.autograd.grad((ref * probe).sum(), wrt)
    for g, r in zip(grads, ref_grads):
        assert r.abs().amax() > 0
        torch.testing.assert_close(g, r, rtol=1e-9, atol=1e-10)


def test_dape_v2_is_the_references_convolution_but_on_the_last_row():
    """The reference: Conv2d (1, 3), padding (0, 1), LeakyReLU, Conv2d (1, 3), padding (0, 1) on
    torch.tril of [A; B] over the whole map. It pads the hidden map past the last key with
    zeros: the last row alone differs, and widening the map by one column of zeros gives every
    row."""
    enc = encoding("dape_v2")
    q, k, _ = (x.detach() for x in inputs())
    A = q @ k.transpose(-2, -1) / math.sqrt(d)
    b, h = torch.arange(B).view(B, 1, 1, 1), torch.arange(H).view(1, H, 1, 1)
    q_idx, kv_idx = torch.arange(T).view(1, 1, T, 1), torch.arange(T).view(1, 1, 1, T)
    with torch.no_grad():
        mix, _ = enc.mix_heads(q, k, torch.arange(T).expand(B, T), 0)
        ours = mix(A, b, h, q_idx, kv_idx, kv_idx > q_idx)
        bias = enc.base.score_mod(q, k, torch.arange(T).expand(B, T), 0)(
            torch.zeros((), dtype=torch.float64), b, h, q_idx, kv_idx).expand(B, H, T, T)
        x = torch.cat((A, bias), 1).tril()

        def reference(x):
            z = F.leaky_relu(F.conv2d(x, enc.w1[0], enc.b1[0], padding=(0, 1)))
            return F.conv2d(z, enc.w2[0], enc.b2[0], padding=(0, 1))

        theirs = (A + bias + reference(x)).tril()
        widened = (A + bias + reference(F.pad(x, (0, 1)))[..., :T]).tril()
    torch.testing.assert_close(ours.tril()[:, :, :-1], theirs[:, :, :-1], rtol=1e-12, atol=1e-12)
    assert (ours[:, :, -1, -1] - theirs[:, :, -1, -1]).abs().amin() > 1e-6
    torch.testing.assert_close(ours.tril(), widened, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("span", [Span(), Span("sliding", 40), Span("chunked", 48)],
                         ids=["global", "sliding", "chunked"])
@pytest.mark.parametrize("name", ["dape", "dape_v2"])
def test_blocks_of_query_rows_equal_one_dense_block_at_16L(name, span, monkeypatch):
    """256 tokens at L = 16: the whole map in one block against blocks of 16 rows, forward and
    gradients; under a local span the blocks take only the keys in reach."""
    enc = encoding(name)
    n = 256
    q, k, v = inputs(n)
    pos = torch.arange(n).expand(B, n)
    monkeypatch.setattr(attention, "BLOCK_ELEMENTS", 1 << 30)
    dense = attend(q, k, v, pos, enc, 1, span=span)
    monkeypatch.setattr(attention, "BLOCK_ELEMENTS", B * (2 * H + 32) * n * 16)
    blocks = attend(q, k, v, pos, enc, 1, span=span)
    torch.testing.assert_close(blocks, dense, rtol=1e-10, atol=1e-10)
    probe = torch.randn_like(dense)
    wrt = (q, k, v, enc.w1, enc.w2, enc.base.r1)
    for g, r in zip(torch.autograd.grad((blocks * probe).sum(), wrt),
                    torch.autograd.grad((dense * probe).sum(), wrt)):
        torch.testing.assert_close(g, r, rtol=1e-9, atol=1e-10)


@pytest.mark.parametrize("name", ["dape", "dape_v2"])
def test_memory_grows_with_length_not_its_square(name, monkeypatch):
    """At 2048 tokens no tensor holds more than a block's worth, 2^21 values, where the hidden
    channels over the whole map would hold 2^27: the blocks are sized by f's channels."""
    enc = encoding(name).float()
    n, block = 2048, 1 << 21
    monkeypatch.setattr(attention, "BLOCK_ELEMENTS", block)
    q, k, v = (torch.randn(1, H, n, d) for _ in range(3))
    with LargestTensor() as largest, torch.no_grad():
        attend(q, k, v, torch.arange(n).expand(1, n), enc, 0)
    assert largest.numel <= block


@pytest.mark.parametrize("name", ["dape", "dape_v2"])
def test_logits_of_future_keys_reach_no_earlier_key(name):
    """Whatever the logits and bias at keys a query does not see, f gives the same at the keys it
    sees; a change at a seen key (v2: beside it) does change them."""
    enc = encoding(name)
    q, k, _ = (x.detach() for x in inputs())
    A = q @ k.transpose(-2, -1) / math.sqrt(d)
    b, h = torch.arange(B).view(B, 1, 1, 1), torch.arange(H).view(1, H, 1, 1)
    q_idx, kv_idx = torch.arange(T).view(1, 1, T, 1), torch.arange(T).view(1, 1, 1, T)
    future = kv_idx > q_idx
    with torch.no_grad():
        mix, _ = enc.mix_heads(q, k, torch.arange(T).expand(B, T), 0)
        base = mix(A, b, h, q_idx, kv_idx, future)
        noisy = mix(A + 1e3 * torch.randn_like(A) * future, b, h, q_idx, kv_idx, future)
        seen = mix(A + 1.0 * (kv_idx == q_idx), b, h, q_idx, kv_idx, future)
    torch.testing.assert_close(noisy.masked_fill(future, 0), base.masked_fill(future, 0),
                               rtol=0, atol=0)
    moved = (seen - base).masked_fill(future, 0).abs() > 1e-9
    assert moved.diagonal(dim1=-2, dim2=-1).all()
    assert moved.diagonal(offset=-1, dim1=-2, dim2=-1).all() == (name == "dape_v2")


@pytest.mark.parametrize("base", ["kerple_log", "alibi", "fire"])
@pytest.mark.parametrize("name", ["dape", "dape_v2"])
def test_with_the_output_layer_zeroed_it_is_its_base_bias(name, base):
    """f's output layer at zero: the model is the base encoding's on the same weights, in
    training mode and at evaluation, at 8x the training length."""
    shape = ["model.n_layer=2", "model.d_model=32", "model.n_head=4", "train.seq_len=16",
             "eval.lengths=[128]"]
    torch.manual_seed(0)
    dape = posbench.build_model(posbench.compose([f"encoding={name}", f"encoding.base={base}",
                                                  *shape]), 64).double()
    torch.manual_seed(1)
    plain = posbench.build_model(posbench.compose([f"encoding={base}", *shape]), 64).double()
    with torch.no_grad():
        for p in plain.encoding.parameters():
            p.add_(0.3 * torch.randn_like(p))
        dape.encoding.w2.zero_()
        dape.encoding.b2.zero_()
    weights = {key.replace("encoding.", "encoding.base.", 1) if key.startswith("encoding.")
               else key: value for key, value in plain.state_dict().items()}
    missing = dape.load_state_dict(weights, strict=False).missing_keys
    assert sorted(missing) == [f"encoding.{w}" for w in ("b1", "b2", "w1", "w2")]
    idx = torch.randint(0, 64, (2, 128), generator=torch.Generator().manual_seed(2))
    for training in (True, False):
        dape.train(training), plain.train(training)
        with torch.set_grad_enabled(training):
            torch.testing.assert_close(dape(idx), plain(idx), rtol=1e-12, atol=1e-12)
    with torch.no_grad():
        dape.encoding.b2.fill_(0.5)  # a constant per head moves no softmax
        torch.testing.assert_close(dape(idx), plain(idx), rtol=1e-12, atol=1e-12)
        dape.encoding.w2.normal_()
        assert not torch.allclose(dape(idx), plain(idx), atol=1e-3)


def test_one_f_per_layer_with_the_reference_init():
    enc = encoding("dape_v2", n_head=4)
    assert enc.w1.shape == (2, 32, 8, 1, 3) and enc.w2.shape == (2, 4, 32, 1, 3)
    fresh = posbench.build_model(posbench.compose(["encoding=dape_v2", "model.n_layer=2",
                                                   "model.d_model=32", "model.n_head=4"])).encoding
    for w, fan_in in ((fresh.w1, 8 * 3), (fresh.b1, 8 * 3), (fresh.w2, 32 * 3),
                      (fresh.b2, 32 * 3)):
        bound = 1 / math.sqrt(fan_in)  # nn.Conv2d's default, as the reference leaves it
        assert w.abs().max() <= bound and w.abs().max() > 0.8 * bound
    assert not torch.equal(fresh.w1[0], fresh.w1[1])


@pytest.mark.parametrize("override, message", [
    ("encoding.base=rope", r"^encoding.base='rope' is not accepted; expected one of"),
    ("encoding.kernel=2", r"^encoding.kernel=2 is not accepted; expected an odd integer >= 1"),
    ("encoding.width=0", r"^encoding.width=0 is not accepted; expected a positive integer"),
    ("train.pack_documents=true", r"^train.pack_documents=True is not accepted; expected false "
                                  r"for encoding.kernel=3"),
])
def test_bad_values_are_refused_in_one_line(override, message):
    with pytest.raises(ConfigError, match=message) as err:
        posbench.compose(["encoding=dape_v2", override])
    assert "\n" not in str(err.value)


def test_dape_takes_packed_documents():
    """k = 1 reads no other key: packed documents are read as alone (tests/test_length_schedule.py
    checks it for every encoding the check lets pack)."""
    assert posbench.compose(["encoding=dape", "train.pack_documents=true"]).train.pack_documents
