"""FlexAttention as CUDA runs it (posbench/attention/paths.py: the cached compiled kernel and block
masks) stays compiled for a whole study: the training and validation shapes, every evaluation
length with its batch (tokens // length), retrieval's single sequences. dynamo recompiles a
function at most 8 times and then runs FlexAttention unfused, forming the whole scores (out of
memory at 65536 on gpt2-small): every shape of this test must be compiled.
Run here on the CPU, forward only (torch has no CPU backward for FlexAttention) and traced but
not lowered to C++ (conftest's flex_traced): the same dynamo guards decide the recompiles on
every device and backend."""
import math

import torch
import torch._dynamo

import posbench.attention.paths as attention
from posbench.attention.span import GLOBAL, Span

H, D = 2, 16
TOKENS = 4096  # eval.tokens-like: the batch of each length is TOKENS // length
# a study's shapes: validation at L = 128, then the eval lengths to 16L and two longer ones
LENGTHS = [128, 256, 384, 512, 768, 1024, 1536, 2048, 4096]


def dense(q, k, v, span: Span, score_mod=None):
    """softmax over the keys each query's span shows, from the full float64 scores."""
    T = q.shape[2]
    q_idx, kv_idx = torch.arange(T).view(1, 1, T, 1), torch.arange(T).view(1, 1, 1, T)
    scores = q @ k.transpose(-2, -1) / math.sqrt(q.shape[-1])
    if score_mod is not None:
        b = torch.arange(q.shape[0]).view(-1, 1, 1, 1)
        h = torch.arange(q.shape[1]).view(1, -1, 1, 1)
        scores = score_mod(scores, b, h, q_idx, kv_idx)
    return torch.softmax(scores.masked_fill(span.hidden(q_idx, kv_idx), float("-inf")), -1) @ v


def slope_bias(score, b, h, q_idx, kv_idx):  # ALiBi-like, slopes 1/2 and 1/4
    return score - (q_idx - kv_idx) * 0.5 ** (h + 1)


def test_one_study_keeps_flex_compiled_at_every_shape(caplog, flex_traced):
    torch._dynamo.reset()
    attention._block_mask.cache_clear()
    g = torch.Generator().manual_seed(0)
    shapes = [(TOKENS // T, T) for T in LENGTHS] + [(1, 640), (1, 2560)]  # + retrieval's
    with torch.no_grad():
        for B, T in shapes:
            q, k, v = (torch.randn(B, H, T, D, generator=g) for _ in range(3))
            out = attention.flex_attention(q, k, v, slope_bias)
            ref = dense(q.double(), k.double(), v.double(), GLOBAL, slope_bias)
            torch.testing.assert_close(out.double(), ref, rtol=2e-5, atol=2e-5)
    # past dynamo's limit, the shape would run unfused (warning "hit config.recompile_limit")
    assert not [r for r in caplog.records if "recompile_limit" in r.getMessage()]


def learned_and_fixed():
    """(t5's score_mod, whose bias table is a parameter; alibi's, whose slopes are fixed), each
    bound to q and k that need a gradient, as in training."""
    import posbench

    mods = []
    for name in ("t5", "alibi"):
        cfg = posbench.compose([f"encoding={name}", "model.n_layer=1", "model.d_model=32",
                                "model.n_head=2", "train.seq_len=32"])
        enc = posbench.build_model(cfg, 256).encoding
        q, k = (torch.randn(1, 2, 8, 16, requires_grad=True) for _ in range(2))
        mods.append((enc.score_mod(q, k, torch.arange(8).expand(1, 8), 0), q))
    return mods


def test_flex_is_kept_for_score_mods_that_no_gradient_flows_into():
    """On CUDA a learned bias in training leaves FlexAttention, whose backward would add the
    table's gradient atomically, one add per score, for a path that sums it exactly."""
    (t5, q), (alibi, _) = learned_and_fixed()
    assert attention._learns_through(t5, q)
    assert not attention._learns_through(alibi, q)
    with torch.no_grad():  # evaluation: every encoding keeps FlexAttention
        assert not attention._learns_through(t5, q)
