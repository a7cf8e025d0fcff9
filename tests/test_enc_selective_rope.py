"""Selective RoPE (docs/encodings.md#contextual-family). The oracle re-derives the paper's rotation
in float64 without selective_rope.py's code: the increments with an explicit loop over the
convolution's taps, the angle between key j and query i as the term-by-term sum of the increments
of tokens j+1..i, and each pair's logit from the rotation's closed form
(a c + b e) cos + (a e - b c) sin, then a dense causal softmax."""
import functools
import math

import pytest
import torch

import posbench
import posbench.attention.paths as attention
from posbench.attention.paths import attend
from posbench.attention.span import Span

from helpers import assert_matches_reference, assert_position_ids_are_never_read, tiny_model
from test_attention_paths import largest_in_row_blocks

F64 = torch.float64
VARIANTS = {  # the reference's module options that change the increments
    "default": (),
    "low_rank": ("encoding.projection=low_rank", "encoding.rank=5",
                 "encoding.conv_activation=none", "encoding.phase_gate=false",
                 "encoding.phase_bias=true"),
    "full_rank_bias": ("encoding.phase_bias=true", "encoding.conv_size=2"),
}


build = functools.partial(tiny_model, name="selective_rope")


def moved(enc, seed=0, scale=1.0):
    """The encoding in float64, every parameter drawn away from its (near-zero) init, so that the
    phases turn the fast pairs by several radians within 40 tokens."""
    enc = enc.double()
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in enc.named_parameters():
            p.copy_(torch.randn(p.shape, generator=g, dtype=F64) * (0.3 if "bias" in name else 1))
        for p in enc.parameters():
            p.mul_(scale)
    return enc


def sharpen(model, factor=8.0):
    """q and k projections scaled, so that a rotation visibly moves an untrained model's logits."""
    with torch.no_grad():
        for block in model.blocks:
            block.attn.qkv.weight[:2 * block.attn.qkv.in_features] *= factor
    return model


def increments_oracle(enc, x, layer):
    """φ[b, t, h, p], the per-token angle of pair p of head h, as the paper and its code define it
    (timurcarstensen/selective-rope, SelectiveRoPE.forward), from the parameters alone."""
    cfg = enc.cfg
    B, T, D = x.shape
    H, d = enc.dims.n_head, enc.dims.head_dim
    half = d // 2
    chunks = x.to(F64).view(B, T, H, D // H)
    chunks = chunks / torch.sqrt((chunks ** 2).sum(-1, keepdim=True) + 1e-6)  # fla's l2_norm
    if cfg.projection == "full_rank":  # ChunkedLinear: scale_h * W_h / |W_h| column by column
        w = enc.proj_weight[layer]
        w = w / w.norm(dim=1, keepdim=True) * enc.proj_scale[layer].view(H, 1, 1)
        u = torch.einsum("bthc,hcp->bthp", chunks, w)
    else:
        u = (chunks.reshape(B, T, D) @ enc.proj_down[layer].T @ enc.proj_up[layer].T
             ).view(B, T, H, half)
    taps = enc.conv_weight[layer].view(H, half, -1)  # tap K-1 multiplies the token itself
    K = taps.shape[-1]
    conv = []
    for t in range(T):
        terms = [taps[..., s] * u[:, t - K + 1 + s] for s in range(K) if t - K + 1 + s >= 0]
        conv.append(sum(terms))
    phi = torch.stack(conv, 1)  # (B, T, H, half)
    if cfg.conv_activation == "silu":
        phi = phi * torch.sigmoid(phi)
    if cfg.phase_bias:
        phi = phi + torch.exp(enc.phase_bias[layer])
    if cfg.phase_gate:
        gate = torch.sigmoid(chunks.reshape(B, T, D) @ enc.gate_weight[layer].T
                             + enc.gate_bias[layer])  # (B, T, H)
        phi = phi * gate.unsqueeze(-1)
    return phi


def logits_oracle(enc, q, k, x, layer):
    """q̃_i · k̃_j / sqrt(d), (B, H, T, T): pair p turned by θ_p Σ_{l=j+1..i} φ_l, θ_p =
    m base^(-2p/d); the pairs are (p, p + d/2). Entries j > i are finite (masked later)."""
    B, H, T, d = q.shape
    half = d // 2
    phi = increments_oracle(enc, x, layer)
    i, j, l = torch.arange(T).view(T, 1, 1), torch.arange(T).view(1, T, 1), torch.arange(T)
    between = ((l > j) & (l <= i)).to(F64)  # (T, T, T): l in (j, i]
    gap = torch.einsum("ijl,blhp->bhijp", between, phi)
    theta = torch.tensor([enc.cfg.max_frequency * enc.cfg.base ** (-2 * p / d)
                          for p in range(half)], dtype=F64)
    a, b, c, e = q[..., :half], q[..., half:], k[..., :half], k[..., half:]
    same = torch.einsum("bhip,bhjp->bhijp", a, c) + torch.einsum("bhip,bhjp->bhijp", b, e)
    cross = torch.einsum("bhip,bhjp->bhijp", a, e) - torch.einsum("bhip,bhjp->bhijp", b, c)
    return (same * torch.cos(gap * theta) + cross * torch.sin(gap * theta)).sum(-1) / math.sqrt(d)


def softmax_oracle(logits, v, visible):
    return torch.softmax(logits.masked_fill(~visible, float("-inf")), -1) @ v


def random_heads(B=2, H=4, T=40, d=16, D=64, seed=0):
    g = torch.Generator().manual_seed(seed)
    q, k, v = (torch.randn(B, H, T, d, generator=g, dtype=F64, requires_grad=True)
               for _ in range(3))
    x = torch.randn(B, T, D, generator=g, dtype=F64, requires_grad=True)
    return q, k, v, x


def row_logits(enc, q, k, x, layer, start=0, end=None):
    """What the row_mod gives the query rows start..end-1 against keys 0..end-1."""
    end = q.shape[2] if end is None else end
    q_idx = torch.arange(start, end).view(1, 1, -1, 1)
    kv_idx = torch.arange(end).view(1, 1, 1, -1)
    return enc.row_mod(None, q, k, None, layer, q_idx, kv_idx, x=x)


@pytest.mark.parametrize("variant", VARIANTS)
def test_increments_are_the_gated_causal_convolution_of_the_projected_normalized_input(variant):
    enc = moved(build(*VARIANTS[variant]).encoding)
    _, _, _, x = random_heads()
    torch.testing.assert_close(enc.increments(x, 1), increments_oracle(enc, x, 1).permute(0, 2, 1, 3),
                               rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("variant", VARIANTS)
def test_logits_turn_each_pair_by_the_angles_of_the_tokens_between_key_and_query(variant):
    enc = moved(build(*VARIANTS[variant]).encoding)
    q, k, _, x = random_heads()
    expected = logits_oracle(enc, q, k, x, 0)
    causal = torch.ones(40, 40).tril().bool()
    got = row_logits(enc, q, k, x, 0)
    torch.testing.assert_close(got[..., causal], expected[..., causal], rtol=1e-10, atol=1e-10)
    # rows from the middle of the sequence against their prefix, as a later block asks
    rows = causal[24:33, :33]
    torch.testing.assert_close(row_logits(enc, q, k, x, 0, 24, 33)[..., rows],
                               expected[:, :, 24:33, :33][..., rows], rtol=1e-10, atol=1e-10)
    # the rotation is real: the fast pairs turn by radians, so the logits move off q.k
    plain = q @ k.transpose(-1, -2) / 4
    assert (got - plain)[..., causal].abs().max() > 1


@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize("blocks", ["one", "several"])
def test_blockwise_path_matches_dense_float64_reference(variant, blocks, monkeypatch):
    enc = moved(build(*VARIANTS[variant]).encoding, scale=0.5)
    B, H, T, d = 2, 4, 40, 16
    q, k, v, x = random_heads(B, H, T, d)
    if blocks == "several":  # blocks of 16 rows, each checkpointed
        monkeypatch.setattr(attention, "BLOCK_ELEMENTS", B * H * T * 16)
    out = attend(q, k, v, torch.arange(T).expand(B, T), enc, 1, x)
    ref = softmax_oracle(logits_oracle(enc, q, k, x, 1), v, torch.ones(T, T).tril().bool())
    assert_matches_reference(out, ref, (q, k, v, x, *enc.parameters()), rtol=1e-10, atol=1e-10,
                             grad_rtol=1e-9, grad_atol=1e-10)


def test_a_sliding_span_sees_the_phases_of_the_whole_sequence(monkeypatch):
    """Blocks whose keys start past 0 (a sliding window of 8): the phase gap of a key in the
    window is still the sum over the tokens between it and the query, counted from the start."""
    enc = moved(build().encoding, scale=0.5)
    B, H, T, d = 2, 4, 40, 16
    q, k, v, x = random_heads(B, H, T, d, seed=1)
    monkeypatch.setattr(attention, "BLOCK_ELEMENTS", B * H * 8 * 16)
    out = attend(q, k, v, torch.arange(T).expand(B, T), enc, 0, x, span=Span("sliding", 8))
    lag = torch.arange(T).view(T, 1) - torch.arange(T)
    ref = softmax_oracle(logits_oracle(enc, q, k, x, 0), v, (lag >= 0) & (lag < 8))
    assert_matches_reference(out, ref, (q, k, v, x), rtol=1e-10, atol=1e-10, grad_rtol=1e-9,
                             grad_atol=1e-10)


@pytest.mark.parametrize("step, max_frequency", [(1.0, 1.0), (2.0, 1.0), (1.0, 3.0)])
def test_a_constant_increment_is_rope_at_its_base(step, max_frequency):
    """Convolution taps 0 and the phase bias log c, no gate: φ_t = c, so the phase gap between j
    and i is c (i - j), RoPE's at base 500000 on the positions c m t."""
    shape = ["encoding.phase_bias=true", "encoding.phase_gate=false",
             f"encoding.max_frequency={max_frequency}"]
    selective = build(*shape, seed=1).double()
    rope = tiny_model("encoding.base=500000", name="rope", seed=2).double()
    selective.load_state_dict(rope.state_dict(), strict=False)
    with torch.no_grad():
        selective.encoding.conv_weight.zero_()
        selective.encoding.phase_bias.fill_(math.log(step))
    idx = torch.randint(0, 64, (2, 48), generator=torch.Generator().manual_seed(0))
    positions = (torch.arange(48) * round(step * max_frequency))
    with torch.no_grad():
        expected = rope(idx, pos=positions)
        torch.testing.assert_close(selective(idx), expected, rtol=1e-10, atol=1e-10)
        nope = tiny_model(name="nope", seed=2).double()
        assert (nope(idx) - expected).abs().max() > 1e-3  # RoPE's rotation shows in the logits


def test_a_zero_increment_is_nope():
    """Convolution taps 0 and no phase bias (the default): every phase is 0, no pair turns."""
    selective = build(seed=1).double()
    nope = sharpen(tiny_model(name="nope", seed=2)).double()
    selective.load_state_dict(nope.state_dict(), strict=False)
    idx = torch.randint(0, 64, (2, 48), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        moved(selective.encoding)
        turned = selective(idx)
        selective.encoding.conv_weight.zero_()
        torch.testing.assert_close(selective(idx), nope(idx), rtol=1e-10, atol=1e-10)
        assert (turned - nope(idx)).abs().max() > 1e-3


def test_at_init_it_is_near_nope_far_from_rope():
    """The reference's init (taps N(0, 0.02^2), the gate at 1/2) makes every increment small:
    at 64 tokens the logits sit much nearer NoPE's than RoPE's at the same base."""
    rope = sharpen(tiny_model("encoding.base=500000", name="rope", seed=2))
    selective, nope = build(seed=1), tiny_model(name="nope", seed=2)
    for model in (selective, nope):
        model.load_state_dict(rope.state_dict(), strict=False)
    idx = torch.randint(0, 64, (2, 64), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        base = nope(idx)
        from_rope = (rope(idx) - base).abs().max()
        from_selective = (selective(idx) - base).abs().max()
    assert 0 < from_selective < 0.05 * from_rope


def test_increments_are_bounded_by_the_taps_l1_norm_times_the_scale():
    """Full rank: |u_p| <= |scale_h| (unit chunks, unit columns), |SiLU(y)| <= |y| and the gate
    <= 1, so |φ_t| <= |scale_h| Σ_s |w_{p,s}| whatever the input."""
    enc = moved(build().encoding)
    x = torch.randn(3, 50, 64, dtype=F64, generator=torch.Generator().manual_seed(4)) * 100
    phi = enc.increments(x, 0).abs()  # (B, H, T, d/2)
    bound = enc.proj_scale[0].abs().view(4, 1, 1) * enc.conv_weight[0].abs().sum(-1).view(4, 1, 8)
    assert (phi <= bound + 1e-12).all()
    assert (phi.amax((0, 2)) > 0.3 * bound[:, 0]).any()  # the bound is approached, not vacuous


def test_no_query_reads_a_later_token():
    """Output row i: its gradient reaches k, v and x at j <= i only (row 0, which sees only
    its own key, has no gradient for k)."""
    enc = moved(build().encoding, scale=0.5)
    B, H, T, d = 1, 4, 24, 16
    q, k, v, x = random_heads(B, H, T, d, seed=2)
    out = attend(q, k, v, torch.arange(T).expand(B, T), enc, 0, x)
    for i in (7, 16, 23):
        grads = torch.autograd.grad(out[:, :, i].sum(), (k, v, x), retain_graph=True)
        for name, g in zip("kvx", grads):
            later = g[:, :, i + 1:] if name != "x" else g[:, i + 1:]
            earlier = g[:, :, :i + 1] if name != "x" else g[:, :i + 1]
            assert torch.equal(later, torch.zeros_like(later)), (name, i)
            assert earlier.abs().max() > 0, (name, i)


def test_logits_stay_finite_at_16x_the_training_length():
    """Trained length 32, 512 tokens scored, with parameters off their init and the phase bias
    on: phases run far past any training span (in fp32 and under bf16 autocast)."""
    model = build("train.seq_len=32", "eval.lengths=[512]", "encoding.phase_bias=true")
    moved(model.encoding)
    model.float()
    idx = torch.randint(0, 64, (2, 512), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        logits = model(idx)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            rounded = model(idx)
        x = model.blocks[0].ln_1(model.tok_emb(idx))
        phases = model.encoding.phases(x, 0)
    assert torch.isfinite(logits).all() and torch.isfinite(rounded).all()
    assert phases[:, :, 511].abs().max() > 8 * phases[:, :, 31].abs().max()


def test_position_ids_are_never_read():
    assert_position_ids_are_never_read(build())


def test_memory_grows_with_length_not_its_square(monkeypatch):
    """At T = 1024 in blocks of 64 rows, no tensor holds more than one block's logits: the phase
    tables are per token, (B, H, T, d)."""
    largest, block = largest_in_row_blocks(monkeypatch, build().encoding)
    assert largest <= block


def test_parameters_per_layer_start_as_the_reference_initializes_them():
    enc = build("model.n_layer=3", "model.n_head=8", "model.d_model=256").encoding
    assert enc.proj_weight.shape == (3, 8, 32, 16)  # per head: its chunk of x -> d/2 angles
    assert torch.equal(enc.proj_scale.detach(), torch.ones(3, 8))
    for w in (enc.conv_weight, enc.gate_weight):  # nn.Conv1d and nn.Linear: N(0, 0.02^2)
        assert w.detach().std().item() == pytest.approx(0.02, rel=0.05)
    assert enc.conv_weight.shape == (3, 8 * 16, 4) and enc.gate_weight.shape == (3, 8, 256)
    assert torch.equal(enc.gate_bias.detach(), torch.zeros(3, 8))  # the gate starts at 1/2
    low = build("encoding.projection=low_rank", "encoding.phase_bias=true").encoding
    assert low.proj_down.shape == (2, 16, 64) and low.proj_up.shape == (2, 4 * 8, 16)
    assert torch.equal(low.phase_bias.detach(), torch.zeros(2, 4, 8))  # e^0: one per token


@pytest.mark.parametrize("variant", VARIANTS)
def test_every_parameter_learns(variant):
    model = build(*VARIANTS[variant])
    model.train()
    idx = torch.randint(0, 64, (2, 40), generator=torch.Generator().manual_seed(0))
    model(idx).logsumexp(-1).mean().backward()
    for name, p in model.encoding.named_parameters():
        assert p.grad is not None and p.grad.abs().sum() > 0, name


def test_attend_without_the_input_is_refused():
    q = torch.randn(1, 4, 8, 16)
    with pytest.raises(ValueError, match="SelectiveRoPE's row_mod reads the attention's input"):
        attend(q, q, q, torch.arange(8).expand(1, 8), build().encoding, 0)


@pytest.mark.parametrize("override, message", [
    ("encoding.base=1", r"^encoding.base=1.0 is not accepted; expected a number > 1$"),
    ("encoding.max_frequency=0", r"^encoding.max_frequency=0.0 is not accepted"),
    ("encoding.projection=dense", r"^encoding.projection='dense' is not accepted; expected "
                                  r"full_rank or low_rank$"),
    ("encoding.rank=0", r"^encoding.rank=0 is not accepted"),
    ("encoding.conv_size=0", r"^encoding.conv_size=0 is not accepted"),
    ("encoding.conv_activation=relu", r"^encoding.conv_activation='relu' is not accepted"),
    ("encoding.init_std=-1", r"^encoding.init_std=-1.0 is not accepted"),
    ("model.n_head=64", r"^model.d_model/model.n_head=3 is not accepted"),
])
def test_out_of_range_values_are_rejected_in_one_line(override, message):
    with pytest.raises(posbench.ConfigError, match=message):
        posbench.compose(["encoding=selective_rope", "model.d_model=192", override])
