"""Dual Chunk Attention (ChunkLlama) and StreamingLLM's cache positions as eval-time remaps of a
trained RoPE model (docs/encodings.md#eval-time-options). The oracles compute every pair's lag
from the references' procedures, not from posbench's near/far split: DCA's three position tables
of HKUNLP/ChunkLlama chunkllama_attn_replace.py (intra-chunk, successive-chunk, inter-chunk
queries against keys at p mod c), and StreamingLLM's evaluation loop of mit-han-lab/streaming-llm
(one token at a time against a cache trimmed to sinks + recent keys, each key at its place in the
cache); the logits q_i^T R(lag) k_j are formed in complex float64 and the attention's remapped
path must match them."""
import math

import pytest
import torch

import posbench
from posbench.attention import paths as attention
from posbench.attention.paths import attend, attention_probs
from posbench.attention.span import Span, lambda_span
from posbench.core.errors import ConfigError
from posbench.encodings import Dims
from posbench.encodings.rope import RoPE, remap_for
from posbench.evaluations.base import set_eval_options

F64 = torch.float64
D, L, BASE = 16, 32, 1e4


def encoding(scaling="none", window=None, chunk=None):
    enc = RoPE(RoPE.Config(name="rope", base=BASE), Dims(1, 2, 2 * D, L, 16 * L))
    enc.set_eval_options(scaling, rope_window=window, rope_chunk=chunk)
    return enc


def dca_lag(p_i, p_j, chunk, window):
    """ChunkLlama's lag: keys at p mod c with c = chunk - window; the query at q_t[t] = t in the
    key's chunk, at qc_t[t] = min(t + c, chunk) in the chunk after it, and at qc_t[c - 1]
    further on (t = p_i mod c)."""
    c = chunk - window
    step, t = p_i // c - p_j // c, p_i % c
    q = t if step == 0 else min(t + c, chunk) if step == 1 else min(2 * c - 1, chunk)
    return q - p_j % c


def streaming_lags(T, sinks, window):
    """StreamingLLM's positions, by running its loop: token i attends to the cache and itself at
    their places in it, then the cache keeps its first `sinks` and last `window - 1` keys
    (StartRecentKVCache(start_size=sinks, recent_size=window - 1)). Returns (lag, visible)."""
    lag = torch.zeros(T, T, dtype=F64)
    visible = torch.zeros(T, T, dtype=torch.bool)
    cache = []
    for i in range(T):
        keys = cache + [i]
        for place, j in enumerate(keys):
            lag[i, j], visible[i, j] = len(keys) - 1 - place, True
        cache = keys if len(keys) <= sinks + window - 1 else (
            keys[:sinks] + keys[len(keys) - (window - 1):])
    return lag, visible


def oracle(q, k, v, lag, visible):
    """softmax over the visible keys of q_i^T R(lag_ij) k_j / sqrt(d), RoPE's rotation per pair
    p as Re[(q1 + i q2)(k1 - i k2) e^(i theta_p lag)] in the half-split layout; lag and visible
    (B or 1, T, T)."""
    d = q.shape[-1]
    theta = BASE ** (-torch.arange(0, d, 2, dtype=F64) / d)
    qc = torch.complex(q[..., :d // 2], q[..., d // 2:])
    kc = torch.complex(k[..., :d // 2], k[..., d // 2:])
    turn = torch.exp(1j * theta * lag[:, None, :, :, None])
    logits = (qc[:, :, :, None] * kc[:, :, None].conj() * turn).real.sum(-1) / math.sqrt(d)
    probs = torch.softmax(logits.masked_fill(~visible[:, None], -math.inf), -1)
    return probs, probs @ v


def dca_oracle(q, k, v, pos, chunk, window):
    T = q.shape[2]
    lag = torch.tensor([[[dca_lag(int(row[i]), int(row[j]), chunk, window) if j <= i else 0
                          for j in range(T)] for i in range(T)] for row in pos], dtype=F64)
    return oracle(q, k, v, lag, torch.ones(T, T, dtype=torch.bool).tril().expand(len(pos), T, T))


def heads(B, H, T, seed):
    gen = torch.Generator().manual_seed(seed)
    return (torch.randn(B, H, T, D, dtype=F64, generator=gen) for _ in range(3))


# (w, s): the defaults L/8 = 4 and 3L/4 = 24 (c = 20); w = 14 >= c - 1 = 9; eval.rope_chunk at
# L = 32 (c = 28, the largest lag L), and at 12 with w = 6 >= c - 1 = 5
@pytest.mark.parametrize("window,chunk", [(None, None), (14, None), (None, 32), (6, 12)])
@pytest.mark.parametrize("offset", [0, 7])
def test_dca_matches_the_reference_positions_across_blocks(window, chunk, offset, monkeypatch):
    monkeypatch.setattr(attention, "BLOCK_ELEMENTS", 1)  # blocks of 16 query rows
    T = 70  # three to twelve chunks: intra, successive and inter-chunk keys
    q, k, v = heads(2, 2, T, 0)
    pos = (torch.arange(T) + offset).unsqueeze(0).expand(2, T)
    enc = encoding("dca", window, chunk)
    remap = enc.remapping
    assert (remap.chunk, remap.window) == (chunk or 24, window or 4)
    want_probs, want = dca_oracle(q, k, v, pos[:1], remap.chunk, remap.window)
    torch.testing.assert_close(attend(q, k, v, pos, enc, 0), want, rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(attention_probs(q, k, pos, enc, 0, 20, 60),
                               want_probs[:, :, 20:60, :60], rtol=1e-10, atol=1e-12)


def test_dca_reads_each_sequence_positions():
    T = 40
    q, k, v = heads(2, 1, T, 1)
    pos = torch.stack([torch.arange(T), 3 * torch.arange(T) + 5])  # gaps in the second
    enc = encoding("dca")
    want = dca_oracle(q, k, v, pos, enc.remapping.chunk, enc.remapping.window)[1]
    torch.testing.assert_close(attend(q, k, v, pos, enc, 0), want, rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("chunk", [None, 10])
def test_dca_lags_at_16l_are_the_reference_s_and_stay_within_the_chunk_size(chunk):
    n = 16 * L
    remap = remap_for("dca", L, chunk=chunk)
    pos = torch.arange(n).view(1, -1)
    q_pos, k_pos = remap.far_positions(pos, n)
    i, j = torch.arange(n).view(1, 1, -1, 1), torch.arange(n).view(1, 1, 1, -1)
    near = remap.near_keys(pos)(torch.zeros(1, 1, 1, 1, dtype=torch.long), i, j)[0, 0]
    got = torch.where(near, (i - j)[0, 0].to(F64), q_pos[0].view(-1, 1) - k_pos[0].view(1, -1))
    causal = torch.ones(n, n, dtype=torch.bool).tril()
    want = torch.tensor([[dca_lag(a, b, remap.chunk, remap.window) if b <= a else 0
                          for b in range(n)] for a in range(n)], dtype=F64)
    torch.testing.assert_close(got[causal], want[causal], rtol=0, atol=0)
    assert got[causal].max().item() == remap.chunk == (chunk or 24)


@pytest.mark.parametrize("chunk", [None, 16])
def test_dca_up_to_the_chunk_size_is_plain_rope(chunk):
    s = remap_for("dca", L, chunk=chunk).chunk  # every query of 0..s sees its keys at their lag
    plain = encoding()
    for T, same in ((s + 1, True), (s + 2, False)):
        q, k, v = heads(1, 2, T, 2)
        pos = torch.arange(T).unsqueeze(0)
        rq, rk = plain.rotate(q, k, pos, 0)
        got = attend(q, k, v, pos, encoding("dca", chunk=chunk), 0)
        want = attend(rq, rk, v, pos, plain, 0)
        assert torch.allclose(got, want, rtol=1e-12, atol=1e-12) == same


def test_defaults_follow_chunkllama_scaled_to_the_training_length():
    # replace_with_chunkllama(pretraining_length=4096): chunk_size 3072, local_window 512
    assert (remap_for("dca", 4096).chunk, remap_for("dca", 4096).window) == (3072, 512)
    assert (remap_for("dca", 128).chunk, remap_for("dca", 128).window) == (96, 16)


@pytest.mark.parametrize("sinks,window", [(2, 9), (4, 1), (1, 20)])
@pytest.mark.parametrize("offset", [0, 5])
def test_streaming_llm_matches_its_cache_loop_across_blocks(sinks, window, offset, monkeypatch):
    monkeypatch.setattr(attention, "BLOCK_ELEMENTS", 1)
    T = 40
    q, k, v = heads(2, 2, T, 3)
    pos = (torch.arange(T) + offset).unsqueeze(0).expand(2, T)
    span = Span("lambda", window, sinks)
    lag, visible = streaming_lags(T, sinks, window)
    assert torch.equal(visible, span.visible(torch.arange(T).view(-1, 1), torch.arange(T)))
    want_probs, want = oracle(q, k, v, lag[None], visible[None])
    enc = encoding("streaming_llm")
    torch.testing.assert_close(attend(q, k, v, pos, enc, 0, span=span), want, rtol=1e-10,
                               atol=1e-12)
    torch.testing.assert_close(attention_probs(q, k, pos, enc, 0, 8, 30, span=span),
                               want_probs[:, :, 8:30, :30], rtol=1e-10, atol=1e-12)
    assert lag[visible].max().item() == min(T - 1, sinks + window - 1)


def test_streaming_llm_is_lm_infinite_up_to_sinks_plus_window_and_not_past_it():
    # LM-Infinite on RoPE in posbench: the lambda mask with rerope's cap at w = L
    span = lambda_span(L, 2, 9)
    lm_infinite, streaming = encoding("rerope", L), encoding("streaming_llm")
    for T, same in ((11, True), (12, False)):  # sinks + window = 11
        q, k, v = heads(1, 2, T, 4)
        pos = torch.arange(T).unsqueeze(0)
        got = attend(q, k, v, pos, streaming, 0, span=span)
        want = attend(q, k, v, pos, lm_infinite, 0, span=span)
        assert torch.allclose(got, want, rtol=1e-12, atol=1e-12) == same


def test_streaming_llm_without_sinks_keeps_every_lag():
    """A layer whose span has no sinks (a sliding window; a local layer of a pattern keeps its
    own span under eval.attention=lambda): every cache place is the text's lag."""
    T, span = 30, Span("sliding", 7)
    q, k, v = heads(1, 2, T, 5)
    pos = torch.arange(T).unsqueeze(0)
    plain = encoding()
    rq, rk = plain.rotate(q, k, pos, 0)
    torch.testing.assert_close(attend(q, k, v, pos, encoding("streaming_llm"), 0, span=span),
                               attend(rq, rk, v, pos, plain, 0, span=span), rtol=1e-12,
                               atol=1e-12)


def test_a_model_under_streaming_llm_changes_only_queries_past_the_full_cache():
    """Through set_eval_options, as evaluation sets it: the layers' lambda span reaches the
    remap. L = 32, 4 sinks and a window of 28: the cache fills at 32 tokens."""
    cfg = posbench.compose(["model.n_layer=2", "model.d_model=32", "model.n_head=2",
                            "train.seq_len=32", "eval.attention=lambda",
                            "eval.rope_scaling=streaming_llm"])
    torch.manual_seed(0)
    model = posbench.build_model(cfg, 64).eval()
    x = torch.randint(0, 64, (1, 64), generator=torch.Generator().manual_seed(6))
    with torch.no_grad():
        set_eval_options(model, {"attention": "lambda"})
        masked = model(x)
        set_eval_options(model, cfg.eval)
        streamed = model(x)
    torch.testing.assert_close(streamed[:, :32], masked[:, :32])
    assert (streamed[:, 32:] - masked[:, 32:]).abs().amax() > 1e-4


def test_the_record_names_the_values_in_effect():
    from posbench.encodings.rope import remap_record

    dca = posbench.compose(["eval.rope_scaling=dca"])
    assert remap_record(dca.eval, 128) == {"near": None, "window": 16, "shift": None,
                                           "factor": None, "chunk": 96}
    # eval.rope_chunk, as evaluation hands it to the model, and as results.json records it
    dca = posbench.compose(["model.n_layer=1", "model.d_model=32", "model.n_head=2",
                            "train.seq_len=32", "eval.rope_scaling=dca", "eval.rope_chunk=20"])
    model = posbench.build_model(dca, 64)
    set_eval_options(model, dca.eval)
    assert model.encoding.remapping[:2] == ("dca", 4) and model.encoding.remapping.chunk == 20
    assert remap_record(dca.eval, 32) == {"near": None, "window": 4, "shift": None,
                                          "factor": None, "chunk": 20}
    stream = posbench.compose(["eval.rope_scaling=streaming_llm", "eval.attention=lambda"])
    assert remap_record(stream.eval, 128) == {"near": 124, "window": None, "shift": None,
                                              "factor": None}


@pytest.mark.parametrize("overrides,words", [
    (["encoding=alibi", "eval.rope_scaling=dca"], "does not rotate q and k"),
    (["encoding=xpos", "eval.rope_scaling=streaming_llm", "eval.attention=lambda"],
     "rotate by RoPE alone"),
    (["eval.rope_scaling=dca", "eval.rope_scaling_factor=2"], "null for dca"),
    (["eval.rope_scaling=dca", "eval.rope_window=96"],
     "eval.rope_window=96 is not accepted; expected a local window below DCA's chunk size 96"),
    (["eval.rope_scaling=dca", "eval.rope_window=20", "eval.rope_chunk=20"],
     "eval.rope_window=20 is not accepted; expected a local window below DCA's chunk size 20"),
    (["eval.rope_scaling=dca", "eval.rope_chunk=16"],
     "eval.rope_chunk=16 is not accepted; expected a chunk size above DCA's local window 16"),
    (["eval.rope_scaling=dca", "eval.rope_chunk=129"],
     "eval.rope_chunk=129 is not accepted; expected a chunk size of at most train.seq_len=128"),
    (["eval.rope_scaling=dca", "eval.rope_chunk=0"],
     "eval.rope_chunk=0 is not accepted; expected a positive integer"),
    (["eval.rope_scaling=self_extend", "eval.rope_chunk=64"],
     "eval.rope_chunk=64 is not accepted; expected null unless eval.rope_scaling=dca"),
    (["eval.rope_scaling=dca", "eval.rope_shift=8"], "null unless eval.rope_scaling=shifted"),
    (["eval.rope_scaling=streaming_llm"],
     "eval.rope_scaling='streaming_llm' is not accepted; expected it with eval.attention=lambda"),
    (["eval.rope_scaling=streaming_llm", "eval.attention=lambda", "eval.lambda_sinks=0"],
     "eval.lambda_sinks=0 is not accepted; expected at least 1"),
    (["eval.rope_scaling=streaming_llm", "eval.attention=lambda", "eval.rope_window=8"],
     "eval.rope_window=8 is not accepted; expected null unless"),
    (["eval.rope_scaling=streaming_llm", "eval.attention=lambda",
      "eval.rope_scaling_factor=2"], "null for streaming_llm"),
])
def test_refused_in_one_line(overrides, words):
    with pytest.raises(ConfigError) as err:
        posbench.compose(overrides)
    assert words in str(err.value) and "\n" not in str(err.value)
