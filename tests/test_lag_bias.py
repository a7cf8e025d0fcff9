"""posbench/attention/lag_bias.py: attention under a bias read from one table of lags
(lag_only_bias), from each block's table by query row and lag (the lag_rows hook), under a decay
e^{a lag} through scaled queries and keys (the lag_decay hook), or with a low-rank bias as more
coordinates of the queries and keys (the bias_factors hook), against a dense float64 reference
(forward and backward), and the flag and hooks that send an encoding there."""
import math

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

import posbench
import posbench.attention.lag_bias as lag_bias
from posbench.attention.paths import attend, blockwise_attention
from posbench.encodings import registry
from helpers import composed, registered_encoding

B, H, T, D = 3, 4, 50, 8


def encoding(name):
    cfg = composed(f"encoding={name}", "model.n_layer=2", "model.d_model=32", f"model.n_head={H}",
                   "train.seq_len=32", "eval.lengths=[64]")
    torch.manual_seed(0)
    enc = posbench.build_model(cfg, 256).encoding.double()
    with torch.no_grad():  # learned biases start small or at zero: make them matter, in range
        for p in enc.parameters():
            p.uniform_(0.1, 1.5)
    return enc


LAG_ONLY = [n for n in sorted(registry()) if registered_encoding(n, H).lag_only_bias]
# encodings whose bias the CPU path reads by query row and lag at evaluation
LAG_ROWS = [n for n in sorted(registry()) if registered_encoding(n, H).lag_rows is not None]
# encodings whose score_mod is a decay e^{a lag} alone
LAG_DECAY = [n for n in sorted(registry()) if registered_encoding(n, H).lag_decay is not None]
# encodings whose bias is a row term and a low-rank term
FACTORED = [n for n in sorted(registry()) if registered_encoding(n, H).bias_factors is not None]


def layer_input(enc, dtype=torch.float64):
    """x= (B, T, 32) for an encoding that reads the attention's input; nothing otherwise."""
    if not enc.reads_input:
        return {}
    x = torch.randn(B, T, 32, generator=torch.Generator().manual_seed(2), dtype=torch.float64)
    return {"x": x.to(dtype)}


def grid(n):
    return torch.arange(n).view(1, 1, n, 1), torch.arange(n).view(1, 1, 1, n)


def bias_on(enc, pos, q=None, k=None, **inputs):
    """The score_mod's bias at every (b, h, i, j) of positions pos (B', n)."""
    fn = enc.score_mod(q, k, pos, 0, **inputs)
    b, h = torch.arange(pos.shape[0]).view(-1, 1, 1, 1), torch.arange(H).view(1, H, 1, 1)
    return fn(torch.zeros((), dtype=torch.float64), b, h, *grid(pos.shape[1]))


def dense_reference(q, k, v, enc, pos, multiplies=False, **inputs):
    """softmax(causal(q k^T / sqrt(d) + bias)) v over the full (B, H, T, T) scores; with
    `multiplies`, the score_mod applied to the scores themselves."""
    q_idx, kv_idx = grid(q.shape[2])
    scores = q @ k.transpose(-2, -1) / math.sqrt(q.shape[-1])
    if multiplies:
        b, h = torch.arange(q.shape[0]).view(-1, 1, 1, 1), torch.arange(H).view(1, H, 1, 1)
        scores = enc.score_mod(q, k, pos, 0)(scores, b, h, q_idx, kv_idx)
    else:
        scores = scores + bias_on(enc, pos, q, k, **inputs)
    return torch.softmax(scores.masked_fill(kv_idx > q_idx, float("-inf")), -1) @ v


def test_the_lag_only_encodings():
    assert {"alibi", "t5", "kerple_log", "kerple_power", "sandwich"} <= set(LAG_ONLY)
    assert not {"fire", "transformer_xl", "fox"} & set(LAG_ONLY)  # the query's span, content
    assert all(encoding(name).additive_score_mod for name in LAG_ONLY)


@pytest.mark.parametrize("name", LAG_ONLY)
def test_the_bias_is_a_function_of_the_head_and_the_lag(name):
    """The flag's promise: the same bias wherever pos_i - pos_j is the same, in any sequence, at
    any offset and at any spacing of the positions (as evaluated: a training step's positions
    are its own, 0..T-1 and PoSE's)."""
    n = 3 * T
    enc = encoding(name).eval()
    unit = bias_on(enc, torch.arange(n).unsqueeze(0))[0]  # (H, n, n) at offset 0
    causal = torch.ones(T, T, dtype=torch.bool).tril()
    for offset in (5, 1000):  # lag i - j: the same bias on every diagonal
        shifted = bias_on(enc, torch.arange(offset, offset + T).unsqueeze(0))[0]
        torch.testing.assert_close(shifted[:, causal], unit[:, :T, :T][:, causal])
    spread = bias_on(enc, (3 * torch.arange(T) + 7).unsqueeze(0))[0]  # lags 3(i - j)
    torch.testing.assert_close(spread[:, causal], unit[:, ::3, ::3][:, causal])


@pytest.mark.parametrize("train", [False, True], ids=["eval", "train"])
@pytest.mark.parametrize("name", LAG_ONLY)
def test_attend_through_the_lag_table_matches_the_dense_reference(name, train, monkeypatch):
    """Blocks of 16 queries (the last one of 2); taken at evaluation and in training unless the
    bias is learned (then the blockwise path computes its gradient)."""
    monkeypatch.setattr(lag_bias, "ROWS", 16)
    calls = []
    monkeypatch.setattr(lag_bias, "lag_bias_attention",
                        lambda *a, f=lag_bias.lag_bias_attention: calls.append(1) or f(*a))
    monkeypatch.setattr(posbench.attention.paths, "lag_bias_attention", lag_bias.lag_bias_attention)
    enc = encoding(name)
    g = torch.Generator().manual_seed(1)
    q, k, v = (torch.randn(B, H, T, D, generator=g, dtype=torch.float64, requires_grad=train)
               for _ in range(3))
    pos = torch.arange(5, 5 + T).expand(B, T)
    with torch.set_grad_enabled(train):
        out = attend(q, k, v, pos, enc, 0)
        ref = dense_reference(q, k, v, enc, pos)
    torch.testing.assert_close(out, ref, rtol=1e-10, atol=1e-10)
    learned = any(p.requires_grad for p in enc.parameters())
    assert bool(calls) == (not train or not learned)
    if train:
        wrt = (q, k, v, *enc.parameters())
        probe = torch.randn(ref.shape, generator=g, dtype=torch.float64)
        grads = torch.autograd.grad((out * probe).sum(), wrt, allow_unused=True)
        for got, want in zip(grads, torch.autograd.grad((ref * probe).sum(), wrt,
                                                        allow_unused=True)):
            torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-10)


@pytest.mark.parametrize("name", [n for n in LAG_ONLY if any(
    p.requires_grad for p in registered_encoding(n, H).parameters())])
def test_a_learned_table_in_one_masked_call_matches_the_dense_reference(name):
    """CUDA's training path for a learned bias of the lag (run here on the CPU, where SDPA takes
    the same mask): output and every gradient, the table's summed along the mask's diagonals."""
    enc = encoding(name)
    g = torch.Generator().manual_seed(3)
    q, k, v = (torch.randn(B, H, T, D, generator=g, dtype=torch.float64, requires_grad=True)
               for _ in range(3))
    pos = torch.arange(T).expand(B, T)
    table = lag_bias.lag_table(enc.score_mod(q, k, pos, 0), pos, H, torch.float64)
    assert table.requires_grad
    out = lag_bias.learned_lag_bias_attention(q, k, v, table)
    ref = dense_reference(q, k, v, enc, pos)
    torch.testing.assert_close(out, ref, rtol=1e-10, atol=1e-10)
    wrt = (q, k, v, *enc.parameters())
    probe = torch.randn(ref.shape, generator=g, dtype=torch.float64)
    grads = torch.autograd.grad((out * probe).sum(), wrt)
    for got, want in zip(grads, torch.autograd.grad((ref * probe).sum(), wrt)):
        torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-10)


def test_lag_table_only_for_one_unit_step_row():
    enc = encoding("alibi")

    def table(pos):
        return lag_bias.lag_table(enc.score_mod(None, None, pos, 0), pos, H, torch.float64)

    expected = -enc.slopes.view(H, 1) * torch.arange(T)  # ALiBi: -m_h * lag
    torch.testing.assert_close(table(torch.arange(T).expand(B, T)), expected)
    torch.testing.assert_close(table(torch.arange(9, 9 + T).unsqueeze(0)), expected)  # B = 1
    assert table(torch.arange(T).repeat(B, 1) + torch.tensor([[0], [7], [1000]])) is None
    assert table((2 * torch.arange(T)).expand(B, T)) is None


def test_the_lag_rows_encodings():
    assert {"fire", "transformer_xl"} <= set(LAG_ROWS)
    assert all(encoding(name).additive_score_mod for name in LAG_ROWS)


@pytest.mark.parametrize("offsets", [(5, 5, 5), (0, 7, 1000)], ids=["shared", "per-row"])
@pytest.mark.parametrize("name", LAG_ROWS)
def test_evaluation_by_query_row_and_lag_matches_the_dense_reference(name, offsets, monkeypatch):
    """Blocks of 16 queries (the last one of 2), positions stepping by one from any offset: the
    attention of the score_mod's bias; with positions that step by more, the path declines."""
    monkeypatch.setattr(lag_bias, "ROWS", 16)
    calls = []
    monkeypatch.setattr(posbench.attention.paths, "lag_rows_attention",
                        lambda *a, f=lag_bias.lag_rows_attention: calls.append(1) or f(*a))
    enc = encoding(name)
    g = torch.Generator().manual_seed(1)
    q, k, v = (torch.randn(B, H, T, D, generator=g, dtype=torch.float64) for _ in range(3))
    shift = torch.tensor(offsets).view(B, 1)
    for step, taken in ((1, True), (2, False)):
        pos = step * torch.arange(T) + shift
        if len(set(offsets)) == 1:
            pos = pos[:1].expand(B, T)  # the model's shared row
        calls.clear()
        with torch.no_grad():
            out = attend(q, k, v, pos, enc, 0)
            torch.testing.assert_close(out, dense_reference(q, k, v, enc, pos), rtol=1e-10,
                                       atol=1e-10)
        assert bool(calls) == taken


@pytest.mark.parametrize("name", ["alibi", "transformer_xl"])
def test_a_compiled_graph_reads_no_positions(name, monkeypatch):
    """A compiled graph cannot read whether positions step by one (a host read): there the lag
    paths run only where the caller knows the positions are the index, and evaluation's paths
    never (here with the compiler's flag set by hand)."""
    monkeypatch.setattr(lag_bias, "lag_is_index_difference", lambda pos: pytest.fail("read"))
    monkeypatch.setattr(torch.compiler, "is_compiling", lambda: True)
    calls = []
    for path in ("lag_bias_attention", "lag_rows_attention"):
        real = getattr(posbench.attention.paths, path)
        monkeypatch.setattr(posbench.attention.paths, path,
                            lambda *a, f=real, p=path: calls.append(p) or f(*a))
    enc = encoding(name)
    q, k, v = (torch.randn(1, H, T, D, dtype=torch.float64) for _ in range(3))
    pos = torch.arange(T).expand(1, T)
    for pos_is_index in (False, True):
        with torch.no_grad():
            out = attend(q, k, v, pos, enc, 0, pos_is_index=pos_is_index)
        torch.testing.assert_close(out, dense_reference(q, k, v, enc, pos), rtol=1e-10,
                                   atol=1e-10)
    assert calls == (["lag_bias_attention"] if name == "alibi" else [])


def test_steps_by_one_trusts_the_index_and_reads_positions_only_eagerly(monkeypatch):
    unit, doubled = torch.arange(T).expand(B, T), (2 * torch.arange(T)).expand(B, T)
    assert lag_bias.steps_by_one(unit, False) and not lag_bias.steps_by_one(doubled, False)
    monkeypatch.setattr(torch.compiler, "is_compiling", lambda: True)
    assert not lag_bias.steps_by_one(unit, False) and lag_bias.steps_by_one(unit, True)


def test_the_decay_encodings():
    assert {"decay", "damped_rope", "generator_learned"} <= set(LAG_DECAY)
    assert "alibi_as_group" not in LAG_DECAY


@pytest.mark.parametrize("steep", [False, True], ids=["retnet", "steep"])
@pytest.mark.parametrize("offsets", [(5, 5, 5), (0, 7, 1000)], ids=["shared", "per-row"])
@pytest.mark.parametrize("name", LAG_DECAY)
def test_evaluation_with_scaled_queries_and_keys_matches_the_dense_reference(name, offsets, steep,
                                                                             monkeypatch):
    """Blocks of 16 queries, or of 60 / |a| when the decay is steeper (a = -5: blocks of 12, and
    keys 17 and more rows back decay below e^-80): the attention of the score_mod."""
    monkeypatch.setattr(lag_bias, "ROWS", 16)
    calls = []
    monkeypatch.setattr(posbench.attention.paths, "decay_attention",
                        lambda *a, f=lag_bias.decay_attention: calls.append(1) or f(*a))
    enc = encoding(name)
    if steep:
        monkeypatch.setattr(enc, "lag_decay", lambda layer: torch.full((H,), -5.0))
        monkeypatch.setattr(enc, "decay_rates", lambda: torch.full((H,), -5.0))
    g = torch.Generator().manual_seed(1)
    q, k, v = (torch.randn(B, H, T, D, generator=g, dtype=torch.float64) for _ in range(3))
    for step, taken in ((1, True), (2, False)):
        pos = step * torch.arange(T) + torch.tensor(offsets).view(B, 1)
        calls.clear()
        with torch.no_grad():
            out = attend(q, k, v, pos, enc, 0)
            torch.testing.assert_close(out, dense_reference(q, k, v, enc, pos, multiplies=True),
                                       rtol=1e-10, atol=1e-10)
        assert bool(calls) == taken


def test_the_factored_bias_encodings():
    assert {"fox", "grape_a"} <= set(FACTORED)


@pytest.mark.parametrize("name", FACTORED)
@pytest.mark.parametrize("origin", [0, 17, T - 1])
def test_the_bias_is_a_row_term_and_the_factors_product(name, origin):
    """The hook's promise: bias(i, j) - a_i . b_j does not depend on j (keys j <= i), from
    any origin, on positions that start at an offset per sequence."""
    enc = encoding(name)
    pos = torch.arange(T) + torch.tensor([0, 5, 300]).view(B, 1)
    g = torch.Generator().manual_seed(3)
    q, k = (torch.randn(B, H, T, D, generator=g, dtype=torch.float64) for _ in range(2))
    a, b = enc.bias_factors(q, k, pos, 0, **layer_input(enc))(origin)
    rest = bias_on(enc, pos, q, k, **layer_input(enc)) - a.expand(B, H, T, -1) @ b.expand(
        B, H, T, -1).transpose(-1, -2)
    causal = torch.ones(T, T, dtype=torch.bool).tril()
    rows = rest.masked_fill(~causal, float("nan"))
    first = rows[..., :1].expand_as(rows).masked_fill(~causal, float("nan"))
    torch.testing.assert_close(rows, first, equal_nan=True)


@pytest.mark.parametrize("name", FACTORED)
def test_evaluation_with_the_factored_bias_matches_the_dense_reference(name, monkeypatch):
    """Blocks of 16 queries and a bias that runs to -150 logits over the row (FoX's gates
    forgetting about 3 nats a token, GRAPE-A's slopes times 5): the float64 reference; in fp32,
    no further from it than the score_mod's own blockwise path, plus fp32's rounding of the row
    term that the path leaves in the logits: each block measures the factors from its own last
    key o, so that term is at most the bias across one block (FoX's c_i - c_o, GRAPE-A's
    -ω m λ_q(q_i) (p_i - p_o))."""
    monkeypatch.setattr(lag_bias, "ROWS", 16)
    calls = []
    monkeypatch.setattr(posbench.attention.paths, "factored_bias_attention",
                        lambda *a, f=lag_bias.factored_bias_attention: calls.append(1) or f(*a))
    enc = encoding(name)
    with torch.no_grad():
        if hasattr(enc, "gate_bias"):
            enc.gate_bias.fill_(-3.0)
        if hasattr(enc, "slopes"):
            enc.slopes.mul_(5)
    g = torch.Generator().manual_seed(1)
    q, k, v = (torch.randn(B, H, T, D, generator=g, dtype=torch.float64) for _ in range(3))
    pos = torch.arange(T).expand(B, T)
    with torch.no_grad():
        ref = dense_reference(q, k, v, enc, pos, **layer_input(enc))
        assert bias_on(enc, pos, q, k, **layer_input(enc)).tril().min() < -100
        torch.testing.assert_close(attend(q, k, v, pos, enc, 0, **layer_input(enc)), ref,
                                   rtol=1e-10, atol=1e-10)
        q, k, v, enc = q.float(), k.float(), v.float(), enc.float()
        x = layer_input(enc, torch.float32)
        error = (attend(q, k, v, pos, enc, 0, **x).double() - ref).abs().max()
        own = blockwise_attention(q, k, v, enc.score_mod(q, k, pos, 0, **x), additive=True)
        a, b = enc.bias_factors(q, k, pos, 0, **x)(lag_bias.ROWS - 1)  # the first block's
        row_term = ((a * b).sum(-1) - bias_on(enc, pos, q, k, **x).diagonal(dim1=-2, dim2=-1))
        rounding = torch.finfo(torch.float32).eps * row_term[..., :lag_bias.ROWS].abs().max()
    assert calls and error <= 1.5 * (own.double() - ref).abs().max() + rounding + 1e-7


def test_training_keeps_the_score_mod():
    """The gradient of a learned bias goes through the blockwise path, not the lag rows."""
    enc = encoding("transformer_xl")
    q, k, v = (torch.randn(1, H, T, D, dtype=torch.float64, requires_grad=True)
               for _ in range(3))
    pos = torch.arange(T).expand(1, T)
    out = attend(q, k, v, pos, enc, 0)
    wrt = (q, k, v, enc.u, enc.v, enc.w_r)
    grads = torch.autograd.grad(out.sum(), wrt)
    ref = torch.autograd.grad(dense_reference(q, k, v, enc, pos).sum(), wrt)
    for got, want in zip(grads, ref):
        torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-10)


class LargestStorage(TorchDispatchMode):
    """The bytes of the largest memory any op's output holds (a view holds its base's)."""

    def __init__(self):
        super().__init__()
        self.nbytes = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in out if isinstance(out, (tuple, list)) else (out,):
            if isinstance(t, torch.Tensor):
                self.nbytes = max(self.nbytes, t.untyped_storage().nbytes())
        return out


def test_no_mask_is_built():
    """At T = 1024 in blocks of 256 queries (masks of up to 256 x 1024 per head): the largest
    memory is the heads' own (H x T x d), never a block of scores."""
    n = 1024
    enc = encoding("t5").float()
    q, k, v = (torch.randn(1, H, n, D) for _ in range(3))
    with LargestStorage() as largest, torch.no_grad():
        attend(q, k, v, torch.arange(n).expand(1, n), enc, 0)
    assert largest.nbytes <= H * n * D * 4
