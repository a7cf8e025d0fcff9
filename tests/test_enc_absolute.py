"""Defining property tests of the absolute encodings (docs/encodings.md): integer, binary,
sinusoidal, learned, randomized."""
import math

import pytest
import torch
import torch.nn.functional as F
from omegaconf import OmegaConf

import posbench
from posbench.encodings import Dims, registry
from posbench.encodings.binary import binary_table
from posbench.encodings.integer import Integer, IntegerConfig
from posbench.encodings.randomized import sorted_draws
from posbench.encodings.sinusoidal import sinusoid_table
from posbench.evaluations.perplexity import evaluate
from helpers import composed

SMALL = ["model.n_layer=2", "model.d_model=32", "model.n_head=2"]


def build(encoding, *extra):
    cfg = composed(f"encoding={encoding}", *SMALL, *extra)
    torch.manual_seed(0)
    return posbench.build_model(cfg).eval()


def tokens(T, seed=0, B=1):
    return torch.randint(0, 256, (B, T), generator=torch.Generator().manual_seed(seed))


def integer(norm_by, train_len=32):
    return Integer(IntegerConfig(name="integer", norm_by=norm_by), Dims(1, 1, 16, train_len, 64))


# --- Integer -----------------------------------------------------------------------------------
def test_integer_raw_moves_every_component_by_t_with_alternating_signs():
    pos = torch.arange(100).unsqueeze(0)
    pe = integer("none").table(pos, 16)[0]
    t = torch.arange(100, dtype=torch.float64).unsqueeze(-1)
    assert torch.equal(pe.abs(), t.expand(100, 16))
    assert torch.equal(pe[:, 0::2], t.expand(100, 8))
    assert torch.equal(pe[:, 1::2], -t.expand(100, 8))
    assert torch.equal(pe.sum(-1), torch.zeros(100, dtype=torch.float64))  # orthogonal to 1


def test_layernorm_erases_t_times_ones_but_not_the_alternating_vector():
    """Why integer PE deviates from the usual t*1: LayerNorm removes the all-ones direction."""
    x = torch.randn(10, 16, dtype=torch.float64, generator=torch.Generator().manual_seed(0))
    t = torch.arange(10, dtype=torch.float64).unsqueeze(-1) * 7
    torch.testing.assert_close(F.layer_norm(x + t, (16,)), F.layer_norm(x, (16,)),
                               rtol=1e-9, atol=1e-9)
    pe = integer("none").table(torch.arange(10).unsqueeze(0) * 7, 16)[0]
    moved = (F.layer_norm(x + pe, (16,)) - F.layer_norm(x, (16,))).abs().amax(-1)
    assert moved[0] == 0 and (moved[1:] > 0.1).all()


def test_integer_normalized_by_n_spans_zero_to_one():
    for n in (2, 7, 64):
        v = integer("n").values(torch.arange(n).unsqueeze(0))[0]
        assert v[0] == 0 and v[-1] == 1
        assert ((v >= 0) & (v <= 1)).all() and (v.diff() > 0).all()


def test_integer_normalized_by_training_length_does_not_depend_on_n():
    enc = integer("L", train_len=32)
    short = enc.values(torch.arange(32).unsqueeze(0))
    long = enc.values(torch.arange(100).unsqueeze(0))
    assert short[0, 31] == 1 and torch.equal(long[:, :32], short)
    assert long[0, 99] == pytest.approx(99 / 31)


def test_integer_normalized_by_n_fails_prefix_by_design_and_raw_passes():
    idx = tokens(64)
    with torch.no_grad():
        for name, consistent in (("integer_norm", False), ("integer", True)):
            model = build(name)
            short, full = model(idx[:, :40]), model(idx)[:, :40]
            assert torch.allclose(short, full, atol=1e-5, rtol=1e-5) == consistent, name
            assert model.encoding.prefix_consistent == consistent


def test_integer_rejects_unknown_norm_by_in_one_line():
    with pytest.raises(posbench.ConfigError, match=r"^encoding.norm_by='N' is not accepted; "
                                                  r"expected one of \('none', 'n', 'L'\)$"):
        posbench.compose(["encoding=integer", "encoding.norm_by=N"])


# --- Binary ------------------------------------------------------------------------------------
def test_binary_five_is_1010_least_significant_first():
    assert binary_table(torch.tensor(5), 16, signed=False)[:4].tolist() == [1, 0, 1, 0]
    assert binary_table(torch.tensor(5), 16, signed=True)[:4].tolist() == [1, -1, 1, -1]


def test_binary_bit_k_has_period_2_to_the_k_plus_1():
    t = torch.arange(300)
    pe = binary_table(t, 12, signed=False)
    for k in range(12):
        shifted = binary_table(t + 2 ** (k + 1), 12, signed=False)
        assert torch.equal(shifted[:, k], pe[:, k]), k
    assert not torch.equal(binary_table(t + 1, 12, False)[:, 0], pe[:, 0])


def test_binary_high_bits_are_zero_below_the_training_length():
    for L in (32, 100, 128):
        pe = binary_table(torch.arange(L), 16, signed=False)
        top = math.ceil(math.log2(L))
        assert pe[:, top:].max() == 0 and (pe[:, :top].amax(0) == 1).all(), L


def test_binary_is_finite_and_exact_past_the_int64_bits():
    pos = torch.tensor([2 ** 62 + 5, 65536 + 3])
    pe = binary_table(pos, 128, signed=False)
    assert pe[0, 62] == 1 and pe[0, :3].tolist() == [1, 0, 1] and pe[:, 63:].abs().sum() == 0
    assert pe[1, 16] == 1 and pe[1, :2].tolist() == [1, 1]


def test_binary_signed_is_two_bits_minus_one():
    pos = torch.arange(1000)
    assert torch.equal(binary_table(pos, 20, True), 2 * binary_table(pos, 20, False) - 1)


# --- Sinusoidal --------------------------------------------------------------------------------
def test_sinusoid_shift_is_a_linear_map_independent_of_t():
    D, base = 32, 10000.0
    omega = base ** (-torch.arange(0, D, 2, dtype=torch.float64) / D)
    for delta in (1, 17, 1000):
        c, s = torch.cos(omega * delta), torch.sin(omega * delta)
        # T(delta) in (sin, cos) order: [[cos, sin], [-sin, cos]] per frequency
        T = torch.block_diag(*[torch.tensor([[ci, si], [-si, ci]]) for ci, si in zip(c, s)])
        t = torch.tensor([0, 5, 123, 4567])
        torch.testing.assert_close(sinusoid_table(t + delta, D, base),
                                   sinusoid_table(t, D, base) @ T.T, rtol=0, atol=1e-6)


def test_sinusoid_dot_product_is_sum_of_cosines_of_the_lag():
    D = 32
    omega = 1e4 ** (-torch.arange(0, D, 2, dtype=torch.float64) / D)
    t, s = torch.tensor([3, 100, 2000]), torch.tensor([0, 150, 1])
    dots = (sinusoid_table(t, D, 1e4) * sinusoid_table(s, D, 1e4)).sum(-1)
    expected = torch.cos(omega * (t - s).unsqueeze(-1).double()).sum(-1)
    torch.testing.assert_close(dots, expected, rtol=0, atol=1e-9)


def test_sinusoid_is_bounded_by_one_and_sin_is_at_even_dims():
    pe = sinusoid_table(torch.arange(70000), 32, 1e4)
    assert pe.abs().max() <= 1
    assert torch.equal(pe[0, 0::2], torch.zeros(16, dtype=torch.float64))
    assert torch.equal(pe[0, 1::2], torch.ones(16, dtype=torch.float64))


def test_sinusoid_amplitude_and_scale_input():
    x, pos = torch.randn(1, 5, 32), torch.arange(5).unsqueeze(0)
    pe = sinusoid_table(pos, 32, 1e4).float()
    fairseq = build("sinusoidal").encoding
    small = build("sinusoidal", "encoding.amplitude=0.02", "encoding.scale_input=false").encoding
    # default: fairseq's form, sqrt(D)-scaled tokens next to unit sinusoids, at the input only
    torch.testing.assert_close(fairseq.embed(x, pos, 0), x * math.sqrt(32) + pe)
    assert torch.equal(fairseq.embed(x, pos, 1), x)
    torch.testing.assert_close(small.embed(x, pos, 0), x + 0.02 * pe)


# --- Learned -----------------------------------------------------------------------------------
def test_learned_rows_past_the_training_length_get_exactly_zero_gradient():
    model = build("learned", "train.seq_len=32", "eval.lengths=[128]").train()
    idx = tokens(33, B=2)
    model.token_losses(idx[:, :-1], idx[:, 1:]).mean().backward()
    grad = model.encoding.tables[0].grad
    assert grad.shape[0] == 128
    assert torch.equal(grad[32:], torch.zeros_like(grad[32:]))
    assert (grad[:32].abs().sum(-1) > 0).all()


def test_learned_per_layer_has_one_distinct_table_per_layer():
    model = build("learned", "encoding.per_layer=true", "model.n_layer=3")
    tables = list(model.encoding.tables)
    assert len(tables) == 3 and len({t.data_ptr() for t in tables}) == 3
    assert len([n for n, _ in model.named_parameters() if n.startswith("encoding.")]) == 3
    x, pos = torch.zeros(1, 4, 32), torch.arange(4).unsqueeze(0)
    for layer in range(3):
        assert torch.equal(model.encoding.embed(x, pos, layer), tables[layer][:4].unsqueeze(0))


def test_learned_shift_changes_logits():
    model = build("learned", "eval.lengths=[200]")
    idx = tokens(64)
    with torch.no_grad():
        assert not torch.allclose(model(idx), model(idx, pos=torch.arange(64) + 17), atol=1e-4)


def test_learned_clamp_reads_the_last_trained_row_past_the_training_length():
    enc = build("learned", "encoding.clamp=true", "train.seq_len=32", "eval.lengths=[128]").encoding
    out = enc.embed(torch.zeros(1, 3, 32), torch.tensor([[5, 31, 100]]), 0)
    table = enc.tables[0]
    assert torch.equal(out[0], torch.stack([table[5], table[31], table[31]]))


# --- Randomized --------------------------------------------------------------------------------
def test_randomized_training_positions_are_sorted_distinct_draws_below_m():
    model = build("randomized", "encoding.max_len=256", "train.seq_len=64").train()
    enc = model.encoding
    pos = torch.arange(64).expand(3, 64)
    first, second = enc.positions(pos), enc.positions(pos)
    for drawn in (first, second):
        assert (drawn.diff(dim=-1) > 0).all() and drawn.min() >= 0 and drawn.max() < 256
        assert torch.equal(drawn[0], drawn[1]) and torch.equal(drawn[0], drawn[2])  # one per call
    assert not torch.equal(first, second)
    assert len(set(sorted_draws(200, 200).tolist())) == 200


def test_randomized_evaluates_at_the_callers_positions_without_random_eval_positions():
    enc = build("randomized").encoding
    pos = torch.arange(10).expand(2, 10) + 5
    assert torch.equal(enc.positions(pos), pos)  # a built model has no eval options
    enc.set_eval_options(randomized_positions="plain")
    assert torch.equal(enc.positions(pos), pos)


def random_eval(*extra):
    enc = build("randomized", *extra).encoding
    enc.set_eval_options(randomized_positions="random")
    return enc


def test_randomized_eval_draws_sorted_distinct_positions_below_m_for_each_window():
    enc = random_eval("encoding.max_len=256", "train.seq_len=64")
    drawn = enc.positions(torch.arange(64).expand(3, 64))
    assert (drawn.diff(dim=-1) > 0).all() and drawn.min() >= 0 and drawn.max() < 256
    assert not torch.equal(drawn[0], drawn[1]) and not torch.equal(drawn[1], drawn[2])
    # a window longer than M has no room for distinct draws below M: it reads 0..n-1
    assert torch.equal(enc.positions(torch.zeros(2, 300, dtype=torch.long)),
                       torch.arange(300).expand(2, 300))


def test_randomized_eval_draws_are_uniform_sorted_samples_without_replacement():
    # the k-th smallest of n distinct draws from {0..M-1} has mean k (M + 1) / (n + 1) - 1
    M, n, windows = 100, 4, 4000
    enc = random_eval(f"encoding.max_len={M}", "train.seq_len=4")
    drawn = enc.positions(torch.arange(n).expand(windows, n)).double()
    want = torch.arange(1, n + 1, dtype=torch.float64) * (M + 1) / (n + 1) - 1
    torch.testing.assert_close(drawn.mean(0), want, rtol=0, atol=1.5)  # about 6 standard errors
    assert len(set(map(tuple, drawn.tolist()))) > 0.99 * windows


def test_randomized_eval_draws_are_seeded_per_window_not_by_batch_or_global_rng():
    enc = random_eval()
    pos = torch.arange(64).expand(3, 64)
    state = torch.get_rng_state()
    torch.manual_seed(123)
    together = enc.positions(pos)
    enc.set_eval_options(randomized_positions="random")  # re-evaluation starts again
    torch.manual_seed(456)
    apart = torch.cat([enc.positions(pos[:1]), enc.positions(pos[:2])])
    assert torch.equal(together, apart)
    torch.manual_seed(123)
    enc.positions(pos)
    assert torch.equal(torch.get_rng_state(), torch.manual_seed(123).get_state())
    torch.set_rng_state(state)


def test_randomized_evaluation_is_reproducible_and_independent_of_batching(stdlib_data):
    cfg = posbench.compose(["encoding=randomized", *SMALL, "train.seq_len=32",
                            "eval.lengths=[32,64]", "eval.tokens=256", "eval.batch_tokens=256"])
    torch.manual_seed(0)
    model = posbench.build_model(cfg, stdlib_data.vocab_size)

    def losses(**eval_options):
        curve = evaluate(model, stdlib_data, OmegaConf.merge(cfg.eval, eval_options),
                         torch.device("cpu"))
        return [p["loss"] for p in curve]

    random = losses()
    assert model.encoding.randomized_positions == "random"  # the default
    assert losses() == random
    assert losses(batch_tokens=64) == pytest.approx(random, rel=1e-6)
    plain = losses(randomized_positions="plain")
    assert all(a != b for a, b in zip(plain, random))


def test_randomized_positions_refuses_an_unknown_value_in_one_line():
    with pytest.raises(posbench.ConfigError, match=r"^eval.randomized_positions='sometimes' is "
                                                  r"not accepted; expected one of \('random', "
                                                  r"'plain'\)$"):
        posbench.compose(["encoding=randomized", "eval.randomized_positions=sometimes"])


@pytest.mark.parametrize("base", ["rope", "sinusoidal"])
def test_randomized_with_m_equal_to_n_is_the_base_encoding(base):
    wrapped = build("randomized", f"encoding.base={base}", "encoding.max_len=48",
                    "train.seq_len=48").train()
    plain = build(base, "train.seq_len=48").train()
    plain.load_state_dict(wrapped.state_dict())
    idx = tokens(48, B=2)
    with torch.no_grad():
        torch.testing.assert_close(wrapped(idx), plain(idx), rtol=0, atol=0)
        # other positions (sparser, as draws from a larger M) do change the logits
        assert not torch.allclose(wrapped(idx), plain(idx, pos=torch.arange(48) * 2), atol=1e-4)


def test_randomized_training_breaks_prefix_consistency():
    model = build("randomized", "train.seq_len=64").train()
    idx = tokens(64)
    with torch.no_grad():
        torch.manual_seed(1)
        short = model(idx[:, :40])
        torch.manual_seed(1)
        full = model(idx)[:, :40]
    assert not torch.allclose(short, full, atol=1e-4)


def test_randomized_takes_relativity_and_hooks_from_its_base():
    rope = build("randomized").encoding
    sin = build("randomized", "encoding.base=sinusoidal").encoding
    assert rope.relative and rope.rotate is not None and rope.embed is None
    assert not sin.relative and sin.embed is not None and sin.rotate is None
    learned = build("randomized", "encoding.base=learned", "eval.lengths=[128]").encoding
    assert learned.base.tables[0].shape[0] == 2048  # a row for every possible draw


@pytest.mark.parametrize("override, message", [
    ("encoding.max_len=16", r"^encoding.max_len=16 is not accepted; expected >= train.seq_len=32"),
    ("encoding.base=randomized", r"^encoding.base='randomized' is not accepted; expected one of: "),
    ("encoding.base=nosuch", r"^encoding.base='nosuch' is not accepted; expected one of: .*rope"),
])
def test_randomized_rejects_bad_values_in_one_line(override, message):
    with pytest.raises(posbench.ConfigError, match=message) as err:
        posbench.compose(["encoding=randomized", "train.seq_len=32", override])
    assert "\n" not in str(err.value)


@pytest.mark.parametrize("base", [name for name in registry() if name != "randomized"])
def test_randomized_at_plain_positions_is_its_base_and_trains_over_every_encoding(base):
    """Over any registered base (those that read the attention's input, such as FoX, PaTH and
    GRAPE-AP, included): the wrapper takes every hook and flag of its base, so at plain positions
    its logits are the base's on the same weights, and a training step on random positions
    gives finite gradients."""
    shape = [*SMALL, "train.seq_len=32", "eval.lengths=[32,64]"]
    plain = build(base, *shape)
    wrapped = build("randomized", f"encoding.base={base}", "encoding.max_len=64", *shape)
    weights = {k.replace("encoding.", "encoding.base.", 1) if k.startswith("encoding.") else k: v
               for k, v in plain.state_dict().items()}
    wrapped.load_state_dict(weights)
    wrapped.encoding.set_eval_options(randomized_positions="plain")
    idx = tokens(64, B=2) % 64
    with torch.no_grad():
        torch.testing.assert_close(wrapped(idx), plain(idx), rtol=0, atol=0)
    wrapped.train()
    wrapped(idx[:, :32], targets=idx[:, 1:33]).mean().backward()
    grads = [p.grad for p in wrapped.parameters() if p.grad is not None]
    assert grads and all(torch.isfinite(g).all() for g in grads)
