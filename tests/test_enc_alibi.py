"""ALiBi on the first `encoding.heads` heads only (x-transformers' alibi_num_heads): the slopes of
that many heads, by Press et al.'s rule, on those heads, and no bias on the others. The layer is
checked against dense float64 attention written here from that definition, forward and gradients,
in training and under no_grad (the lag table's path)."""
import math

import pytest
import torch

import posbench

from helpers import tiny_model


def press_slopes(n):
    """ofirpress/attention_with_linear_biases' get_slopes, in Python floats: 2^(-8h/n) for n a
    power of two, else those of the power c below n and every other one of 2c, n - c of them."""
    def geometric(m):
        return [2.0 ** (-8.0 * h / m) for h in range(1, m + 1)]

    c = 2 ** int(math.floor(math.log2(n)))
    return geometric(n) if c == n else geometric(c) + geometric(2 * c)[0::2][:n - c]


def alibi_model(n_head, heads=None):
    extra = [] if heads is None else [f"encoding.heads={heads}"]
    return tiny_model(f"model.n_head={n_head}", "model.d_model=48", "train.seq_len=32",
                      "eval.lengths=[64]", *extra, name="alibi").double()


def oracle(attn, x, pos, slopes):
    """The layer's output from its weights: softmax(q.k/sqrt(d) + b_h(i, j)) v under the causal
    mask, b_h = -m_h (p_i - p_j) on the heads with a slope, 0 on the others; then the projection."""
    B, T, D = x.shape
    H = len(slopes)
    q, k, v = (t.view(B, T, H, D // H).transpose(1, 2)
               for t in (x @ attn.qkv.weight.T).split(D, dim=-1))
    lag = (pos[:, :, None] - pos[:, None, :]).to(torch.float64)  # (B, T, T)
    bias = -torch.tensor(slopes, dtype=torch.float64).view(1, H, 1, 1) * lag[:, None]
    scores = q @ k.transpose(-2, -1) / math.sqrt(D // H) + bias
    future = torch.ones(T, T, dtype=torch.bool).triu(1)
    probs = torch.softmax(scores.masked_fill(future, -math.inf), -1)
    return (probs @ v).transpose(1, 2).reshape(B, T, D) @ attn.proj.weight.T


@pytest.mark.parametrize("n_head, heads", [(6, 1), (6, 3), (6, 5), (6, 6), (4, 2), (8, 3)])
def test_the_first_heads_get_the_slopes_of_that_many_heads_and_the_rest_no_bias(n_head, heads):
    model = alibi_model(n_head, heads)
    slopes = press_slopes(heads) + [0.0] * (n_head - heads)
    attn = model.blocks[0].attn
    x = torch.randn(2, 40, 48, dtype=torch.float64, generator=torch.Generator().manual_seed(0))
    pos = (torch.arange(40) + torch.tensor([[0], [5000]])).long()  # an offset sequence too
    with torch.no_grad():
        torch.testing.assert_close(attn(x, pos, model.encoding), oracle(attn, x, pos, slopes),
                                   rtol=1e-10, atol=1e-10)
    model.train()
    x.requires_grad_(True)
    wrt = [x, attn.qkv.weight, attn.proj.weight]
    got, expected = attn(x, pos, model.encoding), oracle(attn, x, pos, slopes)
    torch.testing.assert_close(got, expected, rtol=1e-10, atol=1e-10)
    g = torch.randn_like(got)
    for a, b in zip(torch.autograd.grad((got * g).sum(), wrt),
                    torch.autograd.grad((expected * g).sum(), wrt)):
        torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-10)


def test_three_of_eight_heads_are_the_slopes_of_three_heads():
    # 3 heads: the 2 of a power of two (2^-4, 2^-8), then the first of 4 heads' every other (2^-2)
    slopes = alibi_model(8, 3).encoding.slopes.tolist()
    assert slopes == [2.0 ** -4, 2.0 ** -8, 2.0 ** -2, 0, 0, 0, 0, 0]


def test_every_head_is_the_papers_alibi_bit_for_bit():
    default, every = alibi_model(6).encoding, alibi_model(6, 6).encoding
    assert default.cfg.heads is None and torch.equal(default.slopes, every.slopes)
    torch.testing.assert_close(default.slopes.tolist(), press_slopes(6), rtol=1e-15, atol=0)


@pytest.mark.parametrize("heads", [0, 5, -1])
def test_a_head_count_outside_one_to_n_head_is_refused_in_one_line(heads):
    with pytest.raises(posbench.ConfigError) as err:
        posbench.compose(["encoding=alibi", "model.n_head=4", f"encoding.heads={heads}"])
    assert str(err.value) == (f"encoding.heads={heads} is not accepted; expected 1 to "
                              "model.n_head=4 (the heads with a bias), or null (all)")
