"""Defining property tests of the runner's six encodings (docs/encodings.md, by family)."""
import math

import pytest
import torch
import torch.nn.functional as F

import posbench
from posbench.encodings.alibi import alibi_slopes
from posbench.encodings.rope import apply_rotary, rope_inv_freq, rope_tables
from posbench.encodings.t5 import t5_bucket


def build(encoding, *extra):
    cfg = posbench.compose([f"encoding={encoding}", "model.n_layer=2", "model.d_model=64",
                            "model.n_head=4", *extra])
    torch.manual_seed(0)
    return posbench.build_model(cfg).eval()


# --- ALiBi -------------------------------------------------------------------------------------
def test_alibi_slopes_8_heads_are_powers_of_half():
    assert alibi_slopes(8) == [2.0 ** -i for i in range(1, 9)]


def test_alibi_slopes_12_heads():
    expected = [2.0 ** -i for i in range(1, 9)] + [2 ** -0.5, 2 ** -1.5, 2 ** -2.5, 2 ** -3.5]
    assert alibi_slopes(12) == pytest.approx(expected, rel=1e-12)


def test_alibi_slopes_6_heads():
    assert alibi_slopes(6) == pytest.approx([1 / 4, 1 / 16, 1 / 64, 1 / 256, 1 / 2, 1 / 8], rel=1e-12)


def test_alibi_bias_is_minus_slope_times_lag_and_row_constant_form_gives_same_softmax():
    enc = build("alibi").encoding
    T = 9
    pos = torch.arange(T).expand(1, T)
    fn = enc.score_mod(None, None, pos, 0)
    b = torch.zeros(1, 1, 1, 1, dtype=torch.long)
    h = torch.arange(4).view(1, 4, 1, 1)
    i = torch.arange(T).view(1, 1, T, 1)
    j = torch.arange(T).view(1, 1, 1, T)
    bias = fn(torch.zeros(1, 4, T, T), b, h, i, j)
    slopes = torch.tensor(alibi_slopes(4)).view(1, 4, 1, 1)
    torch.testing.assert_close(bias, -slopes * (i - j).float())
    causal = j <= i
    row_const = bias + slopes * i  # = +m*j
    p1 = torch.softmax(bias.masked_fill(~causal, -math.inf), -1)
    p2 = torch.softmax(row_const.masked_fill(~causal, -math.inf), -1)
    torch.testing.assert_close(p1, p2, atol=1e-6, rtol=0)
    assert not torch.allclose(bias[..., 1:, :1], row_const[..., 1:, :1])


# --- RoPE --------------------------------------------------------------------------------------
def test_rope_preserves_norm_and_is_identity_at_zero():
    torch.manual_seed(0)
    x = torch.randn(2, 4, 50, 32, dtype=torch.float64)
    pos = (torch.arange(50) * 997).expand(2, 50)
    cos, sin = rope_tables(pos, rope_inv_freq(32, 10000.0), torch.float64)
    torch.testing.assert_close(apply_rotary(x, cos, sin).norm(dim=-1), x.norm(dim=-1),
                               rtol=1e-6, atol=0)
    cos0, sin0 = rope_tables(torch.zeros(1, 50, dtype=torch.long), rope_inv_freq(32, 1e4), torch.float64)
    assert torch.equal(apply_rotary(x, cos0, sin0), x)


def test_rope_logit_depends_only_on_lag():
    torch.manual_seed(0)
    q, k = torch.randn(2, 1, 1, 1, 16, dtype=torch.float64)
    inv = rope_inv_freq(16, 10000.0)

    def logit(i, j):
        ci, si = rope_tables(torch.tensor([[i]]), inv, torch.float64)
        cj, sj = rope_tables(torch.tensor([[j]]), inv, torch.float64)
        return (apply_rotary(q, ci, si) * apply_rotary(k, cj, sj)).sum()

    for c in (1, 17, 1000, 100000):
        torch.testing.assert_close(logit(30 + c, 7 + c), logit(30, 7), rtol=1e-9, atol=1e-9)


def test_rope_angles_are_float64_accurate_at_long_positions():
    inv = rope_inv_freq(64, 10000.0)
    pos = torch.tensor([[100000]])
    cos, _ = rope_tables(pos, inv, torch.float32)
    exact = torch.cos(torch.tensor(100000.0, dtype=torch.float64) * inv)
    torch.testing.assert_close(cos[0, 0, 0, :32].double(), exact, atol=1e-6, rtol=0)


# --- T5 ----------------------------------------------------------------------------------------
@pytest.mark.parametrize("lag,bucket", [(0, 0), (15, 15), (16, 16), (20, 17), (24, 19), (32, 21),
                                        (46, 24), (64, 26), (91, 29), (127, 31), (128, 31),
                                        (1000, 31)])
def test_t5_bucket_reference_values(lag, bucket):
    assert int(t5_bucket(torch.tensor(lag), 32, 128)) == bucket


def test_t5_bias_is_translation_invariant_and_shared_across_layers():
    enc = build("t5").encoding
    torch.nn.init.normal_(enc.bias)
    b = torch.zeros(1, 1, 1, 1, dtype=torch.long)
    h = torch.arange(4).view(1, 4, 1, 1)
    i = torch.arange(40).view(1, 1, 40, 1)
    j = torch.arange(40).view(1, 1, 1, 40)
    zeros = torch.zeros(1, 4, 40, 40)
    base = enc.score_mod(None, None, torch.arange(40).expand(1, 40), 0)(zeros, b, h, i, j)
    shifted = enc.score_mod(None, None, (torch.arange(40) + 333).expand(1, 40), 1)(zeros, b, h, i, j)
    torch.testing.assert_close(base, shifted)
    assert sum(p.numel() for p in enc.parameters()) == 32 * 4


# --- NoPE --------------------------------------------------------------------------------------
def test_nope_attention_without_mask_is_permutation_equivariant():
    torch.manual_seed(0)
    model = build("nope")
    attn = model.blocks[0].attn
    x = torch.randn(1, 12, 64)
    perm = torch.randperm(12)

    def unmasked(x):
        B, T, C = x.shape
        q, k, v = attn.qkv(x).view(B, T, 3, 4, 16).permute(2, 0, 3, 1, 4)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=False)
        return attn.proj(y.transpose(1, 2).reshape(B, T, C))

    torch.testing.assert_close(unmasked(x[:, perm]), unmasked(x)[:, perm], atol=1e-5, rtol=0)


def test_nope_one_layer_last_output_ignores_order_of_the_prefix():
    cfg = posbench.compose(["encoding=nope", "model.n_layer=1", "model.d_model=64", "model.n_head=4"])
    torch.manual_seed(0)
    model = posbench.build_model(cfg).eval()
    idx = torch.randint(0, 256, (1, 20))
    perm = torch.cat([torch.randperm(19), torch.tensor([19])])
    torch.testing.assert_close(model(idx[:, perm])[:, -1], model(idx)[:, -1], atol=1e-5, rtol=0)


def test_nope_state_dict_has_no_position_tensors():
    model = build("nope")
    assert not any("encoding" in k for k in model.state_dict())


# --- sinusoidal / learned ------------------------------------------------------------------------
def test_sinusoidal_matches_vaswani_formula():
    from posbench.encodings.sinusoidal import sinusoid_table

    pe = sinusoid_table(torch.arange(300), 64, 10000.0)
    t, i = 257, 5
    w = 10000.0 ** (-2 * i / 64)
    assert pe[t, 2 * i].item() == pytest.approx(math.sin(t * w), abs=1e-12)
    assert pe[t, 2 * i + 1].item() == pytest.approx(math.cos(t * w), abs=1e-12)


def test_learned_table_sized_for_longest_eval_length_and_noted():
    model = build("learned", "eval.lengths=[64,512]", "train.seq_len=64")
    assert model.encoding.tables[0].shape[0] == 512
    assert "512 rows" in model.encoding.notes()[0]
    logits = model(torch.randint(0, 256, (1, 512)))
    assert torch.isfinite(logits).all()
