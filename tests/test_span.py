"""Attention spans (posbench/attention/span.py, docs/design.md#attention-spans): sliding windows,
chunked local attention and eval.attention's lambda mask, on every attention path, against a dense
float64 reference that masks the keys by the definition: sliding i - w < j <= i, chunked
j // w == i // w and j <= i, lambda (j < n or i - j < w) and j <= i."""
import functools
import json
import math
import re

import pytest
import torch

import posbench
import posbench.attention.paths as attention
from posbench.attention.paths import attend, attention_probs, blockwise_attention
from posbench.core.errors import ConfigError
from posbench.attention.span import GLOBAL, Span, lambda_span
from posbench.evaluations.base import set_eval_options

from helpers import posbench_cli
from test_attention_paths import LargestTensor, assert_same_with_grads
from test_attention_paths import encoding as build_encoding
from test_enc_layers import reference_logits, sharpen

B, H, T, D = 2, 3, 40, 8


@functools.lru_cache(maxsize=None)
def encoding(name):
    """test_attention_paths' encoding, composed once per name (gradients are taken with
    torch.autograd.grad, so sharing it leaves nothing behind)."""
    return build_encoding(name)
LAMBDA = Span("lambda", 7, 3)  # 3 sinks and 7 recent keys
SPANS = [Span("sliding", 7), Span("chunked", 7), Span("sliding", 1), LAMBDA]


def visible_by_definition(span, i, j):
    if span.kind == "sliding":
        return (j <= i) & (i - j < span.width)
    if span.kind == "chunked":
        return (j <= i) & (torch.div(i, span.width, rounding_mode="floor")
                           == torch.div(j, span.width, rounding_mode="floor"))
    if span.kind == "lambda":
        return (j <= i) & ((j < span.sinks) | (i - j < span.width))
    return j <= i


def dense(q, k, v, span, score_mod=None):
    n = q.shape[2]
    i, j = torch.arange(n).view(1, 1, n, 1), torch.arange(n).view(1, 1, 1, n)
    b, h = torch.arange(q.shape[0]).view(-1, 1, 1, 1), torch.arange(q.shape[1]).view(1, -1, 1, 1)
    scores = q @ k.transpose(-2, -1) / math.sqrt(q.shape[-1])
    if score_mod is not None:
        scores = score_mod(scores, b, h, i, j)
    scores = scores.masked_fill(~visible_by_definition(span, i, j), float("-inf"))
    return torch.softmax(scores, -1) @ v


def qkv(n=T, seed=0, requires_grad=True):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(B, H, n, D, generator=g, dtype=torch.float64).requires_grad_(requires_grad)
            for _ in range(3)]


@pytest.mark.parametrize("blocks", ["one", "several"])
@pytest.mark.parametrize("name", ["nope", "alibi", "t5", "decay", "cope"])
@pytest.mark.parametrize("span", SPANS, ids=str)
def test_every_path_masks_keys_outside_the_span(span, name, blocks, monkeypatch):
    """nope: SDPA per block with the span as mask; alibi, t5 (learned): the additive mask path;
    decay: dense scores with a score_mod; cope: a row_mod, which must count only what it sees."""
    if blocks == "several":
        monkeypatch.setattr(attention, "BLOCK_ELEMENTS", B * H * 16 * 16)
        monkeypatch.setattr(attention, "BACKWARD_ROWS", 5)
    q, k, v = qkv()
    enc = encoding(name)
    pos = torch.arange(T).expand(B, T)
    out = attend(q, k, v, pos, enc, 0, span=span)
    if name == "cope":  # its reference: the row hook on the span-masked dense rows
        probs = attention_probs(q, k, pos, enc, 0, span=span)
        ref = probs @ v
        i, j = torch.arange(T).view(T, 1), torch.arange(T).view(1, T)
        assert (probs[..., ~visible_by_definition(span, i, j)] == 0).all()
    else:
        fn = enc.score_mod(q, k, pos, 0) if enc.score_mod is not None else None
        ref = dense(q, k, v, span, fn)
    assert_same_with_grads(out, ref, (q, k, v, *enc.parameters()))


@pytest.mark.parametrize("kind", ["sliding", "chunked"])
def test_a_span_of_w_is_full_attention_up_to_w_tokens(kind):
    """The model with a local span of w against the global model on the same weights: equal for
    T <= w, and different past w (the span is not vacuous)."""
    w = 16
    extra = ["model.n_layer=2", "model.d_model=32", "model.n_head=2", "train.seq_len=64"]
    torch.manual_seed(0)
    local = posbench.build_model(posbench.compose(
        ["encoding=rope", f"model.attention={kind}", f"model.attention_window={w}", *extra]), 64)
    torch.manual_seed(0)
    full = posbench.build_model(posbench.compose(["encoding=rope", *extra]), 64)
    sharpen(local), sharpen(full)
    idx = torch.randint(0, 64, (2, 3 * w), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        torch.testing.assert_close(local(idx[:, :w]), full(idx[:, :w]), rtol=1e-5, atol=1e-5)
        assert not torch.allclose(local(idx)[:, w:], full(idx)[:, w:], atol=1e-3)


@pytest.mark.parametrize("kind", ["sliding", "chunked"])
def test_attention_probs_are_zero_beyond_the_span_and_sum_to_one(kind):
    w = 5
    span = Span(kind, w)
    q, k, _ = qkv(requires_grad=False)
    probs = attention_probs(q, k, torch.arange(T).expand(B, T), encoding("nope"), 0, span=span)
    i, j = torch.arange(T).view(T, 1), torch.arange(T).view(1, T)
    assert (probs[..., ~visible_by_definition(span, i, j)] == 0).all()
    assert (probs[..., visible_by_definition(span, i, j)] > 0).all()
    torch.testing.assert_close(probs.sum(-1), torch.ones(B, H, T, dtype=probs.dtype))


@pytest.mark.parametrize("train", [False, True], ids=["eval", "train"])
@pytest.mark.parametrize("kind", ["sliding", "chunked"])
def test_long_input_is_exact_and_memory_is_bounded_by_the_span(kind, train):
    """8192 tokens under a span of 64: the blockwise path makes no tensor (forward, and backward in
    training) larger than its input, where a block holds rows x (rows + w) scores; the output at
    sampled queries equals softmax over exactly the keys the definition names."""
    n, w = 8192, 64
    span = Span(kind, w)
    q, k, v = (torch.randn(1, 2, n, D, requires_grad=train,
                           generator=torch.Generator().manual_seed(s)) for s in range(3))
    with LargestTensor() as largest, torch.set_grad_enabled(train):
        out = blockwise_attention(q, k, v, additive=True, span=span)
        if train:
            out.sum().backward()
    # nothing larger than q itself (the scores of all queries, H x T x w, would be 8 times that)
    assert largest.numel <= q.numel()
    for i in (0, 63, 64, 100, 4095, 8191):
        keys = [j for j in range(i + 1) if visible_by_definition(span, torch.tensor(i),
                                                                 torch.tensor(j))]
        kk, vv = k[0, :, keys].double(), v[0, :, keys].double()
        qi = q[0, :, i:i + 1].double()
        ref = torch.softmax(qi @ kk.transpose(-1, -2) / math.sqrt(D), -1) @ vv
        torch.testing.assert_close(out[0, :, i:i + 1].double(), ref, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("name", ["nope", "alibi"])
@pytest.mark.parametrize("span", [*SPANS[:2], LAMBDA], ids=str)
def test_flex_block_mask_of_the_span_on_cpu(span, name, monkeypatch):
    """FlexAttention as CUDA calls it, with the span's block mask, run eagerly on CPU (forward
    only; compiling it takes 10 s per case: the compiled kernel is covered for the causal mask by
    tests/test_attention_paths.py)."""
    from torch.nn.attention.flex_attention import flex_attention as eager_flex

    monkeypatch.setattr(attention, "_compiled_flex", lambda: eager_flex)
    q, k, v = (x.detach().float() for x in qkv())
    enc = encoding(name).float()
    fn = enc.score_mod(q, k, torch.arange(T).expand(B, T), 0) if enc.score_mod else None
    with torch.no_grad():
        out = attention.flex_attention(q, k, v, fn, span)
        torch.testing.assert_close(out, dense(q.double(), k.double(), v.double(), span, fn)
                                   .float(), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("preset, kind", [("irope", "chunked"), ("rnope_swa", "sliding")])
def test_presets_are_three_local_rope_layers_to_one_global_nope_layer(preset, kind):
    cfg = posbench.compose([f"encoding={preset}", "model.n_layer=8", "model.d_model=32",
                            "model.n_head=2", "train.seq_len=64"])
    posbench.config.check(cfg)
    torch.manual_seed(0)
    model = posbench.build_model(cfg, 64).eval()
    local = Span(kind, 16)  # L/4
    assert [block.attn.span for block in model.blocks] == [local, local, local, GLOBAL] * 2
    assert [type(model.encoding.at_layer(i)[0]).__name__ for i in range(4)] == [
        "RoPE", "RoPE", "RoPE", "NoPE"]
    sharpen(model)
    idx = torch.randint(0, 64, (1, 70), generator=torch.Generator().manual_seed(0))
    visible = [lambda i, j: visible_by_definition(local, i, j)] * 3 + [None]
    # irope's NoPE layers: Llama 4's temperature, 1 + 0.1 ln(floor((i + 1) / L) + 1)
    floorlog = torch.tensor([1 + 0.1 * math.log((i + 1) // 64 + 1) for i in range(70)],
                            dtype=torch.float64).view(1, 70, 1)
    scale = [None] * 3 + [floorlog if preset == "irope" else None]
    with torch.no_grad():
        torch.testing.assert_close(model(idx).double(), reference_logits(
            model, idx, [True, True, True, False] * 2, visible=visible * 2, q_scale=scale * 2),
            rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("overrides, message", [
    (["model.attention=slidng"], "model.attention='slidng' is not accepted; expected one of"),
    (["eval.attention=lamda"], "eval.attention='lamda' is not accepted; expected one of "
     "('global', 'lambda') (did you mean 'lambda'?)"),
    (["eval.lambda_window=8"], "eval.lambda_window=8 is not accepted; expected null unless "
     "eval.attention=lambda"),
    (["eval.attention=lambda", "eval.lambda_sinks=-1"], "eval.lambda_sinks=-1 is not accepted"),
    (["eval.attention=lambda", "eval.lambda_window=0"], "eval.lambda_window=0 is not accepted"),
    (["eval.attention=lambda", "model.attention=chunked"], "eval.attention='lambda' is not "
     "accepted; expected 'global' for a model whose layers attend chunked only"),
    (["model.attention=sliding", "model.attention_window=0"], "model.attention_window=0"),
    (["encoding=layers", "encoding.pattern=[rope,nope]", "encoding.attention=[sliding]"],
     "expected one value per entry of encoding.pattern"),
    (["encoding=layers", "encoding.attention=[local]"], "entry 'local' is not accepted"),
])
def test_bad_spans_are_refused_in_one_line(overrides, message):
    with pytest.raises(ConfigError, match=re.escape(message)) as err:
        posbench.config.check(posbench.compose(overrides))
    assert "\n" not in str(err.value)


# --- eval.attention=lambda: StreamingLLM's sinks and window, LM-Infinite's Lambda mask ------------
def test_the_lambda_mask_and_its_counts_equal_the_definition_one_pair_at_a_time():
    n = 30
    for span in (LAMBDA, Span("lambda", 1, 1), Span("lambda", 40, 2)):
        want = torch.tensor([[j <= i and (j < span.sinks or i - j < span.width)
                              for j in range(n)] for i in range(n)])
        i, j = torch.arange(n).view(n, 1), torch.arange(n).view(1, n)
        assert torch.equal(span.visible(i, j), want)
        assert torch.equal(span.mask_mod()(0, 0, i, j), want)
        assert span.visible_keys(n).tolist() == want.sum(1).tolist()
        assert span.first_key(n - 1) == 0 and not span.bounded and not span.is_global


def test_lambda_defaults_keep_at_most_l_keys_and_no_sinks_is_the_sliding_window():
    assert lambda_span(128) == Span("lambda", 124, 4)  # 4 sinks, L - 4 recent keys
    assert lambda_span(128, 10, 64) == Span("lambda", 64, 10)
    assert lambda_span(128, 0) == Span("sliding", 128)
    # up to L tokens, the default mask is the causal one
    i, j = torch.arange(128).view(128, 1), torch.arange(128).view(1, 128)
    assert torch.equal(lambda_span(128).visible(i, j), j <= i)


@pytest.mark.parametrize("name", ["rope", "nope"])
def test_a_model_evaluated_with_lambda_matches_the_reference_forward(name):
    """eval.attention=lambda through set_eval_options on a model: every layer's logits equal the
    float64 forward written out with the lambda mask (rope rotating at the sequence's positions),
    for a sequence 3L long; global again once it is reset, the training's (local) spans kept."""
    L, n = 16, 48
    cfg = posbench.compose([f"encoding={name}", "model.n_layer=2", "model.d_model=32",
                            "model.n_head=2", f"train.seq_len={L}", "eval.attention=lambda",
                            "eval.lambda_sinks=2", "eval.lambda_window=5"])
    torch.manual_seed(0)
    model = posbench.build_model(cfg, 64).eval()
    sharpen(model)
    idx = torch.randint(0, 64, (2, n), generator=torch.Generator().manual_seed(0))
    span = Span("lambda", 5, 2)
    visible = [lambda i, j: visible_by_definition(span, i, j)] * 2
    rotate = [name == "rope"] * 2
    with torch.no_grad():
        plain = model(idx)
        set_eval_options(model, cfg.eval)
        assert [block.attn.span for block in model.blocks] == [span, span]
        torch.testing.assert_close(model(idx).double(), reference_logits(
            model, idx, rotate, visible=visible), rtol=1e-5, atol=1e-5)
        set_eval_options(model, {"attention": "global"})
        assert torch.equal(model(idx), plain)
    local = posbench.compose(["encoding=rnope_swa", "model.n_layer=4", "model.d_model=32",
                              "model.n_head=2", f"train.seq_len={L}", "eval.attention=lambda"])
    model = posbench.build_model(local, 64)
    set_eval_options(model, local.eval)
    assert [block.attn.span for block in model.blocks] == [Span("sliding", 4)] * 3 + [
        Span("lambda", L - 4, 4)]


def test_lm_infinite_is_lambda_with_rerope_capping_the_distance_at_l():
    """LM-Infinite: the Lambda mask, and a sink farther than the window at lag min(d, L) (ReRoPE
    with w = L): against q_i . R(r) k_j written with complex rotations in float64."""
    L, span = 16, Span("lambda", 6, 3)
    q, k, v = qkv()
    pos = torch.arange(T).expand(B, T)
    enc = build_encoding("rope")
    enc.set_eval_options("rerope", rope_window=L)
    i, j = torch.arange(T).view(T, 1), torch.arange(T).view(1, T)
    lag = (i - j).clamp(max=L).to(torch.float64)
    theta = 1e4 ** (-torch.arange(0, D, 2, dtype=torch.float64) / D)
    qc, kc = (torch.complex(x[..., :D // 2], x[..., D // 2:]) for x in (q, k))
    scores = (qc.unsqueeze(3) * kc.conj().unsqueeze(2)
              * torch.exp(1j * lag.unsqueeze(-1) * theta)).sum(-1).real / math.sqrt(D)
    scores = scores.masked_fill(~visible_by_definition(span, i, j), float("-inf"))
    assert_same_with_grads(attend(q, k, v, pos, enc, 0, span=span),
                           torch.softmax(scores, -1) @ v, (q, k, v))


def test_a_distance_remap_keeps_the_span():
    """RoPE's ReRoPE at evaluation on a sliding layer: every lag the span shows is below the
    remap's window, so the remapped attention equals RoPE's under the same span; keys outside
    the span keep weight 0."""
    span = Span("sliding", 4)
    q, k, v = qkv()
    pos = torch.arange(T).expand(B, T)
    plain, remapped = build_encoding("rope"), build_encoding("rope")  # remapped is changed
    remapped.set_eval_options("rerope", rope_window=4)
    assert remapped.remap is not None
    rq, rk = plain.rotate(q, k, pos, 0)
    assert_same_with_grads(attend(q, k, v, pos, remapped, 0, span=span),
                           dense(rq, rk, v, span), (q, k, v))
    probs = attention_probs(q, k, pos, remapped, 0, span=span)
    i, j = torch.arange(T).view(T, 1), torch.arange(T).view(1, T)
    assert (probs[..., ~visible_by_definition(span, i, j)] == 0).all()


def test_posbench_eval_scores_a_run_with_the_lambda_mask(tmp_path, toy_run_copy):
    """A toy run (L = 32) re-scored with eval.attention=lambda: finite losses, the same loss at L
    (the default mask is the causal one up to L tokens), another past it, the values in effect
    in results.json; a refusal is one line and writes nothing."""
    run_dir = toy_run_copy
    posbench_cli("eval", str(run_dir), "eval.attention=lambda", cwd=tmp_path, in_process=True)
    old = json.loads((run_dir / "results.json").read_text())
    new = json.loads((run_dir / "results.eval-attention-lambda.json").read_text())
    assert new["eval"]["attention"] == {"kind": "lambda", "sinks": 4, "window": 28}
    assert old["eval"]["attention"] is None
    (at_l, past_l), (new_l, new_past) = old["eval"]["curve"], new["eval"]["curve"]
    assert all(math.isfinite(p["loss"]) for p in (new_l, new_past))
    assert new_l["loss"] == pytest.approx(at_l["loss"], rel=1e-6)
    assert new_past["loss"] != past_l["loss"]
    before = sorted(p.name for p in run_dir.iterdir())
    bad = posbench_cli("eval", str(run_dir), "eval.attention=lambda", "eval.lambda_sinks=-2",
                       cwd=tmp_path, ok=False, in_process=True)
    assert bad.returncode == 2 and "Traceback" not in bad.stderr
    assert [x for x in bad.stderr.splitlines() if x.startswith("posbench: error:")] == [
        "posbench: error: eval.lambda_sinks=-2 is not accepted; expected an integer >= 0 (0: the "
        "window alone), or null (4)"]
    assert sorted(p.name for p in run_dir.iterdir()) == before
