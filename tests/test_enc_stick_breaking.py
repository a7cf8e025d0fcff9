"""Stick-breaking attention (docs/encodings.md#contextual-family). The oracle breaks the stick
literally, one key at a time from the nearest to the farthest, in float64, independently of
stick_breaking.py's sums of logs."""
import functools
import math

import pytest
import torch

import posbench.attention.paths as attention
from posbench.attention.paths import attend
from posbench.encodings.stick_breaking import stick_breaking

from helpers import assert_matches_reference, assert_position_ids_are_never_read, tiny_model
from test_attention_paths import largest_in_row_blocks

F64 = torch.float64


build = functools.partial(tiny_model, name="stick_breaking")


def broken_stick(z):
    """A[i, j] for j < i and the leftover of each row, z (T, T) float64, by the process itself."""
    T = z.shape[0]
    A, leftover = torch.zeros(T, T, dtype=F64), torch.zeros(T, dtype=F64)
    for i in range(T):
        stick = 1.0
        for j in range(i - 1, -1, -1):
            share = torch.sigmoid(z[i, j]).item()
            A[i, j] = stick * share
            stick *= 1 - share
        leftover[i] = stick
    return A, leftover


def dense_output(q, k, v):
    """Σ_j A_ij v_j + leftover_i v_i, (B, H, T, d), from the process, differentiable."""
    B, H, T, d = q.shape
    z = q @ k.transpose(-1, -2) / math.sqrt(d)
    beta = torch.sigmoid(z)
    rows = []
    for i in range(T):
        stick = torch.ones(B, H, dtype=F64)
        out = torch.zeros(B, H, d, dtype=F64)
        for j in range(i - 1, -1, -1):
            out = out + (stick * beta[:, :, i, j])[..., None] * v[:, :, j]
            stick = stick * (1 - beta[:, :, i, j])
        rows.append(out + stick[..., None] * v[:, :, i])
    return torch.stack(rows, 2)


def indices(T):
    return torch.arange(T).view(T, 1), torch.arange(T).view(1, T)


def test_weights_are_the_broken_stick_and_the_leftover_is_returned():
    z = torch.randn(40, 40, dtype=F64, generator=torch.Generator().manual_seed(0)) * 3
    log_A, log_left = stick_breaking(z, *indices(40))
    A, leftover = broken_stick(z)
    torch.testing.assert_close(log_A.exp(), A, rtol=1e-12, atol=1e-15)
    torch.testing.assert_close(log_left.exp()[:, 0], leftover, rtol=1e-12, atol=1e-15)
    weights = log_A.exp()
    assert ((weights >= 0) & (weights <= 1)).all()
    assert (weights.sum(-1) <= 1 + 1e-12).all() and weights.sum(-1)[1:].min() > 0
    torch.testing.assert_close(weights.sum(-1) + leftover, torch.ones(40, dtype=F64), rtol=0,
                               atol=1e-12)
    assert torch.equal(weights.triu(), torch.zeros(40, 40, dtype=F64))  # keys before the query


def test_equal_scores_favour_the_nearest_key_geometrically():
    """z constant: A_ij = β (1 - β)^(i-1-j), the most recent key first; softmax would be flat."""
    beta = torch.sigmoid(torch.tensor(0.7, dtype=F64))
    log_A, log_left = stick_breaking(torch.full((12, 12), 0.7, dtype=F64), *indices(12))
    i, j = indices(12)
    expected = torch.where(j < i, beta * (1 - beta) ** (i - 1 - j), torch.zeros((), dtype=F64))
    torch.testing.assert_close(log_A.exp(), expected, rtol=1e-12, atol=0)
    torch.testing.assert_close(log_left[:, 0].exp(), (1 - beta) ** torch.arange(12.0, dtype=F64),
                               rtol=1e-12, atol=0)


def test_the_row_sums_to_one_so_the_softmax_leaves_it_alone():
    enc = build().encoding
    z = torch.randn(1, 4, 30, 30, dtype=F64, generator=torch.Generator().manual_seed(1)) * 4
    i, j = indices(30)
    rows = enc.row_mod(z.masked_fill(j > i, float("-inf")), None, None, None, 0, i, j)
    rows = rows.masked_fill(j > i, float("-inf"))
    torch.testing.assert_close(rows.logsumexp(-1), torch.zeros(1, 4, 30, dtype=F64), rtol=0,
                               atol=1e-12)
    torch.testing.assert_close(torch.softmax(rows, -1), rows.exp(), rtol=1e-12, atol=1e-15)


@pytest.mark.parametrize("blocks", ["one", "several"])
def test_blockwise_path_matches_dense_float64_reference(blocks, monkeypatch):
    enc = build().encoding
    B, H, T, d = 2, 3, 26, 8
    if blocks == "several":  # blocks of 16 rows, each checkpointed
        monkeypatch.setattr(attention, "BLOCK_ELEMENTS", B * H * T * 16)
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(B, H, T, d, generator=g, dtype=F64) * 2 for _ in range(3))
    q, k, v = (t.requires_grad_() for t in (q, k, v))
    out = attend(q, k, v, torch.arange(T).expand(B, T), enc, 0)
    assert_matches_reference(out, dense_output(q, k, v), (q, k, v), rtol=1e-10, atol=1e-10,
                             grad_rtol=1e-9, grad_atol=1e-10)


def test_the_first_token_returns_its_own_value():
    enc = build().encoding
    q, k, v = (torch.randn(1, 4, 5, 16, generator=torch.Generator().manual_seed(s))
               for s in range(3))
    out = attend(q, k, v, torch.arange(5).expand(1, 5), enc, 0)
    torch.testing.assert_close(out[:, :, 0], v[:, :, 0])  # no key before it: the whole stick


def test_position_ids_are_never_read():
    assert_position_ids_are_never_read(build())


def test_memory_grows_with_length_not_its_square(monkeypatch):
    largest, block = largest_in_row_blocks(monkeypatch, build().encoding, reads_input=False)
    assert largest <= block
