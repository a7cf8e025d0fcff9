"""Defining property tests of the rotary encodings (docs/encodings.md#rotary-family): RoPE's layout,
p-RoPE, 2-D RoPE and xPos."""
import math

import pytest
import torch

import posbench
from posbench.encodings import Dims
from posbench.encodings.p_rope import PRoPE
from posbench.encodings.rope import RoPE, apply_rotary, rope_inv_freq, rope_tables
from posbench.encodings.rope_2d import RoPE2D, chunk_coordinates
from posbench.encodings.xpos import XPos, xpos_zeta

F64 = torch.float64


def make(cls, head_dim=64, train_len=512, **options):
    return cls(cls.Config(name=cls.__name__, **options), Dims(1, 1, head_dim, train_len, 4096))


def qk(T, d, dtype=F64, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(2, 1, 3, T, d, generator=g, dtype=dtype)


def logits(enc, q, k, pos):
    q, k = enc.rotate(q, k, pos, 0)
    return q @ k.transpose(-2, -1)


def build(encoding, *extra):
    cfg = posbench.compose([f"encoding={encoding}", "model.n_layer=1", "model.d_model=32",
                            "model.n_head=2", *extra])
    torch.manual_seed(0)
    return posbench.build_model(cfg).eval()


# --- RoPE --------------------------------------------------------------------------------------
def test_rope_interleaved_and_half_split_layouts_give_equal_logits_after_permuting():
    d, T = 16, 20
    q, k = qk(T, d)
    pos = torch.arange(T).unsqueeze(0) * 37
    angles = pos.double().unsqueeze(-1) * rope_inv_freq(d, 1e4)  # (1, T, d/2)
    cos, sin = angles.cos().unsqueeze(1), angles.sin().unsqueeze(1)

    def interleaved(x):  # pair p = (x_2p, x_2p+1), as in the RoFormer paper
        a, b = x[..., 0::2], x[..., 1::2]
        return torch.stack((a * cos - b * sin, a * sin + b * cos), -1).flatten(-2)

    expected = interleaved(q) @ interleaved(k).transpose(-2, -1)
    to_half_split = torch.cat((torch.arange(0, d, 2), torch.arange(1, d, 2)))  # permuted weights
    got = logits(make(RoPE, d), q[..., to_half_split], k[..., to_half_split], pos)
    torch.testing.assert_close(got, expected, rtol=1e-12, atol=1e-12)


def test_rope_rejects_a_base_of_one_or_less_in_one_line():
    with pytest.raises(posbench.ConfigError, match=r"^encoding.base=-2.0 is not accepted; "
                                                  r"expected a number > 1$"):
        posbench.compose(["encoding=rope", "encoding.base=-2"])


# --- p-RoPE ------------------------------------------------------------------------------------
@pytest.mark.parametrize("p, d, rotated", [(0.75, 64, 24), (0.25, 64, 8), (1.0, 64, 32),
                                           (0.5, 10, 2), (0.1, 16, 0)])
def test_p_rope_zero_frequency_pair_count(p, d, rotated):
    inv_freq = make(PRoPE, d, p=p).inv_freq
    assert rotated == math.floor(p * d / 2)
    assert int((inv_freq == 0).sum()) == d // 2 - rotated
    assert (inv_freq[:rotated] > 0).all() and (inv_freq[rotated:] == 0).all()


def test_p_rope_unrotated_dims_ignore_position_and_rotated_dims_equal_rope_bitwise():
    d, R = 64, 24
    q, k = qk(50, d, dtype=torch.float32)
    pos = torch.arange(50).unsqueeze(0) * 1009
    pq, pk = make(PRoPE, d, p=0.75).rotate(q, k, pos, 0)
    rq, rk = make(RoPE, d).rotate(q, k, pos, 0)
    rotated = torch.cat((torch.arange(R), torch.arange(R) + d // 2))
    free = torch.cat((torch.arange(R, d // 2), torch.arange(R, d // 2) + d // 2))
    assert torch.equal(pq[..., rotated], rq[..., rotated])
    assert torch.equal(pk[..., rotated], rk[..., rotated])
    assert torch.equal(pq[..., free], q[..., free]) and torch.equal(pk[..., free], k[..., free])
    assert not torch.equal(pq[..., rotated], q[..., rotated])


def test_p_rope_with_p_one_is_rope_and_its_logits_are_shift_invariant():
    q, k = qk(40, 32, dtype=torch.float32)
    pos = torch.arange(40).unsqueeze(0)
    full = make(PRoPE, 32, p=1.0)
    assert torch.equal(full.rotate(q, k, pos, 0)[0], make(RoPE, 32).rotate(q, k, pos, 0)[0])
    enc = make(PRoPE, 32)
    base = logits(enc, q, k, pos)
    for c in (1, 17, 1000, 65536):
        shifted = logits(enc, q, k, pos + c)
        assert ((shifted - base).abs() / base.abs().clamp(min=1)).max() <= 1e-5, c


@pytest.mark.parametrize("p", ["0", "1.5", "-0.25"])
def test_p_rope_rejects_p_outside_zero_one_in_one_line(p):
    with pytest.raises(posbench.ConfigError, match=r"^encoding.p=\S+ is not accepted; "
                                                  r"expected 0 < p <= 1$"):
        posbench.compose(["encoding=p_rope", f"encoding.p={p}"])


# --- 2-D RoPE ----------------------------------------------------------------------------------
def test_rope_2d_logits_are_invariant_to_shifts_in_x_and_in_y_separately():
    enc = make(RoPE2D, 32)
    q, k = qk(30, 32)
    g = torch.Generator().manual_seed(1)
    px, py = torch.randint(0, 50, (1, 30), generator=g), torch.randint(0, 50, (1, 30), generator=g)

    def scores(x, y):
        a, b = enc.rotate_2d(q, k, x, y)
        return a @ b.transpose(-2, -1)

    base = scores(px, py)
    for c in (1, 17, 1000):
        torch.testing.assert_close(scores(px + c, py), base, rtol=1e-9, atol=1e-9)
        torch.testing.assert_close(scores(px, py + c), base, rtol=1e-9, atol=1e-9)
    assert not torch.allclose(scores(px, py.flip(-1)), base, atol=1e-3)
    assert not torch.allclose(scores(px.flip(-1), py), base, atol=1e-3)


def test_rope_2d_with_constant_y_is_1d_rope_on_the_first_half_and_nope_on_the_second():
    d = 32
    enc = make(RoPE2D, d)
    q, k = qk(30, d)
    px = torch.arange(30).unsqueeze(0) * 3
    rq, rk = enc.rotate_2d(q, k, px, torch.full_like(px, 7))
    cos, sin = rope_tables(px, rope_inv_freq(d // 2, 1e4), F64)
    torch.testing.assert_close(rq[..., :d // 2], apply_rotary(q[..., :d // 2], cos, sin))
    h = slice(d // 2, d)
    torch.testing.assert_close(rq[..., h] @ rk[..., h].transpose(-2, -1),
                               q[..., h] @ k[..., h].transpose(-2, -1), rtol=1e-12, atol=1e-12)


def test_rope_2d_reads_1d_positions_as_chunk_index_and_offset():
    enc = make(RoPE2D, 32, chunk=16)
    q, k = qk(40, 32)
    pos = torch.arange(40).unsqueeze(0) + 5
    x, y = chunk_coordinates(pos, 16)
    assert x[0, :3].tolist() == [0, 0, 0] and x[0, 11].item() == 1 and y[0, 11].item() == 0
    for got, want in zip(enc.rotate(q, k, pos, 0), enc.rotate_2d(q, k, x, y)):
        assert torch.equal(got, want)
    base = logits(enc, q, k, pos)  # a whole chunk of shift moves x only: logits stay
    torch.testing.assert_close(logits(enc, q, k, pos + 16 * 7), base, rtol=1e-9, atol=1e-9)
    assert not torch.allclose(logits(enc, q, k, pos + 1), base, atol=1e-3)


def test_rope_2d_runs_in_the_model_and_rejects_head_dims_not_divisible_by_4():
    model = build("rope_2d", "encoding.chunk=8")
    idx = torch.randint(0, 256, (1, 40), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        assert torch.isfinite(model(idx, pos=torch.arange(40) + 65536)).all()
    with pytest.raises(posbench.ConfigError, match=r"^model.d_model/model.n_head=6 is not "):
        posbench.compose(["encoding=rope_2d", "model.d_model=12", "model.n_head=2"])
    with pytest.raises(posbench.ConfigError, match=r"^encoding.chunk=0 is not accepted"):
        posbench.compose(["encoding=rope_2d", "encoding.chunk=0"])


# --- xPos --------------------------------------------------------------------------------------
def test_xpos_zeta_matches_torchscale_and_the_spec_range():
    zeta = xpos_zeta(64, 0.4)
    torchscale = (torch.arange(0, 64, 2, dtype=F64) + 0.4 * 64) / (1.4 * 64)
    torch.testing.assert_close(zeta, torchscale, rtol=1e-15, atol=0)
    assert round(zeta[0].item(), 3) == 0.286 and round(zeta[-1].item(), 3) == 0.978


def test_xpos_scales_each_pairs_logit_by_zeta_to_the_lag_over_b():
    d, B, i, j = 16, 512.0, 3000, 700
    enc = make(XPos, d)
    zeta, theta = xpos_zeta(d, 0.4), rope_inv_freq(d, 1e4)
    pos = torch.tensor([[j, i]])  # one sequence, so one centre for both tokens
    for p in range(d // 2):
        lag_angle = (i - j) * theta[p].item()
        x = torch.zeros(1, 1, 2, d, dtype=F64)
        x[..., 1, p] = 1  # the query at i: unit vector in pair p = (x_p, x_{p+d/2})
        x[..., 0, p], x[..., 0, p + d // 2] = math.cos(lag_angle), math.sin(lag_angle)
        q, k = enc.rotate(x, x, pos, 0)  # the key at j is pre-turned to align with the query
        aligned = (q[0, 0, 1] * k[0, 0, 0]).sum()
        torch.testing.assert_close(aligned, zeta[p] ** ((i - j) / B), rtol=1e-12, atol=0)
        x[..., 0, :] = x[..., 1, :]  # same vector: RoPE's cos(lag angle) times the decay
        q, k = enc.rotate(x, x, pos, 0)
        torch.testing.assert_close((q[0, 0, 1] * k[0, 0, 0]).sum(),
                                   zeta[p] ** ((i - j) / B) * math.cos(lag_angle),
                                   rtol=1e-10, atol=1e-12)


def test_xpos_logits_are_shift_invariant_and_finite_at_offset_65536():
    enc = make(XPos, 32)
    q, k = qk(300, 32, dtype=torch.float32)
    pos = torch.arange(300).unsqueeze(0)
    base = logits(enc, q, k, pos)
    for c in (1, 17, 1000, 65536):
        shifted = logits(enc, q, k, pos + c)
        assert torch.isfinite(shifted).all()
        assert ((shifted - base).abs() / base.abs().clamp(min=1)).max() <= 1e-5, c


def test_xpos_stays_finite_and_exact_at_16k_tokens_offset_by_65536_in_fp32():
    d, T = 16, 16384
    enc = make(XPos, d)
    q, k = (x[:, :1] for x in qk(T, d, dtype=torch.float32))
    pos = torch.arange(T).unsqueeze(0) + 65536
    rq, rk = enc.rotate(q, k, pos, 0)
    assert torch.isfinite(rq).all() and torch.isfinite(rk).all()
    # the farthest causal pair and the farthest masked (future) pair are finite too
    qd, kd = enc.rotate(q.double(), k.double(), pos, 0)  # float64 reference
    for i, j in ((T - 1, 0), (0, T - 1), (T // 2, T // 2 - 3)):
        got = (rq[0, 0, i] * rk[0, 0, j]).sum()
        want = (qd[0, 0, i] * kd[0, 0, j]).sum()
        assert torch.isfinite(got)
        assert abs(got.item() - want.item()) <= 1e-5 * max(1.0, abs(want.item())), (i, j)


def test_xpos_block_window_hides_blocks_before_the_previous_one():
    model = build("xpos", "encoding.block_window=8")
    assert build("xpos").encoding.score_mod is None
    idx = torch.randint(0, 256, (1, 40), generator=torch.Generator().manual_seed(0))
    changed = idx.clone()
    changed[0, 2] += 1  # a token of block 0
    with torch.no_grad():
        a, b = model(idx), model(changed)
    assert not torch.allclose(a[0, 2:16], b[0, 2:16], atol=1e-5)  # blocks 0 and 1 see it
    torch.testing.assert_close(a[0, 16:], b[0, 16:], rtol=0, atol=0)  # block 2 on does not


@pytest.mark.parametrize("override, key", [("encoding.gamma=0", "encoding.gamma=0.0"),
                                           ("encoding.scale_base=-1", "encoding.scale_base=-1.0"),
                                           ("encoding.block_window=0", "encoding.block_window=0")])
def test_xpos_rejects_bad_values_in_one_line(override, key):
    with pytest.raises(posbench.ConfigError, match=rf"^{key} is not accepted; expected ") as err:
        posbench.compose(["encoding=xpos", override])
    assert "\n" not in str(err.value)
