"""PoPE, polar coordinate position embeddings (docs/encodings.md#rotary-family). The oracle is
the logit Σ_c softplus(q_c) softplus(k_c) cos((i - j)θ_c - δ_c) / sqrt(d), written in float64
from the definition, independently of pope.py's 2d-wide vectors."""
import math

import pytest
import torch
import torch.nn.functional as F

import posbench
from posbench.attention.paths import attend
from posbench.encodings import Dims
from posbench.encodings.pope import PoPE

from helpers import assert_matches_reference, assert_shift_invariant

F64 = torch.float64


def make(n_head=2, d=16, **options):
    cfg = PoPE.Config(name="pope", **options)
    return PoPE(cfg, Dims(n_layer=2, n_head=n_head, d_model=n_head * d, train_len=64,
                          max_len=4096)).double()


def oracle_logits(q, k, pos, delta, base=10000.0):
    """(B, H, T, T) float64: Σ_c sp(q_ic) sp(k_jc) cos((p_i - p_j) θ_c - δ_hc) / sqrt(d)."""
    d = q.shape[-1]
    theta = torch.tensor([base ** (-c / d) for c in range(d)], dtype=F64)
    lag = (pos.view(-1, 1) - pos.view(1, -1)).double()  # (T, T)
    phase = lag.unsqueeze(-1) * theta - delta.view(-1, 1, 1, d)  # (H, T, T, d)
    mags = F.softplus(q).unsqueeze(-2) * F.softplus(k).unsqueeze(-3)  # (B, H, T, T, d)
    return (mags * torch.cos(phase)).sum(-1) / math.sqrt(d)


def attention_logits(enc, q, k, pos):
    """q̃·k̃ scaled as the attention scales it: 1/sqrt of their width, 2d."""
    qt, kt = enc.rotate(q, k, pos, 0)
    assert qt.shape[-1] == kt.shape[-1] == 2 * q.shape[-1]
    return qt @ kt.transpose(-1, -2) / math.sqrt(qt.shape[-1])


def qk(T=30, d=16, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(2, 2, 2, T, d, dtype=F64, generator=g)


def test_logit_is_softplus_magnitudes_times_cosine_of_the_lag_phase():
    enc = make()
    with torch.no_grad():  # two heads: one inside [-2π, 0], one partly outside (clamped)
        enc.phase_bias.uniform_(-2 * math.pi, 0)
        enc.phase_bias[1, 0, :4] = torch.tensor([1.0, -7.0, 0.5, -100.0], dtype=F64)
    q, k = qk()
    pos = (torch.arange(30) * 37 + 5).view(1, 30)
    delta = enc.phase_bias.detach().clamp(-2 * math.pi, 0)[:, 0]
    assert delta[1, 0] == 0 and delta[1, 1] == -2 * math.pi
    torch.testing.assert_close(attention_logits(enc, q, k, pos),
                               oracle_logits(q, k, pos[0], delta), rtol=1e-12, atol=1e-12)


def test_phases_come_from_position_alone_and_magnitudes_from_content_alone():
    enc = make(n_head=1)
    q, _ = qk()
    q = q[:, :1] * 5  # large content of either sign
    pos = (torch.arange(30) * 1009).view(1, 30)
    qt, _ = enc.rotate(q, q, pos, 0)
    d = q.shape[-1]
    real, imag = qt[..., :d], qt[..., d:]
    theta = 10000.0 ** (-torch.arange(d, dtype=F64) / d)
    angle = pos.double().view(1, 1, 30, 1) * theta
    torch.testing.assert_close(torch.atan2(imag, real), torch.atan2(angle.sin(), angle.cos())
                               .expand_as(real), rtol=0, atol=1e-9)  # whatever q is
    torch.testing.assert_close(torch.hypot(real, imag), math.sqrt(2) * F.softplus(q),
                               rtol=1e-12, atol=0)


def test_attention_scales_by_one_over_sqrt_d_forward_and_gradients():
    """Through attend (fused SDPA on the 2d-wide q̃, k̃ and d-wide v) against the oracle's
    softmax, with gradients for q, k, v and the phase bias."""
    enc = make()
    with torch.no_grad():
        enc.phase_bias.uniform_(-2 * math.pi, 0)
    B, H, T, d = 2, 2, 40, 16
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(B, H, T, d, generator=g, dtype=F64, requires_grad=True)
               for _ in range(3))
    pos = torch.arange(T).expand(B, T) + 100
    qt, kt = enc.rotate(q, k, pos, 0)
    out = attend(qt, kt, v, pos, enc, 0)
    causal = torch.ones(T, T, dtype=torch.bool).tril()
    scores = oracle_logits(q, k, pos[0], enc.phase_bias.clamp(-2 * math.pi, 0)[:, 0])
    ref = torch.softmax(scores.masked_fill(~causal, float("-inf")), -1) @ v
    assert_matches_reference(out, ref, (q, k, v, enc.phase_bias), rtol=1e-10, atol=1e-10,
                             grad_rtol=1e-9, grad_atol=1e-10)


def test_logits_are_shift_invariant_up_to_10k_and_the_model_too():
    enc = make()
    with torch.no_grad():
        enc.phase_bias.uniform_(-2 * math.pi, 0)
    q, k = qk()
    pos = torch.arange(30).view(1, 30)
    base = attention_logits(enc, q, k, pos)
    for c in (1, 17, 1000, 10**4):
        torch.testing.assert_close(attention_logits(enc, q, k, pos + c), base, rtol=0, atol=1e-10)
    cfg = posbench.compose(["encoding=pope", "model.n_layer=2", "model.d_model=64",
                            "model.n_head=4"])
    torch.manual_seed(0)
    model = posbench.build_model(cfg, vocab_size=64).eval()
    with torch.no_grad():
        model.encoding.phase_bias.uniform_(-2 * math.pi, 0)
        for block in model.blocks:
            block.attn.qkv.weight[: 2 * 64] *= 10
    idx = torch.randint(0, 64, (2, 40), generator=torch.Generator().manual_seed(0))
    base = assert_shift_invariant(model, idx, offsets=(1, 17, 1000, 10**4), per_sequence=True)
    with torch.no_grad():
        assert (model(idx, pos=2 * torch.arange(40)) - base).abs().max() > 1e-3


def test_phase_bias_is_one_per_head_and_coordinate_shared_by_layers_and_starts_at_zero():
    enc = make(n_head=4, d=16)
    assert [name for name, _ in enc.named_parameters()] == ["phase_bias"]
    assert enc.phase_bias.shape == (4, 1, 16) and torch.equal(enc.phase_bias.detach(),
                                                              torch.zeros(4, 1, 16, dtype=F64))
    q, k = qk(d=16)
    pos = torch.arange(30).view(1, 30)
    q, k = q.repeat(1, 2, 1, 1), k.repeat(1, 2, 1, 1)  # four heads
    assert torch.equal(enc.rotate(q, k, pos, 0)[1], enc.rotate(q, k, pos, 1)[1])
    attention_logits(enc, q, k, pos).sum().backward()
    assert (enc.phase_bias.grad != 0).all()  # at the clamp's edge 0 it still learns
    uniform = make(n_head=4, d=64, bias_uniform_init=True).phase_bias
    assert -2 * math.pi <= uniform.min() < -5 and -1 < uniform.max() <= 0


def test_base_of_one_is_one_line_config_error():
    with pytest.raises(posbench.ConfigError, match=r"^encoding.base=1.0 is not accepted; "
                                                  r"expected a number > 1$"):
        posbench.compose(["encoding=pope", "encoding.base=1"])
