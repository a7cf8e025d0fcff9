"""Layer patterns (docs/encodings.md#hybrid-family): `encoding=layers encoding.pattern=[...]` gives
layer i the encoding pattern[i % len(pattern)]. The oracle is a dense float64 forward of the
same weights written here, with RoPE re-derived pair by pair."""
import copy
import math
import re

import pytest
import torch
from omegaconf import OmegaConf, open_dict

import posbench
from posbench.encodings import registry
from posbench.core.errors import ConfigError

SMALL = ["model.n_layer=4", "model.d_model=32", "model.n_head=2", "train.seq_len=32"]


def build(*overrides):
    cfg = posbench.compose([*SMALL, *overrides])
    torch.manual_seed(0)
    return posbench.build_model(cfg, vocab_size=64).eval()


def rotate_ref(x, base=10000.0):
    """RoPE on the half-split layout: pair p = (x_p, x_{p+d/2}) turned by t * base^(-2p/d)."""
    T, d = x.shape[-2], x.shape[-1]
    t = torch.arange(T, dtype=torch.float64).view(T, 1)
    angle = t * base ** (-torch.arange(0, d, 2, dtype=torch.float64) / d)
    x1, x2 = x[..., :d // 2], x[..., d // 2:]
    return torch.cat((x1 * angle.cos() - x2 * angle.sin(), x2 * angle.cos() + x1 * angle.sin()),
                     -1)


def reference_logits(model, idx, rotate, visible=None, q_scale=None):
    """The GPT forward in float64 from model's weights, written out: layer i rotates q and k
    when rotate[i]; visible[i](i_idx, j_idx) -> bool (T, T) keeps keys beside the causal mask;
    q_scale[i] (H or 1, T, 1) multiplies q after the rotation."""
    m = copy.deepcopy(model).double()
    x = m.tok_emb(idx)
    B, T, C = x.shape
    i, j = torch.arange(T).view(T, 1), torch.arange(T).view(1, T)
    for layer, block in enumerate(m.blocks):
        H = block.attn.n_head
        d = C // H
        q, k, v = block.attn.qkv(block.ln_1(x)).view(B, T, 3, H, d).permute(2, 0, 3, 1, 4)
        if rotate[layer]:
            q, k = rotate_ref(q), rotate_ref(k)
        if q_scale is not None and q_scale[layer] is not None:
            q = q * q_scale[layer]
        keep = j <= i
        if visible is not None and visible[layer] is not None:
            keep = keep & visible[layer](i, j)
        scores = (q @ k.transpose(-1, -2) / math.sqrt(d)).masked_fill(~keep, float("-inf"))
        y = (torch.softmax(scores, -1) @ v).transpose(1, 2).reshape(B, T, C)
        x = x + block.attn.proj(y)
        x = x + block.mlp(block.ln_2(x))
    return m.head(m.ln_f(x))


def sharpen(model, factor=8.0):
    """Scales every layer's q and k projections, so that positions visibly move the logits of
    an untrained model."""
    with torch.no_grad():
        for block in model.blocks:
            block.attn.qkv.weight[:2 * block.attn.qkv.in_features] *= factor


# a layer's encoding from the pattern: every registered one that acts within a layer
PER_LAYER = [name for name, entry in registry().items()
             if entry.cls.family != "hybrid" and entry.cls.positions is None]


@pytest.fixture(scope="module")
def composed():
    return posbench.compose(SMALL)


def with_encoding(cfg, node):
    """cfg with its encoding replaced (one Hydra compose for the whole parametrized test)."""
    cfg = copy.deepcopy(cfg)
    with open_dict(cfg):
        cfg.encoding = node
    torch.manual_seed(0)
    return posbench.build_model(cfg, vocab_size=64).eval()


@pytest.mark.parametrize("name", PER_LAYER)
def test_a_pattern_of_one_encoding_is_that_encoding(name, composed):
    idx = torch.randint(0, 64, (2, 24), generator=torch.Generator().manual_seed(0))
    plain = with_encoding(composed, OmegaConf.structured(registry()[name].config))
    pattern = with_encoding(composed, {"name": "layers", "pattern": [name]})
    with torch.no_grad():
        assert torch.equal(plain(idx), pattern(idx))


def test_each_layer_takes_its_entry_of_the_repeated_pattern():
    model = build("encoding=layers", "encoding.pattern=[rope,nope,nope]")
    enc = model.encoding
    assert [(type(e).__name__, i) for e, i in map(enc.at_layer, range(4))] == [
        ("RoPE", 0), ("NoPE", 0), ("NoPE", 1), ("RoPE", 1)]
    sharpen(model)
    idx = torch.randint(0, 64, (2, 20), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        out = model(idx).double()
    torch.testing.assert_close(out, reference_logits(model, idx, [True, False, False, True]),
                               rtol=1e-5, atol=1e-5)
    assert not torch.allclose(out, reference_logits(model, idx, [True] * 4), atol=1e-2)


def test_each_kind_is_built_for_the_layers_it_serves():
    """Shaw's per-layer tables: two layers of four; `learned` adds its table before the first
    layer of its kind, which is layer 1 here."""
    enc = build("encoding=layers", "encoding.pattern=[shaw,nope]").encoding
    assert enc.kinds["shaw"].dims.n_layer == 2 and enc.kinds["nope"].dims.n_layer == 2
    plain = build("encoding=shaw").encoding
    assert sum(p.numel() for p in enc.parameters()) * 2 == sum(p.numel() for p in plain.parameters())

    model = build("encoding=layers", "encoding.pattern=[nope,learned]", "model.n_layer=2")
    calls = []
    learned = model.encoding.kinds["learned"]
    original = learned.embed
    learned.embed = lambda x, pos, layer: calls.append(layer) or original(x, pos, layer)
    with torch.no_grad():
        model(torch.zeros(1, 8, dtype=torch.long))
    assert calls == [0]  # called at model layer 1 only, as the first layer of its kind


def test_eval_options_reach_the_rotary_kinds_only():
    enc = build("encoding=layers", "encoding.pattern=[rope,alibi]").encoding
    enc.set_eval_options("pi", rope_scaling_factor=4.0)
    assert (enc.kinds["rope"].rope_scaling, enc.kinds["rope"].rope_scaling_factor) == ("pi", 4.0)
    assert enc.kinds["alibi"].rope_scaling == "none"


@pytest.mark.parametrize("overrides, message", [
    (["encoding.pattern=[rope,ropee]"], "entry 'ropee' is not accepted (did you mean 'rope'?)"),
    (["encoding.pattern=[rope,randomized]"], "without a positions hook"),
    (["encoding.pattern=[layers]"], "not a pattern itself"),
    (["encoding.pattern=[]"], "encoding.pattern=[] is not accepted"),
    (["encoding.pattern=[alibi,nope]", "eval.rope_scaling=yarn"], "holds no rotary encoding"),
])
def test_bad_patterns_are_refused_in_one_line(overrides, message):
    with pytest.raises(ConfigError, match=re.escape(message)):
        posbench.config.check(posbench.compose(["encoding=layers", *overrides]))
