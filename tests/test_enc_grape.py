"""GRAPE-M and GRAPE-A (docs/encodings.md#group-family). The oracles build the generators and
their group elements as dense float64 matrices from the paper's definitions (scipy's expm for
the exponentials, explicit inverses for G^{-T}), independently of grape.py."""
import dataclasses
import math

import pytest
import scipy.linalg
import torch

import posbench
import posbench.attention.paths as attention
from posbench.attention.paths import attend
from posbench.encodings import Dims, registry
from posbench.encodings.alibi import alibi_slopes
from posbench.encodings.grape import GrapeA, GrapeM
from posbench.encodings.rope import apply_rotary, rope_tables

from helpers import assert_matches_reference, assert_shift_invariant
from test_attention_paths import largest_in_row_blocks

F64 = torch.float64
OFFSETS = (1, 17, 1000, 10**4)


def build(name, *extra, seed=0):
    cfg = posbench.compose([f"encoding={name}", "model.n_layer=2", "model.d_model=64",
                            "model.n_head=4", *extra])
    torch.manual_seed(seed)
    return posbench.build_model(cfg, vocab_size=64).eval()


def module(cls, name, n_head=2, d=8, n_layer=1, **changes):
    cfg = dataclasses.replace(registry()[name].config, **changes)
    return cls(cfg, Dims(n_layer=n_layer, n_head=n_head, d_model=n_head * d, train_len=64,
                         max_len=4096)).double()


def randomize(enc, std=0.5, seed=0):
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in enc.parameters():
            p.copy_(torch.randn(p.shape, generator=gen, dtype=p.dtype) * std)


# --- GRAPE-M ---------------------------------------------------------------------------------
def frame_of(enc, h):
    """The orthonormal frame of head h, from the learned entries of S by scipy's expm."""
    d = enc.dims.head_dim
    S = torch.zeros(d, d, dtype=F64)
    rows, cols = torch.triu_indices(d, d, 1)
    S[rows, cols] = enc.frame_generator[0, h].detach().double()
    return torch.from_numpy(scipy.linalg.expm((S - S.T).numpy()))


def dense_generator(frame, theta):
    """A = Σ_p θ_p (b_p a_p^T - a_p b_p^T), a_p and b_p the frame's columns p and p + d/2."""
    m = frame.shape[0] // 2
    A = torch.zeros_like(frame)
    for p in range(m):
        a, b = frame[:, p], frame[:, p + m]
        A += theta[p].item() * (torch.outer(b, a) - torch.outer(a, b))
    return A


def query_map(enc, t):
    """G(t) per head, (H, d, d), from the module's rotate at position t (columns: images of e_i)."""
    d, H = enc.dims.head_dim, enc.dims.n_head
    eye = torch.eye(d, dtype=F64).view(d, 1, 1, d).expand(d, H, 1, d)
    q, k = enc.rotate(eye, eye, torch.full((d, 1), t, dtype=torch.long), 0)
    assert torch.equal(q, k)  # G orthogonal: G(t)^{-T} = G(t), queries and keys turn alike
    return q[:, :, 0].permute(1, 2, 0)


TIMES = [0, 1, 7, 1000, 10**4]


def test_grape_m_maps_are_exp_of_the_sum_of_rank2_plane_generators():
    enc = module(GrapeM, "grape_m", share_frequencies=False)
    randomize(enc, std=0.3)
    theta = enc.frequencies(0).detach()
    for h in range(2):
        A = dense_generator(frame_of(enc, h), theta[h])
        for t in TIMES:
            expected = torch.from_numpy(scipy.linalg.expm(t * A.numpy()))
            err = (query_map(enc, t)[h] - expected).abs().max().item()
            assert err < 1e-9, (h, t, err)


def test_grape_m_each_plane_is_rodrigues_and_the_planes_commute():
    enc = module(GrapeM, "grape_m")
    randomize(enc, std=0.3)
    frame, m = frame_of(enc, 1), 4
    eye = torch.eye(8, dtype=F64)
    planes = [torch.outer(frame[:, p + m], frame[:, p]) - torch.outer(frame[:, p], frame[:, p + m])
              for p in range(m)]
    for s in (0.3, 2.0, 100.0):
        product = eye
        for L in planes:
            rodrigues = eye + math.sin(s) * L + (1 - math.cos(s)) * L @ L
            torch.testing.assert_close(rodrigues, torch.linalg.matrix_exp(s * L), rtol=0,
                                       atol=1e-12)
            product = product @ rodrigues
        torch.testing.assert_close(product, torch.linalg.matrix_exp(s * sum(planes)), rtol=0,
                                   atol=1e-11)
    for L in planes[1:]:  # orthogonal planes commute
        torch.testing.assert_close(L @ planes[0], planes[0] @ L, rtol=0, atol=1e-14)


def test_grape_m_group_law_and_relative_law_at_offsets_up_to_10k():
    enc = module(GrapeM, "grape_m")
    randomize(enc, std=0.3)
    G = {t: query_map(enc, t) for t in (0, 3, 997, 1000, 10**4, 10**4 + 997)}
    eye = torch.eye(8, dtype=F64).expand(2, 8, 8)
    torch.testing.assert_close(G[0], eye, rtol=0, atol=1e-14)
    torch.testing.assert_close(G[3] @ G[997], G[1000], rtol=0, atol=1e-10)
    torch.testing.assert_close(G[10**4].transpose(-1, -2) @ G[10**4], eye, rtol=0, atol=1e-12)
    # q̃_i · k̃_j = q^T G(i)^T G(j) k depends on j - i alone
    torch.testing.assert_close(G[1000].transpose(-1, -2) @ G[10**4 + 997],
                               G[3].transpose(-1, -2) @ G[10**4], rtol=0, atol=1e-10)


def test_grape_m_with_a_learned_frame_is_rope_in_that_basis():
    """q̃ · k̃ under planes F equals RoPE's logit of F^T q and F^T k (Proposition 3.1)."""
    enc = module(GrapeM, "grape_m", n_head=1, d=16, learn_frequencies=False)
    randomize(enc, std=0.3)
    frame = frame_of(enc, 0)
    q, k = torch.randn(2, 1, 1, 50, 16, dtype=F64, generator=torch.Generator().manual_seed(0))
    pos = (torch.arange(50) * 211).view(1, 50)
    qt, kt = enc.rotate(q, k, pos, 0)
    cos, sin = rope_tables(pos, 10000.0 ** (-torch.arange(0, 16, 2, dtype=F64) / 16), F64)
    rq, rk = apply_rotary(q @ frame, cos, sin), apply_rotary(k @ frame, cos, sin)
    torch.testing.assert_close(qt @ kt.transpose(-1, -2), rq @ rk.transpose(-1, -2), rtol=0,
                               atol=1e-10)
    assert (frame - torch.eye(16, dtype=F64)).abs().max() > 0.1  # a real change of basis


@pytest.mark.parametrize("overrides", [[], ["encoding.planes=canonical",
                                            "encoding.learn_frequencies=false"]])
def test_grape_m_on_canonical_planes_with_ropes_spectrum_equals_rope(overrides):
    """Untrained grape_m starts there (S = 0, frequency shifts 0); with fixed canonical planes and
    frequencies it is RoPE's map, bit for bit."""
    grape, rope = build("grape_m", *overrides, seed=1), build("rope", seed=2)
    grape.load_state_dict(rope.state_dict(), strict=False)
    idx = torch.randint(0, 64, (2, 50), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        for pos in (None, torch.arange(50) + 12345):
            assert torch.equal(grape(idx, pos=pos), rope(idx, pos=pos))
    if not overrides:
        with torch.no_grad():
            grape.encoding.frame_generator.normal_(0, 0.1)
            assert (grape(idx) - rope(idx)).abs().max() > 1e-3  # planes off the canonical ones


def test_grape_m_frequencies_move_by_the_log_scale_and_every_parameter_learns():
    enc = module(GrapeM, "grape_m", n_head=4, d=16, n_layer=2)
    theta0 = 10000.0 ** (-torch.arange(0, 16, 2, dtype=F64) / 16)
    with torch.no_grad():
        enc.frequency_shift[1].fill_(16 * math.log(2))  # log θ moves by δ/16: θ doubles
    torch.testing.assert_close(enc.frequencies(1), 2 * theta0[None], rtol=1e-12, atol=0)
    torch.testing.assert_close(enc.frequencies(0), theta0[None], rtol=0, atol=0)
    assert enc.frequency_shift.shape == (2, 1, 8)  # per layer, shared by the heads
    assert enc.frame_generator.shape == (2, 4, 16 * 15 // 2)  # per layer and head
    model = build("grape_m")
    model.train()
    idx = torch.randint(0, 64, (2, 40), generator=torch.Generator().manual_seed(0))
    model(idx).logsumexp(-1).mean().backward()
    for name, p in model.encoding.named_parameters():
        assert p.grad is not None and p.grad.abs().sum() > 0, name


# --- GRAPE-A ---------------------------------------------------------------------------------
def lifted_logits(q, k, i, j, slope_ij):
    """(G(i) q̂)·(G(j)^{-T} k̂) for the lift q̂ = [q/sqrt(d); 1; 0], k̂ = [k; 0; 1] under
    G(t) = I + tA, A = -slope E, E = e_{d+2} e_{d+1}^T, G(j)^{-T} inverted and transposed as a
    matrix, float64."""
    d = q.shape[-1]
    E = torch.zeros(d + 2, d + 2, dtype=F64)
    E[d + 1, d] = 1.0
    A = -slope_ij * E
    assert torch.equal(A @ A, torch.zeros_like(A))  # nilpotent: G(t) = exp(tA) = I + tA
    eye = torch.eye(d + 2, dtype=F64)
    q_hat = torch.cat((q / math.sqrt(d), torch.tensor([1.0, 0.0], dtype=F64)))
    k_hat = torch.cat((k, torch.tensor([0.0, 1.0], dtype=F64)))
    return (eye + i * A) @ q_hat @ (torch.linalg.inv(eye + j * A).T @ k_hat)


def score_of(enc, q, k, pos, layer=0):
    """What the module's score_mod makes of q·k/sqrt(d), (B, H, T, T)."""
    B, H, T, d = q.shape
    fn = enc.score_mod(q, k, pos, layer)
    return fn(q @ k.transpose(-1, -2) / math.sqrt(d), torch.arange(B).view(B, 1, 1, 1),
              torch.arange(H).view(1, H, 1, 1), torch.arange(T).view(1, 1, T, 1),
              torch.arange(T).view(1, 1, 1, T))


@pytest.mark.parametrize("gate", ["none", "query", "key", "query_key"])
def test_grape_a_logit_is_the_unipotent_lift(gate):
    enc = module(GrapeA, "grape_a", n_head=4, gate=gate)
    randomize(enc, std=0.7)
    T, d = 12, 8
    q, k = torch.randn(2, 1, 4, T, d, dtype=F64, generator=torch.Generator().manual_seed(1))
    pos = (torch.arange(T) * 3 + 40).view(1, T)
    got = score_of(enc, q, k, pos)
    omega = torch.nn.functional.softplus(enc.omega_logit[0].detach())

    def gate_of(x, direction):  # λ = softplus(u·x / (|u| sqrt(d)))
        return torch.nn.functional.softplus(x @ direction / direction.norm() / math.sqrt(d))

    for h in range(4):
        rate = omega[h] * alibi_slopes(4)[h]
        for i in range(T):
            for j in range(i + 1):
                lam = 1.0
                if gate != "none":
                    lam = 0.0
                    if gate in ("query", "query_key"):
                        lam += gate_of(q[0, h, i], enc.query_gate[0, h].detach())
                    if gate in ("key", "query_key"):
                        lam += gate_of(k[0, h, j], enc.key_gate[0, h].detach())
                expected = lifted_logits(q[0, h, i], k[0, h, j], int(pos[0, i]), int(pos[0, j]),
                                         rate * lam)
                assert abs(got[0, h, i, j].item() - expected.item()) < 1e-12, (h, i, j)


@pytest.mark.parametrize("n_head", [8, 12])
def test_grape_a_with_alibis_slopes_equals_alibi_and_alibi_as_group(n_head):
    shape = [f"model.n_head={n_head}", f"model.d_model={8 * n_head}"]
    grape = build("grape_a", "encoding.gate=none", *shape, seed=1)
    alibi, group = build("alibi", *shape, seed=2), build("alibi_as_group", *shape, seed=3)
    grape.load_state_dict(alibi.state_dict(), strict=False)
    group.load_state_dict(alibi.state_dict(), strict=False)
    idx = torch.randint(0, 64, (2, 50), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        for pos in (None, torch.arange(50) + 300):
            expected = alibi(idx, pos=pos)
            # ω = softplus(ρ) = 1 exactly; ALiBi's fixed bias takes the lag-table SDPA path, whose
            # sums round differently from the generic score path's
            torch.testing.assert_close(grape(idx, pos=pos), expected, rtol=0, atol=1e-6)
            torch.testing.assert_close(group(idx, pos=pos), expected, rtol=0, atol=1e-6)


def test_grape_a_gates_with_zero_directions_give_alibi_at_omega_one_over_2_ln_2():
    """u = v = 0: λ_q = λ_k = softplus(0) = ln 2, so ω = 1/(2 ln 2) makes every slope m_h."""
    grape = build("grape_a", "encoding.omega_init=0.7213475204444817", seed=1)
    alibi = build("alibi", seed=2)
    grape.load_state_dict(alibi.state_dict(), strict=False)
    with torch.no_grad():
        grape.encoding.query_gate.zero_()
        grape.encoding.key_gate.zero_()
    idx = torch.randint(0, 64, (2, 50), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        expected = alibi(idx)
        err = (grape(idx) - expected).abs().max().item()
        assert err < 1e-5, err
        grape.encoding.key_gate.normal_()
        assert (grape(idx) - expected).abs().max() > 1e-3  # the gates matter once they look


@pytest.mark.parametrize("gate", ["none", "query_key"])
def test_grape_a_blockwise_path_matches_dense_float64_reference(gate, monkeypatch):
    enc = module(GrapeA, "grape_a", n_head=3, d=16, gate=gate)
    randomize(enc, std=0.7)
    B, H, T, d = 2, 3, 40, 16
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(B, H, T, d, generator=g, dtype=F64, requires_grad=True)
               for _ in range(3))
    pos = torch.arange(T).expand(B, T) + 7
    monkeypatch.setattr(attention, "BLOCK_ELEMENTS", B * H * T * 16)  # three blocks
    out = attend(q, k, v, pos, enc, 0)

    i, j = torch.arange(T).view(T, 1), torch.arange(T).view(1, T)
    rate = (torch.nn.functional.softplus(enc.omega_logit[0])
            * torch.tensor(alibi_slopes(H), dtype=F64)).view(1, H, 1, 1)
    slope = rate
    if gate == "query_key":
        def lam(x, u):
            unit = u / u.norm(dim=-1, keepdim=True)
            return torch.nn.functional.softplus((x * unit.view(1, H, 1, d)).sum(-1) / math.sqrt(d))

        query, key = lam(q, enc.query_gate[0]), lam(k, enc.key_gate[0])
        slope = rate * (query.unsqueeze(-1) + key.unsqueeze(-2))
    scores = q @ k.transpose(-1, -2) / math.sqrt(d) - slope * (i - j)
    ref = torch.softmax(scores.masked_fill(j > i, float("-inf")), -1) @ v
    assert_matches_reference(out, ref, (q, k, v, *enc.parameters()), rtol=1e-10, atol=1e-10,
                             grad_rtol=1e-9, grad_atol=1e-10)


def test_grape_a_memory_grows_with_length_not_its_square(monkeypatch):
    """At T = 1024 in blocks of 64 rows, no tensor holds more than one block's scores: the
    gates and factors are per token, (B, H, T)."""
    largest, block = largest_in_row_blocks(monkeypatch, build("grape_a").encoding,
                                           reads_input=False)
    assert largest <= block


def test_grape_a_parameters_per_gate():
    names = {gate: {n for n, _ in module(GrapeA, "grape_a", gate=gate).named_parameters()}
             for gate in ("none", "query", "key", "query_key")}
    assert names == {"none": {"omega_logit"}, "query": {"omega_logit", "query_gate"},
                     "key": {"omega_logit", "key_gate"},
                     "query_key": {"omega_logit", "query_gate", "key_gate"}}
    enc = module(GrapeA, "grape_a", n_head=8, d=64, n_layer=4)
    assert enc.query_gate.shape == (4, 8, 64)  # per layer and head, as the reference's u, v
    assert enc.query_gate.std().item() == pytest.approx(1 / 8, rel=0.05)  # N(0, 1/d)
    torch.testing.assert_close(torch.nn.functional.softplus(enc.omega_logit),  # ω starts at 1
                               torch.ones(4, 8, dtype=F64), rtol=1e-7, atol=0)


# --- both: the whole model --------------------------------------------------------------------
def sharpened(name, *extra):
    """Larger q/k weights and moved parameters, so that positions move the logits."""
    model = build(name, *extra)
    randomize(model.encoding, std=0.3)
    with torch.no_grad():
        for block in model.blocks:
            block.attn.qkv.weight[: 2 * 64] *= 10
    return model


@pytest.mark.parametrize("name", ["grape_m", "grape_a"])
def test_shift_invariance_of_the_whole_model_up_to_10k(name):
    model = sharpened(name)
    idx = torch.randint(0, 64, (2, 40), generator=torch.Generator().manual_seed(0))
    base = assert_shift_invariant(model, idx, offsets=OFFSETS, per_sequence=True)
    with torch.no_grad():
        assert (model(idx, pos=2 * torch.arange(40)) - base).abs().max() > 1e-3  # not a shift


@pytest.mark.parametrize("overrides,key", [
    (["encoding=grape_m", "encoding.planes=random"], "encoding.planes='random'"),
    (["encoding=grape_m", "encoding.base=1"], "encoding.base=1.0"),
    (["encoding=grape_m", "encoding.log_freq_scale=0"], "encoding.log_freq_scale=0.0"),
    (["encoding=grape_m", "model.d_model=66", "model.n_head=2"], "model.d_model/model.n_head=33"),
    (["encoding=grape_a", "encoding.gate=value"], "encoding.gate='value'"),
    (["encoding=grape_a", "encoding.omega_init=0"], "encoding.omega_init=0.0"),
])
def test_out_of_range_values_are_rejected_in_one_line(overrides, key):
    with pytest.raises(posbench.ConfigError) as err:
        posbench.compose(overrides)
    message = str(err.value)
    assert message.startswith(key + " is not accepted; expected") and "\n" not in message
