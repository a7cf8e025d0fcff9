"""GRAPE-AP (docs/encodings.md#group-family). The oracle builds every edge potential and every
path sum term by term in float64 from the paper's definition (explicit 2x2 rotations of the
normalized probe, a Python sum over the edges j+1..t), independently of grape_ap.py."""
import functools
import math

import pytest
import torch

import posbench
import posbench.attention.paths as attention
from posbench.attention.paths import attend
from posbench.encodings.alibi import alibi_slopes

from helpers import assert_matches_reference, tiny_model
from test_attention_paths import largest_in_row_blocks

F64 = torch.float64


build = functools.partial(tiny_model, name="grape_ap")


def path_bias(W, x, pos, slopes):
    """b[b, h, t, j] = Σ_{ℓ=j+1..t} α_h log σ(p_t · R(-pos_ℓ) p̂_ℓ / pd), p = W x, p̂ = p/rms(p);
    -inf above the diagonal. W (H, pd, D), x (B, T, D), pos (T,)."""
    B, T, _ = x.shape
    H, pd, _ = W.shape
    m = pd // 2
    out = torch.full((B, H, T, T), float("-inf"), dtype=F64)
    for b in range(B):
        for h in range(H):
            p = [W[h].double() @ x[b, t].double() for t in range(T)]
            r = []
            for t in range(T):
                unit = p[t] / torch.sqrt(p[t].square().mean() + torch.finfo(F64).eps)
                c, s = math.cos(pos[t]), math.sin(pos[t])
                turn = torch.tensor([[c, s], [-s, c]], dtype=F64)  # R(-θ) on (u, v)
                pairs = torch.stack((unit[:m], unit[m:]))  # (2, m)
                turned = turn @ pairs
                r.append(torch.cat((turned[0], turned[1])))
            edge = slopes[h] * torch.nn.functional.logsigmoid(
                torch.stack(p) @ torch.stack(r).T / pd)  # [t, ℓ]
            for t in range(T):
                for j in range(t + 1):
                    out[b, h, t, j] = edge[t, j + 1:t + 1].sum()
    return out


def bias_of(enc, x, pos, layer=0):
    """What the row_mod adds to zero logits, (B, H, T, T) on the causal part."""
    B, T, _ = x.shape
    q_idx, kv_idx = torch.arange(T).view(1, 1, T, 1), torch.arange(T).view(1, 1, 1, T)
    zeros = torch.zeros(B, enc.dims.n_head, T, T, dtype=F64)
    return enc.row_mod(zeros, None, None, pos.expand(B, T), layer, q_idx, kv_idx, x=x)


def test_bias_is_the_path_sum_of_query_weighed_edges():
    enc = build().encoding.double()
    with torch.no_grad():
        enc.probe.normal_(0, 0.3)
    g = torch.Generator().manual_seed(0)
    x = torch.randn(2, 14, 64, dtype=F64, generator=g)
    pos = torch.arange(14) * 3 + 5
    got = bias_of(enc, x, pos, layer=1)
    expected = path_bias(enc.probe[1].detach(), x, pos.tolist(), alibi_slopes(4))
    causal = torch.ones(14, 14).tril().bool()
    torch.testing.assert_close(got[..., causal], expected[..., causal], rtol=1e-12, atol=1e-12)
    assert (got[..., causal] <= 0).all() and expected[..., causal].min() < -1  # a real decay


def test_zero_probes_give_alibi_with_slopes_times_ln2_which_is_grape_a():
    """p = 0 makes every edge α_h log σ(0) = -α_h ln 2, endpoint-independent: the paper's
    reduction of GRAPE-AP to GRAPE-A, here grape_a without gates at ω = ln 2."""
    ap = build(seed=1)
    grape_a = build("encoding.gate=none", f"encoding.omega_init={math.log(2)}",
                    name="grape_a", seed=2)
    ap.load_state_dict(grape_a.state_dict(), strict=False)
    with torch.no_grad():
        ap.encoding.probe.zero_()
    idx = torch.randint(0, 64, (2, 50), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        expected = grape_a(idx)
        err = (ap(idx) - expected).abs().max().item()
        assert err < 1e-5, err
        ap.encoding.probe.normal_(0, 0.3)
        assert (ap(idx) - expected).abs().max() > 1e-3  # the probes matter once they look


def test_an_edge_changes_the_bias_only_on_paths_through_it():
    """Moving token 8 changes its probe, so ψ(t, 8) for every t and ψ(8, ℓ) for every ℓ: b(t, j)
    moves exactly when the path (j, t] holds 8, or when the query is 8 itself."""
    enc = build().encoding.double()
    with torch.no_grad():
        enc.probe.normal_(0, 0.3)
    x = torch.randn(1, 20, 64, dtype=F64, generator=torch.Generator().manual_seed(3))
    moved = x.clone()
    moved[0, 8] += 3.0
    pos = torch.arange(20)
    changed = (bias_of(enc, moved, pos) - bias_of(enc, x, pos)).abs() > 1e-9
    i, j = torch.arange(20).view(20, 1), torch.arange(20).view(1, 20)
    through = ((j < 8) & (8 <= i)) | ((i == 8) & (j < 8))
    for h in range(4):
        assert torch.equal(changed[0, h] & (j <= i), through), h


def test_a_shift_of_every_position_turns_the_probes_and_moves_the_bias():
    """R_ℓ turns by the position ℓ itself: GRAPE-AP is absolute (relative = False), and a shift
    by a multiple of 2π... never happens for whole positions, so every shift moves it."""
    enc = build().encoding.double()
    with torch.no_grad():
        enc.probe.normal_(0, 0.3)
    x = torch.randn(1, 12, 64, dtype=F64, generator=torch.Generator().manual_seed(4))
    base = bias_of(enc, x, torch.arange(12))
    causal = torch.ones(12, 12).tril().bool()
    for c in (1, 7, 1000):
        moved = bias_of(enc, x, torch.arange(12) + c)
        expected = path_bias(enc.probe[0].detach(), x, (torch.arange(12) + c).tolist(),
                             alibi_slopes(4))
        torch.testing.assert_close(moved[..., causal], expected[..., causal], rtol=1e-12,
                                   atol=1e-12)
        assert (moved - base)[..., causal].abs().max() > 1e-3


@pytest.mark.parametrize("blocks", ["one", "several"])
def test_blockwise_path_matches_dense_float64_reference(blocks, monkeypatch):
    enc = build().encoding.double()
    with torch.no_grad():
        enc.probe.normal_(0, 0.3)
    B, H, T, d = 2, 4, 24, 16
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(B, H, T, d, generator=g, dtype=F64, requires_grad=True)
               for _ in range(3))
    x = torch.randn(B, T, 64, generator=g, dtype=F64, requires_grad=True)
    if blocks == "several":  # blocks of 16 rows, each checkpointed
        monkeypatch.setattr(attention, "BLOCK_ELEMENTS", B * H * T * 16)
    pos = torch.arange(T) + 3
    out = attend(q, k, v, pos.expand(B, T), enc, 1, x)

    # the oracle's bias, differentiable in x and the probe: the same sum as a matrix product
    W = enc.probe[1]
    p = torch.einsum("btc,hpc->bhtp", x, W)
    unit = p / torch.sqrt(p.square().mean(-1, keepdim=True) + torch.finfo(F64).eps)
    c, s = torch.cos(pos.double()).view(1, 1, T, 1), torch.sin(pos.double()).view(1, 1, T, 1)
    u, w = unit[..., :4], unit[..., 4:]
    r = torch.cat((c * u + s * w, -s * u + c * w), -1)
    alpha = torch.tensor(alibi_slopes(H), dtype=F64).view(1, H, 1, 1)
    edge = alpha * torch.nn.functional.logsigmoid(p @ r.transpose(-1, -2) / 8)  # [t, ℓ]
    t_, j_, l_ = (torch.arange(T).view(T, 1, 1), torch.arange(T).view(1, T, 1),
                  torch.arange(T).view(1, 1, T))
    on_path = ((l_ > j_) & (l_ <= t_)).double()  # (t, j, ℓ)
    bias = torch.einsum("tjl,bhtl->bhtj", on_path, edge)
    causal = torch.ones(T, T).tril().bool()
    term_by_term = path_bias(W.detach(), x.detach(), pos.tolist(), alibi_slopes(H))
    torch.testing.assert_close(bias.detach()[..., causal], term_by_term[..., causal], rtol=1e-12,
                               atol=1e-12)
    scores = q @ k.transpose(-1, -2) / math.sqrt(d) + bias
    ref = torch.softmax(scores.masked_fill(~causal, float("-inf")), -1) @ v
    assert_matches_reference(out, ref, (q, k, v, x, enc.probe), rtol=1e-10, atol=1e-10,
                             grad_rtol=1e-9, grad_atol=1e-10)


def test_memory_grows_with_length_not_its_square(monkeypatch):
    """At T = 1024 in blocks of 64 rows no tensor holds more than one block's scores: the probes
    are per token, (B, H, T, pd)."""
    largest, block = largest_in_row_blocks(monkeypatch, build().encoding)
    assert largest <= block


def test_probe_is_per_layer_and_head_with_the_reference_init_and_learns():
    enc = build("model.n_layer=3", "model.n_head=8", "model.d_model=256").encoding
    w = enc.probe.detach().double()
    assert w.shape == (3, 8, 8, 256)  # (layers, heads, pd = 8, D)
    assert w.std() == pytest.approx(0.5 / 16, rel=0.05) and abs(w.mean()) < 4 * 0.5 / 16 / 64
    model = build()
    model.train()
    idx = torch.randint(0, 64, (2, 40), generator=torch.Generator().manual_seed(0))
    model(idx).logsumexp(-1).mean().backward()
    assert model.encoding.probe.grad.abs().sum() > 0


def test_attend_without_the_input_is_refused():
    enc = build().encoding
    q = torch.randn(1, 4, 8, 16)
    with pytest.raises(ValueError, match="GrapeAP's row_mod reads the attention's input"):
        attend(q, q, q, torch.arange(8).expand(1, 8), enc, 0)


@pytest.mark.parametrize("override,key", [
    ("encoding.probe_dim=7", "encoding.probe_dim=7"),
    ("encoding.probe_dim=0", "encoding.probe_dim=0"),
    ("encoding.probe_init_factor=0", "encoding.probe_init_factor=0.0"),
])
def test_out_of_range_values_are_rejected_in_one_line(override, key):
    with pytest.raises(posbench.ConfigError) as err:
        posbench.compose(["encoding=grape_ap", override])
    message = str(err.value)
    assert message.startswith(key + " is not accepted; expected") and "\n" not in message
