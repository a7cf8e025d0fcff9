"""model.attn_gate (gated attention, Qiu et al. 2025) and model.attn_sinks (gpt-oss's learned
sinks) against an oracle written from their formulas in float64, forward and gradients, for
encodings that take each attention path: fused SDPA (nope, rope), the lag table (alibi) and a
learned one (t5), a bias read from the input (fox), a row hook (stick_breaking), a value hook
(shaw), RoPE's eval-time distance remap (rerope), in one block and in several, under a local span,
and FlexAttention's forward on CPU.

    sink:  p_ij = e^{l_ij} / (e^{s_h} + sum_j e^{l_ij}), no value for the sink
    gate:  o_i <- o_i * sigmoid(x_i W_g), per head (headwise) or per channel (elementwise), before
           the output projection
"""
import json
import math
import re

import pytest
import torch

import posbench
import posbench.attention.paths as attention
from posbench.attention.span import GLOBAL, Span
from posbench.core.errors import ConfigError

from helpers import off_init, run_in_process, results, tiny_model

B, T = 2, 40
KNOBS = {"gate+sinks": ("model.attn_gate=elementwise", "model.attn_sinks=true"),
         "headwise": ("model.attn_gate=headwise",),
         "sinks": ("model.attn_sinks=true",)}
ENCODINGS = ["nope", "rope", "alibi", "t5", "fox", "stick_breaking", "shaw"]


def knob_model(name, *extra):
    """tiny_model in float64 with its learned values moved off their init (off_init)."""
    return off_init(tiny_model("train.seq_len=32", "eval.lengths=[64]", *extra, name=name).double())


def oracle(attn, encoding, x, pos):
    """The layer's output from dense float64 scores: the encoding's hooks, the causal mask and
    the span, then the sink and the gate as the formulas write them."""
    enc, layer = encoding.at_layer(attn.layer)
    q, k, v = attn.heads(x, pos, encoding)
    Bq, H, Tq, _ = q.shape
    dev = q.device  # the CUDA test runs the oracle too
    b = torch.arange(Bq, device=dev).view(-1, 1, 1, 1)
    h = torch.arange(H, device=dev).view(1, -1, 1, 1)
    q_idx = torch.arange(Tq, device=dev).view(1, 1, -1, 1)
    kv_idx = torch.arange(Tq, device=dev).view(1, 1, 1, -1)
    inputs = {"x": x} if enc.reads_input else {}
    if enc.remap is not None:
        near_q, near_k, far_q, far_k, is_near = enc.remap(q, k, pos, layer, attn.span)
        scores = torch.where(is_near(b, q_idx, kv_idx), near_q @ near_k.transpose(-2, -1),
                             far_q @ far_k.transpose(-2, -1)) / math.sqrt(near_q.shape[-1])
    else:
        scores = q @ k.transpose(-2, -1) / math.sqrt(q.shape[-1])
        if enc.score_mod is not None:
            scores = enc.score_mod(q, k, pos, layer, **inputs)(scores, b, h, q_idx, kv_idx)
    hidden = attn.span.hidden(q_idx, kv_idx)
    scores = scores.masked_fill(hidden, float("-inf"))
    if enc.row_mod is not None:
        scores = enc.row_mod(scores, q=q, k=k, pos=pos, layer=layer, q_idx=q_idx, kv_idx=kv_idx,
                             **inputs).masked_fill(hidden, float("-inf"))
    sink = (attn.sinks.view(1, H, 1, 1) if attn.sinks is not None
            else torch.full((1, 1, 1, 1), float("-inf"), dtype=scores.dtype, device=dev))
    top = torch.maximum(scores.amax(-1, keepdim=True), sink)  # for exp's range only
    weights = (scores - top).exp()
    probs = weights / ((sink - top).exp() + weights.sum(-1, keepdim=True))
    out = probs @ v
    if enc.value_mod is not None:
        out = out + enc.value_mod(probs, pos=pos, layer=layer, q_idx=q_idx, kv_idx=kv_idx)
    if attn.gate is not None:
        gate = torch.sigmoid(x @ attn.gate.weight.T)  # (B, T, H) or (B, T, D)
        out = out * gate.view(Bq, Tq, H, -1).transpose(1, 2)
    return attn.proj(out.transpose(1, 2).reshape(Bq, Tq, -1)), probs


def check_layer(model, x, pos, layer=0, tol=1e-10):
    """Layer `layer`'s attention in training (gradient) and evaluation (no_grad) against the
    oracle: its output, and the gradients of x, of every attention parameter and of the
    encoding's."""
    attn = model.blocks[layer].attn
    x = x.clone().requires_grad_()
    wrt = [x, *attn.parameters(), *model.encoding.parameters()]
    out = attn(x, pos, model.encoding)
    ref, _ = oracle(attn, model.encoding, x, pos)
    torch.testing.assert_close(out, ref, rtol=tol, atol=tol)
    probe = torch.randn_like(ref)
    grads = torch.autograd.grad((out * probe).sum(), wrt, allow_unused=True)
    ref_grads = torch.autograd.grad((ref * probe).sum(), wrt, allow_unused=True)
    for g, r in zip(grads, ref_grads):
        assert (g is None) == (r is None)
        if g is not None:
            torch.testing.assert_close(g, r, rtol=tol, atol=tol)
    own = [attn.gate.weight] if attn.gate is not None else []
    own += [attn.sinks] if attn.sinks is not None else []
    for p in own:  # the knobs' own parameters learn
        assert next(g for g, w in zip(grads, wrt) if w is p).abs().sum() > 0
    with torch.no_grad():
        torch.testing.assert_close(attn(x, pos, model.encoding), ref.detach(), rtol=tol, atol=tol)


def layer_input(model, seed=0):
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(B, T, model.blocks[0].attn.qkv.in_features, generator=gen,
                       dtype=torch.float64)


@pytest.mark.parametrize("knobs", KNOBS, ids=list(KNOBS))
@pytest.mark.parametrize("name", ENCODINGS)
def test_the_knobs_match_their_formulas_on_every_path(name, knobs):
    model = knob_model(name, *KNOBS[knobs])
    pos = torch.arange(T).expand(B, T)
    check_layer(model, layer_input(model), pos, layer=1)


def test_a_distance_remap_takes_the_knobs():
    """RoPE under eval.rope_scaling=rerope: the remapped dense path appends the sink too."""
    model = knob_model("rope", *KNOBS["gate+sinks"])
    model.encoding.set_eval_options("rerope", rope_window=8)
    assert model.encoding.remap is not None
    check_layer(model, layer_input(model), torch.arange(T).expand(B, T))


@pytest.mark.parametrize("name", ["nope", "alibi", "t5", "stick_breaking"])
@pytest.mark.parametrize("span", ["global", "sliding"])
def test_several_blocks_and_a_local_span(name, span, monkeypatch):
    """Blocks of 16 query rows (checkpointed, biased_attention's backward in chunks of 5 that
    straddle them), each block's keys from the first its span shows: the sink key leads them."""
    monkeypatch.setattr(attention, "BLOCK_ELEMENTS", B * 4 * T * 16)
    monkeypatch.setattr(attention, "BACKWARD_ROWS", 5)
    extra = ("model.attention=sliding", "model.attention_window=12") if span == "sliding" else ()
    model = knob_model(name, *KNOBS["gate+sinks"], *extra)
    assert model.blocks[0].attn.span.is_global == (span == "global")
    pos = torch.arange(T).repeat(B, 1) + torch.tensor([[0], [7]])  # a row per sequence
    check_layer(model, layer_input(model, 1), pos)


@pytest.mark.parametrize("name, span", [("nope", GLOBAL), ("nope", Span("sliding", 12)),
                                        ("alibi", GLOBAL), ("fox", GLOBAL)])
def test_flex_attention_scales_by_the_sinks_share_of_its_log_sum_exp(name, span, monkeypatch):
    """FlexAttention's path on CUDA, run forward on CPU, uncompiled (torch has no CPU backward
    for it, and its CPU compile returns no log-sum-exp): out * sigmoid(lse - s_h) is the
    attention with the sink in the denominator."""
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention

    monkeypatch.setattr(attention, "_compiled_flex", lambda: flex_attention)
    monkeypatch.setattr(attention, "_block_mask", lambda T, device, span: create_block_mask(
        span.mask_mod(), None, None, T, T, device=device))
    model = knob_model(name, *KNOBS["sinks"]).float()
    attn = model.blocks[0].attn
    attn.span = span
    x = layer_input(model).float()
    pos = torch.arange(T).expand(B, T)
    with torch.no_grad():
        q, k, v = attn.heads(x, pos, model.encoding)
        enc, layer = model.encoding.at_layer(0)
        fn = (enc.score_mod(q, k, pos, layer, **({"x": x} if enc.reads_input else {}))
              if enc.score_mod is not None else None)
        out = attention.flex_attention(q, k, v, fn, span, attn.sinks)
        _, probs = oracle(attn.double(), model.encoding.double(), x.double(), pos)
    torch.testing.assert_close(out, (probs @ v.double()).float(), rtol=1e-5, atol=1e-5)


@pytest.mark.cuda
@pytest.mark.parametrize("name", ["nope", "alibi"])
def test_flex_attention_with_sinks_forward_and_backward_on_cuda(name):
    """On CUDA the layer takes FlexAttention: its gradient through the log-sum-exp reaches q, k, v
    and the sinks as the oracle's does."""
    model = knob_model(name, *KNOBS["gate+sinks"]).float().cuda()
    attn = model.blocks[0].attn
    x = layer_input(model).float().cuda().requires_grad_()
    pos = torch.arange(T, device="cuda").expand(B, T)
    wrt = [x, *attn.parameters()]
    out = attn(x, pos, model.encoding)
    ref, _ = oracle(attn, model.encoding, x, pos)
    torch.testing.assert_close(out, ref, rtol=1e-4, atol=1e-4)
    grads = torch.autograd.grad(out.square().sum(), wrt)
    ref_grads = torch.autograd.grad(ref.square().sum(), wrt)
    for g, r in zip(grads, ref_grads):
        torch.testing.assert_close(g, r, rtol=1e-3, atol=1e-4)


def test_inspected_probabilities_leave_out_the_sinks_share():
    """attention_probs (posbench inspect) gives the probabilities the forward uses: each row
    sums to 1 - e^{s_h} / (e^{s_h} + Z)."""
    model = knob_model("alibi", *KNOBS["sinks"])
    attn = model.blocks[0].attn
    x, pos = layer_input(model), torch.arange(T).expand(B, T)
    with torch.no_grad():
        q, k, _ = attn.heads(x, pos, model.encoding)
        probs = attention.attention_probs(q, k, pos, *model.encoding.at_layer(0), 5, 30,
                                          span=attn.span, sinks=attn.sinks)
        _, ref = oracle(attn, model.encoding, x, pos)
    torch.testing.assert_close(probs, ref[:, :, 5:30, :30], rtol=1e-12, atol=1e-12)
    assert (probs.sum(-1) < 1 - 1e-3).all()


def test_off_by_default_with_the_fused_path_and_no_new_parameters(monkeypatch):
    def blockwise(*args, **kwargs):
        raise AssertionError("a model without sinks left fused SDPA")

    model = tiny_model(name="nope")
    assert all(b.attn.gate is None and b.attn.sinks is None for b in model.blocks)
    assert not [n for n in model.state_dict() if ".gate" in n or "sinks" in n]
    monkeypatch.setattr(attention, "blockwise_attention", blockwise)
    with torch.no_grad():
        model(torch.zeros(1, 8, dtype=torch.long))


@pytest.mark.parametrize("knobs, per_layer", [("gate+sinks", 64 * 64 + 4),
                                              ("headwise", 64 * 4), ("sinks", 4)])
def test_the_parameters_are_counted_and_initialized_as_the_references(knobs, per_layer):
    """model.params counts W_g (D x D elementwise, D x H headwise; no bias) and s (H) in each of
    the 2 layers. W_g is drawn as the other projections, N(0, 0.02^2) (Qwen3-Next's q_proj, of
    which it is part there), s from N(0, 0.02^2) (Hugging Face's gpt_oss _init_weights)."""
    plain, model = tiny_model(name="rope"), tiny_model(*KNOBS[knobs], name="rope")
    assert model.num_params() - plain.num_params() == 2 * per_layer
    gates = [b.attn.gate.weight for b in model.blocks if b.attn.gate is not None]
    if gates:
        assert 0.017 < torch.cat([g.flatten() for g in gates]).std() < 0.023
    sinks = [b.attn.sinks for b in model.blocks if b.attn.sinks is not None]
    if sinks:
        s = torch.cat(sinks)
        assert 0 < s.abs().max() < 0.1 and s.std() > 0


def test_an_unknown_gate_is_refused_in_one_line():
    message = ("model.attn_gate='elementwize' is not accepted; expected one of ('none', "
               "'headwise', 'elementwise') (did you mean 'elementwise'?)")
    with pytest.raises(ConfigError, match=re.escape(message)):
        posbench.config.check(posbench.compose(["encoding=rope", "model.attn_gate=elementwize"]))
    with pytest.raises(Exception, match="model.attn_sinks"):  # the schema's type, at compose
        posbench.compose(["encoding=rope", "model.attn_sinks=maybe"])


def test_a_run_saves_the_knobs_parameters_and_scores_the_same_from_its_checkpoint(
        tmp_path, monkeypatch, capsys):
    """Training writes W_g and s into checkpoint.pt; `posbench eval RUN_DIR` loads them into a
    model built from the saved config (strictly) and scores what the run scored."""
    run = tmp_path / "run"
    overrides = ["encoding=alibi", "model.attn_gate=elementwise", "model.attn_sinks=true",
                 "model.n_layer=1", "model.d_model=32", "model.n_head=2", "train.steps=2",
                 "train.batch_size=2", "train.seq_len=32", "train.warmup_steps=1",
                 "eval.lengths=[32,64]", "eval.tokens=128", "device=cpu", f"hydra.run.dir={run}"]
    proc = run_in_process(["train", *overrides], monkeypatch, capsys)
    assert proc.returncode == 0, proc.stderr
    from posbench.runs.checkpoint import load_checkpoint

    saved = load_checkpoint(run / "checkpoint.pt")["model"]
    assert saved["blocks.0.attn.gate.weight"].shape == (32, 32)
    assert saved["blocks.0.attn.sinks"].shape == (2,) and saved["blocks.0.attn.sinks"].any()
    record = results(run)
    rescored = run_in_process(["eval", str(run), "eval.lengths=[32,64,96]", "eval.tokens=128"],
                              monkeypatch, capsys)
    assert rescored.returncode == 0, rescored.stderr
    (again,) = [json.loads(p.read_text()) for p in run.glob("results.*.json")]
    losses = {row["length"]: row["loss"] for row in again["eval"]["curve"]}
    for row in record["eval"]["curve"]:
        assert losses[row["length"]] == pytest.approx(row["loss"], rel=1e-6)
