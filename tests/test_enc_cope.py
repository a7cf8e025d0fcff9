"""CoPE (docs/encodings.md#contextual-family): gated counts as positions, interpolated table."""
import math

import pytest
import torch

import posbench
import posbench.attention.paths as attention
from posbench.attention.paths import attend
from posbench.encodings.cope import contextual_positions, interpolate

from helpers import assert_matches_reference, assert_shift_invariant


def build(encoding="cope", *extra, random_table=True):
    cfg = posbench.compose([f"encoding={encoding}", "model.n_layer=2", "model.d_model=64",
                            "model.n_head=4", *extra])
    torch.manual_seed(0)
    model = posbench.build_model(cfg).eval()
    if random_table:  # the init is zero, which would make every position test vacuous
        with torch.no_grad():
            model.encoding.pos_emb.normal_()
    return model


def masked(logits):
    T = logits.shape[-1]
    return logits.masked_fill(torch.ones(T, T, dtype=torch.bool).triu(1), float("-inf"))


def test_open_gates_count_the_relative_position_up_to_p_max():
    T = 100
    p = contextual_positions(masked(torch.full((T, T), float("inf"))), 64)
    i, j = torch.arange(T).view(T, 1), torch.arange(T).view(1, T)
    causal = j <= i
    assert torch.equal(p[causal], (i - j + 1).clamp(max=63).expand(T, T)[causal].float())
    assert torch.equal(p[~causal], torch.zeros(int((~causal).sum())))


def test_positions_are_non_increasing_in_j_and_count_only_up_to_i():
    logits = masked(torch.randn(3, 50, 50, generator=torch.Generator().manual_seed(0)) * 4)
    p = contextual_positions(logits, 64)
    assert (p.diff(dim=-1) <= 1e-6).all()
    gates = torch.sigmoid(logits)
    torch.testing.assert_close(p[:, 30, 10], gates[:, 30, 10:31].sum(-1))
    torch.testing.assert_close(p.diagonal(dim1=-2, dim2=-1), gates.diagonal(dim1=-2, dim2=-1))


def test_interpolation_is_exact_at_integers_and_linear_between():
    table = torch.randn(2, 7, 64, generator=torch.Generator().manual_seed(0))
    p = torch.randint(0, 64, (2, 7, 9)).float()
    assert torch.equal(interpolate(table, p), table.gather(-1, p.long()))
    frac = (p.clamp(max=62) + 0.25)
    lo, hi = table.gather(-1, frac.floor().long()), table.gather(-1, frac.ceil().long())
    torch.testing.assert_close(interpolate(table, frac), 0.75 * lo + 0.25 * hi)


def dense_reference(q, k, v, table, p_max):
    """Logits of 5.2 entry by entry in float64 Python loops over (i, j)."""
    B, H, T, d = q.shape
    s = masked(q @ k.transpose(-1, -2) / math.sqrt(d))
    gates = torch.sigmoid(s)
    qe = q @ table  # (B, H, T, P_max)
    z = torch.zeros_like(s)
    for i in range(T):
        for j in range(i + 1):
            p = gates[..., i, j:i + 1].sum(-1).clamp(max=p_max - 1)
            lo, hi = p.floor().long(), p.ceil().long()
            w = p - lo
            e_lo = qe[..., i, :].gather(-1, lo.unsqueeze(-1)).squeeze(-1)
            e_hi = qe[..., i, :].gather(-1, hi.unsqueeze(-1)).squeeze(-1)
            z[..., i, j] = (1 - w) * e_lo + w * e_hi
    return torch.softmax(s + z, -1) @ v


def test_blockwise_path_matches_dense_float64_reference(monkeypatch):
    enc = build("cope", "model.n_head=3", "model.d_model=48", "encoding.p_max=8").encoding
    torch.manual_seed(0)
    B, H, T, d = 2, 3, 40, 16
    q, k, v = (torch.randn(B, H, T, d, dtype=torch.float64, requires_grad=True) for _ in range(3))
    pos = torch.arange(T).expand(B, T)
    monkeypatch.setattr(attention, "BLOCK_ELEMENTS", B * H * T * 16)  # three blocks, checkpointed
    out = attend(q, k, v, pos, enc, 1)
    ref = dense_reference(q, k, v, enc.pos_emb[1].double(), 8)  # counts reach the clamp at 7
    assert_matches_reference(out, ref, (q, k, v, enc.pos_emb))


def test_counts_under_bf16_autocast_keep_fp32_precision():
    """The row_mod on bf16 logits and queries (what autocast's matmuls give it) against float64
    on the same values, whose counts are float64 sums over j..i (not the module's reversed
    cumsum). The added term may lose what autocast's bf16 matmul q.e costs, and no more: counted
    in bf16, it lost 50 times that."""
    enc = build().encoding
    B, H, T, d = 1, 4, 256, 16
    gen = torch.Generator().manual_seed(0)
    q, k = (torch.randn(2, B, H, T, d, generator=gen) * 3).bfloat16()  # gates from 0 to 1
    q_idx, kv_idx = torch.arange(T).view(1, 1, T, 1), torch.arange(T).view(1, 1, 1, T)
    logits = masked((q.float() @ k.float().transpose(-1, -2) / math.sqrt(d)).bfloat16())
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
        term = enc.row_mod(logits, q, k, None, 1, q_idx, kv_idx).double() - logits.double()
    gates = torch.sigmoid(logits.double())
    counts = (gates.sum(-1, keepdim=True) - gates.cumsum(-1) + gates).clamp(0, 63)
    emb = enc.pos_emb[1].detach()
    expected = interpolate(q.double() @ emb.double(), counts)
    # bf16 alone: the table as autocast's matmul makes it, from a bf16 table and rounded to bf16
    rounded = interpolate((q.double() @ emb.bfloat16().double()).bfloat16().double(), counts)
    causal = (kv_idx <= q_idx).expand_as(term)
    err, bf16 = ((t - expected)[causal].abs().max() for t in (term, rounded))
    assert err < 2 * bf16, (err, bf16)


def test_shift_leaves_model_logits_unchanged():
    model = build()
    idx = torch.randint(0, 256, (2, 64), generator=torch.Generator().manual_seed(0))
    base = assert_shift_invariant(model, idx)
    with torch.no_grad():
        # not vacuous: the contextual positions move the logits (nope: same weights, no table)
        assert (base - build("nope", random_table=False)(idx)).abs().max() > 1e-3


def test_table_per_layer_shared_by_heads_and_zero_init_is_position_blind():
    model = build(random_table=False)
    assert model.encoding.pos_emb.shape == (2, 16, 64)
    assert not model.encoding.pos_emb.any()
    idx = torch.randint(0, 256, (1, 40), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        torch.testing.assert_close(model(idx), build("nope", random_table=False)(idx))


def test_p_max_below_two_is_one_line_config_error():
    with pytest.raises(posbench.ConfigError, match=r"encoding\.p_max=1 .*integer >= 2") as err:
        posbench.compose(["encoding=cope", "encoding.p_max=1"])
    assert "\n" not in str(err.value)
