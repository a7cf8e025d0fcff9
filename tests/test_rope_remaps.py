"""Eval-time distance remaps of a trained RoPE model (docs/encodings.md#eval-time-options):
ReRoPE and its leaky form, Self-Extend, ShifTed RoPE (STRING). The oracle builds the remapped
lag of every (query, key) pair from the papers' formulas and the logits from it directly, as
q_i^T R(r) k_j in complex form, in float64; the attention's remapped path must match it."""
import math

import pytest
import torch

import posbench
from posbench.attention import paths as attention
from posbench.attention.paths import attend, attention_probs
from posbench.encodings import Dims
from posbench.encodings.rope import RoPE, remap_for
from posbench.core.errors import ConfigError

F64 = torch.float64
D, L, BASE = 16, 32, 1e4


def encoding(scaling="none", window=None, shift=None, factor=None, train_len=L):
    enc = RoPE(RoPE.Config(name="rope", base=BASE), Dims(1, 2, 2 * D, train_len, 16 * train_len))
    enc.set_eval_options(scaling, rope_scaling_factor=factor, rope_window=window,
                         rope_shift=shift)
    return enc


def remapped_lag(name, p_i, p_j, window, shift=None, factor=None, n=None):
    """The papers' remapped distance of query position p_i and key position p_j."""
    d = p_i - p_j
    if name == "rerope":  # Su 2023: clip at w; leaky: w + (d - w)/k beyond w
        if d < window:
            return float(d)
        return float(window) if factor is None else window + (d - window) / factor
    if name == "self_extend":  # Jin et al. 2024: grouped positions beyond the neighbour window
        if d < window:
            return float(d)
        g = factor or max(1, math.ceil((n - window) / (L - window)))
        return p_i // g - p_j // g + window - window / g
    return float(d) if d < shift else float(d - shift + window)  # STRING: d - S + W past S


def oracle(name, q, k, v, pos, **params):
    """Causal softmax of q_i^T R(r_ij) k_j / sqrt(d), R RoPE's rotation, r the remapped lag:
    per pair p, Re[(q1 + i q2)(k1 - i k2) e^(i theta_p r)] in the half-split layout."""
    B, H, T, d = q.shape
    theta = BASE ** (-torch.arange(0, d, 2, dtype=F64) / d)
    qc = torch.complex(q[..., :d // 2], q[..., d // 2:])
    kc = torch.complex(k[..., :d // 2], k[..., d // 2:])
    lag = torch.tensor([[[remapped_lag(name, int(pos[b, i]), int(pos[b, j]), n=T, **params)
                          if j <= i else 0.0 for j in range(T)] for i in range(T)]
                        for b in range(B)], dtype=F64)
    turn = torch.exp(1j * theta * lag[:, None, :, :, None])  # (B, 1, T, T, d/2)
    logits = (qc[:, :, :, None] * kc[:, :, None].conj() * turn).real.sum(-1)
    future = torch.ones(T, T, dtype=torch.bool).triu(1)
    probs = torch.softmax((logits / math.sqrt(d)).masked_fill(future, -math.inf), -1)
    return probs, probs @ v


CASES = [
    ("rerope", dict(window=5)),
    ("rerope", dict(window=5, factor=4.0)),
    ("self_extend", dict(window=7)),
    ("self_extend", dict(window=7, factor=3.0)),
    ("shifted_rope", dict(window=3, shift=11)),
]


@pytest.mark.parametrize("name,params", CASES)
@pytest.mark.parametrize("offset", [0, 7])
def test_remapped_attention_matches_the_oracle_across_blocks(name, params, offset, monkeypatch):
    monkeypatch.setattr(attention, "BLOCK_ELEMENTS", 1)  # blocks of 16 query rows: 3 of them
    T = 40
    gen = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(2, 2, T, D, dtype=F64, generator=gen) for _ in range(3))
    pos = (torch.arange(T) + offset).unsqueeze(0).expand(2, T)
    enc = encoding(name, **params)
    want_probs, want = oracle(name, q, k, v, pos, **params)
    torch.testing.assert_close(attend(q, k, v, pos, enc, 0), want, rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(attention_probs(q, k, pos, enc, 0, 8, 30),
                               want_probs[:, :, 8:30, :30], rtol=1e-10, atol=1e-12)


def test_each_sequence_of_the_batch_reads_its_own_positions():
    T = 24
    gen = torch.Generator().manual_seed(1)
    q, k, v = (torch.randn(2, 1, T, D, dtype=F64, generator=gen) for _ in range(3))
    pos = torch.stack([torch.arange(T), 3 * torch.arange(T) + 5])  # gaps in the second
    for name, params in CASES:
        got = attend(q, k, v, pos, encoding(name, **params), 0)
        torch.testing.assert_close(got, oracle(name, q, k, v, pos, **params)[1], rtol=1e-10,
                                   atol=1e-12)


@pytest.mark.parametrize("name,params", CASES)
def test_a_sequence_within_the_near_window_is_plain_rope(name, params):
    enc, plain = encoding(name, **params), encoding()
    near = params.get("shift") or params["window"]
    gen = torch.Generator().manual_seed(2)
    q, k, v = (torch.randn(1, 2, near, D, dtype=F64, generator=gen) for _ in range(3))
    pos = torch.arange(near).unsqueeze(0)
    rq, rk = plain.rotate(q, k, pos, 0)
    torch.testing.assert_close(attend(q, k, v, pos, enc, 0), attend(rq, rk, v, pos, plain, 0),
                               rtol=1e-12, atol=1e-12)


def test_defaults_follow_the_references_scaled_to_the_training_length():
    # ReRoPE w = 512 at L = 4096; Self-Extend W = 1024 at 4096; STRING S = L/3, W = 128 at 2048
    assert remap_for("rerope", 4096).window == 512
    assert remap_for("self_extend", 4096).window == 1024
    string = remap_for("shifted_rope", 2048)
    assert (string.shift, string.window) == (683, 128)
    small = [remap_for(name, 128) for name in ("rerope", "self_extend", "shifted_rope")]
    assert [(r.window, r.shift) for r in small] == [(16, None), (32, None), (8, 43)]


def test_dynamic_group_keeps_every_remapped_lag_below_the_training_length():
    for n in (L, L + 1, 4 * L, 16 * L):
        remap = remap_for("self_extend", L)
        g = remap.group(n)
        assert g == max(1, math.ceil((n - remap.window) / (L - remap.window)))
        q_pos, k_pos = remap.far_positions(torch.arange(n).view(1, -1), n)
        assert (q_pos[0, -1] - k_pos[0, 0]).item() < L  # the longest lag of the sequence
        if n <= L:
            assert g == 1


def test_self_extend_with_group_one_is_plain_rope_at_any_length():
    T = 3 * L
    gen = torch.Generator().manual_seed(3)
    q, k, v = (torch.randn(1, 2, T, D, dtype=F64, generator=gen) for _ in range(3))
    pos = torch.arange(T).unsqueeze(0)
    enc, plain = encoding("self_extend", window=6), encoding()
    enc.remapping = enc.remapping._replace(factor=1)
    rq, rk = plain.rotate(q, k, pos, 0)
    torch.testing.assert_close(attend(q, k, v, pos, enc, 0), attend(rq, rk, v, pos, plain, 0),
                               rtol=1e-12, atol=1e-12)


def test_options_set_and_cleared_swap_rotate_for_the_remap_hook():
    enc = encoding("rerope")
    assert enc.rotate is None and enc.remap is not None
    enc.set_eval_options()
    assert enc.remap is None and enc.rotate is not None


def test_a_model_evaluated_with_a_remap_changes_only_queries_with_far_keys():
    cfg = posbench.compose(["model.n_layer=1", "model.d_model=32", "model.n_head=2",
                            "train.seq_len=32", "eval.rope_scaling=rerope"])
    torch.manual_seed(0)
    model = posbench.build_model(cfg, 64).eval()
    x = torch.randint(0, 64, (1, 64), generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        plain = model(x)
        model.encoding.set_eval_options("rerope")  # w = 32/8 = 4
        remapped = model(x)
    torch.testing.assert_close(remapped[:, :4], plain[:, :4])
    assert (remapped[:, 4:] - plain[:, 4:]).abs().amax() > 1e-4


@pytest.mark.parametrize("overrides,words", [
    (["encoding=alibi", "eval.rope_scaling=rerope"], "does not rotate q and k"),
    (["encoding=xpos", "eval.rope_scaling=self_extend"],
     "rotate by RoPE alone: clipped_rope, hope, p_rope"),
    (["encoding=randomized", "eval.rope_scaling=shifted_rope"], "rotate by RoPE alone"),
    (["eval.rope_window=4"], "eval.rope_window=4 is not accepted; expected null unless"),
    (["eval.rope_scaling=rerope", "eval.rope_shift=8"], "null unless eval.rope_scaling=shifted"),
    (["eval.rope_scaling=self_extend", "eval.rope_scaling_factor=2.5"], "an integer group"),
    (["eval.rope_scaling=self_extend", "eval.rope_window=128"], "below train.seq_len=128"),
    (["eval.rope_scaling=shifted_rope", "eval.rope_scaling_factor=2"], "null for shifted_rope"),
    (["eval.rope_scaling=shifted_rope", "eval.rope_window=50"], "below the shift S=43"),
    (["eval.rope_scaling=rerope", "eval.rope_window=0"], "a positive integer"),
])
def test_refused_in_one_line(overrides, words):
    with pytest.raises(ConfigError) as err:
        posbench.compose(overrides)
    assert words in str(err.value) and "\n" not in str(err.value)
