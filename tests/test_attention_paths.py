"""Every attention path against a dense float64 reference, forward and backward.

Paths (posbench/attention/paths.py): fused SDPA (no score hook), the blockwise CPU path with dense
scores (any hook) and with an additive score_mod as SDPA's float mask (biased_attention when the
bias is learned), each in one block and in several checkpointed blocks; FlexAttention forward on
CPU (torch has no CPU backward for it).
"""
import math

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

import posbench.attention.paths as attention
import posbench.attention.lag_bias as lag_bias
from posbench.attention.paths import attend, blockwise_attention
from posbench.encodings import registry, transformer_xl
from helpers import random_encoding, registered_encoding

B, H, T, D = 3, 4, 50, 8


def encoding(name):
    return random_encoding(name, H, n_layer=2, d_model=32, vocab=256)


# every encoding that declares its score_mod additive, so the CPU path fuses it as a float mask
ADDITIVE = [name for name in sorted(registry()) if registered_encoding(name).additive_score_mod]


def inputs(seed=0, dtype=torch.float64):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(B, H, T, D, generator=g, dtype=dtype).requires_grad_() for _ in range(3)]


def block_input(enc, dtype=torch.float64):
    """x= for the encodings whose score_mod reads the attention's input (FoX), the same input
    at every call; nothing for the others."""
    if not enc.reads_input:
        return {}
    return {"x": torch.randn(B, T, 32, generator=torch.Generator().manual_seed(1), dtype=dtype)}


def positions(shared):
    """The model's usual expanded arange, or a separate row per sequence at other offsets."""
    if shared:
        return torch.arange(T).expand(B, T)
    return torch.arange(T).repeat(B, 1) + torch.tensor([[0], [7], [1000]])


def dense_reference(q, k, v, score_mod=None):
    """softmax(causal(score_mod(q k^T / sqrt(d)))) v over the full (B, H, T, T) scores."""
    Tq, Tk = q.shape[2], k.shape[2]
    b = torch.arange(q.shape[0]).view(-1, 1, 1, 1)
    h = torch.arange(q.shape[1]).view(1, -1, 1, 1)
    q_idx, kv_idx = torch.arange(Tq).view(1, 1, Tq, 1), torch.arange(Tk).view(1, 1, 1, Tk)
    scores = q @ k.transpose(-2, -1) / math.sqrt(q.shape[-1])
    if score_mod is not None:
        scores = score_mod(scores, b, h, q_idx, kv_idx)
    return torch.softmax(scores.masked_fill(kv_idx > q_idx, float("-inf")), -1) @ v


def assert_same_with_grads(out, ref, wrt, rtol=1e-10, atol=1e-10):
    torch.testing.assert_close(out, ref, rtol=rtol, atol=atol)
    probe = torch.randn_like(ref)  # a generic output gradient
    # retain: a score_mod may build tables once, shared by both graphs
    # unused: another layer's parameters (FIRE, Transformer-XL's W_R), None on both sides
    grads = torch.autograd.grad((out * probe).sum(), wrt, retain_graph=True, allow_unused=True)
    ref_grads = torch.autograd.grad((ref * probe).sum(), wrt, allow_unused=True)
    assert any(g is not None for g in grads[3:]) or len(wrt) == 3
    for g, r in zip(grads, ref_grads):
        assert (g is None) == (r is None)
        if g is not None:
            torch.testing.assert_close(g, r, rtol=rtol, atol=atol)


def test_sdpa_path_forward_and_backward():
    q, k, v = inputs()
    enc = encoding("nope")
    out = attend(q, k, v, positions(True), enc, 0)
    assert_same_with_grads(out, dense_reference(q, k, v), (q, k, v))


def test_sdpa_path_with_values_narrower_than_queries_and_keys():
    """PoPE's q and k are twice v's width: v is padded for the fused kernel, the output cut."""
    q, k, _ = inputs()
    v = torch.randn(B, H, T, D // 2, dtype=torch.float64, requires_grad=True)
    out = attention.causal_sdpa(q, k, v)
    assert_same_with_grads(out, dense_reference(q, k, v), (q, k, v))


@pytest.mark.parametrize("blocks", ["one", "several"])
@pytest.mark.parametrize("additive", [False, True], ids=["dense-scores", "sdpa-mask"])
@pytest.mark.parametrize("shared", [True, False], ids=["shared-pos", "per-row-pos"])
@pytest.mark.parametrize("name", ADDITIVE)
def test_blockwise_paths_forward_and_backward(name, shared, additive, blocks, monkeypatch):
    if blocks == "several":  # rows of 16: four blocks, each checkpointed
        monkeypatch.setattr(attention, "BLOCK_ELEMENTS", B * H * T * 16)
        monkeypatch.setattr(attention, "BACKWARD_ROWS", 5)  # chunks that straddle blocks
    q, k, v = inputs()
    enc = encoding(name)
    fn = enc.score_mod(q, k, positions(shared), 0, **block_input(enc))
    out = blockwise_attention(q, k, v, fn, additive=additive)
    assert_same_with_grads(out, dense_reference(q, k, v, fn), (q, k, v, *enc.parameters()))


@pytest.mark.parametrize("name", ADDITIVE)
def test_additive_score_mod_adds_a_bias_that_ignores_the_score(name):
    """The flag's promise: score_mod(s) = s + score_mod(0) for any s, so that the bias can be
    evaluated once on zeros."""
    q, k, v = inputs()
    enc = encoding(name)
    fn = enc.score_mod(q, k, positions(False), 1, **block_input(enc))
    b, h = torch.arange(B).view(B, 1, 1, 1), torch.arange(H).view(1, H, 1, 1)
    q_idx, kv_idx = torch.arange(T).view(1, 1, T, 1), torch.arange(T).view(1, 1, 1, T)
    scores = torch.randn(B, H, T, T, dtype=torch.float64) * 10
    bias = fn(torch.zeros((), dtype=torch.float64), b, h, q_idx, kv_idx)
    assert bias.abs().amax() > 0
    torch.testing.assert_close(fn(scores, b, h, q_idx, kv_idx), scores + bias)


def test_the_additive_encodings_are_the_bias_family():
    assert {"alibi", "t5", "kerple_log", "kerple_power", "sandwich", "fire", "transformer_xl",
            "alibi_as_group"} <= set(ADDITIVE)
    assert not {"decay", "damped_rope", "da_transformer"} & set(ADDITIVE)


@pytest.mark.parametrize("name", ADDITIVE)
def test_additive_encodings_take_the_sdpa_mask_path(name, monkeypatch):
    def dense_path(*args, **kwargs):
        raise AssertionError("an additive score_mod reached the dense-scores block")

    monkeypatch.setattr(attention, "_attend_block", dense_path)
    q, k, v = inputs()
    enc = encoding(name)
    assert enc.additive_score_mod
    pos = positions(True)
    out = attend(q, k, v, pos, enc, 1, **block_input(enc))
    fn = enc.score_mod(q, k, pos, 1, **block_input(enc))
    assert_same_with_grads(out, dense_reference(q, k, v, fn), (q, k, v, *enc.parameters()))


def test_learned_bias_in_a_later_block_starts_at_its_offset():
    """biased_attention alone for a block of queries 20..49 against keys 0..49."""
    q, k, v = inputs()
    enc = encoding("t5")
    fn = enc.score_mod(q, k, positions(True), 0)
    b, h = torch.arange(B).view(B, 1, 1, 1), torch.arange(H).view(1, H, 1, 1)
    out = attention._bias_block(q[:, :, 20:], k, v, 20, b, h, fn)
    ref = dense_reference(q, k, v, fn)[:, :, 20:]
    assert_same_with_grads(out, ref, (q, k, v, *enc.parameters()))


def test_a_learned_bias_keeps_the_fused_kernel():
    """SDPA takes its unfused path for a mask that needs a gradient; biased_attention hands it
    the mask detached, so that only the fused kernel, allowed alone here, runs its forward."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    q, k, v = inputs()
    enc = encoding("t5")
    fn = enc.score_mod(q, k, positions(True), 0)
    b, h = torch.arange(B).view(B, 1, 1, 1), torch.arange(H).view(1, H, 1, 1)
    with sdpa_kernel([SDPBackend.FLASH_ATTENTION]):
        out = attention._bias_block(q, k, v, 0, b, h, fn)
    assert_same_with_grads(out, dense_reference(q, k, v, fn), (q, k, v, *enc.parameters()))


# every encoding that takes FlexAttention on CUDA: a score_mod and no row or value hook
FLEX = [name for name in sorted(registry()) if (lambda e: e.score_mod is not None
        and e.row_mod is None and e.value_mod is None)(registered_encoding(name))]


@pytest.mark.parametrize("name", FLEX)
def test_flex_attention_forward_on_cpu(name, monkeypatch, flex_traced):
    """Each score_mod traced into FlexAttention's compiled graph as on CUDA (forward only: torch
    has no CPU backward for it; not lowered to C++, conftest's flex_traced), against the dense
    reference."""
    monkeypatch.setattr(transformer_xl, "whole_table", lambda q: True)  # its CUDA form
    q, k, v = (x.detach() for x in inputs(dtype=torch.float32))
    enc = encoding(name).float()
    pos = positions(True)
    with torch.no_grad():
        if enc.rotate is not None:  # the decay presets rotate as well
            q, k = enc.rotate(q, k, pos, 0)
        fn = enc.score_mod(q, k, pos, 0, **block_input(enc, torch.float32))
        out = attention.flex_attention(q, k, v, fn)
        torch.testing.assert_close(out, dense_reference(q.double(), k.double(), v.double(), fn)
                                   .float(), rtol=1e-5, atol=1e-5)


def test_flex_covers_the_score_mod_families():
    assert {"alibi", "t5", "kerple_log", "fire", "sandwich", "transformer_xl", "da_transformer",
            "decay", "damped_rope"} <= set(FLEX)


def test_flex_attention_inside_an_outer_compile():
    """train.compile=true compiles the model around the attention: flex is traced into that
    graph rather than called through its own compiled, cached wrapper."""
    q, k, v = (x.detach() for x in inputs(dtype=torch.float32))
    enc = encoding("alibi").float()
    fn = enc.score_mod(q, k, positions(True), 0)
    compiled = torch.compile(lambda q, k, v: attention.flex_attention(q, k, v, fn), dynamic=False)
    with torch.no_grad():
        torch.testing.assert_close(compiled(q, k, v), dense_reference(q, k, v, fn),
                                   rtol=1e-5, atol=1e-5)


class LargestTensor(TorchDispatchMode):
    """Records the largest tensor any op produces."""

    def __init__(self):
        super().__init__()
        self.numel = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in out if isinstance(out, (tuple, list)) else (out,):
            if isinstance(t, torch.Tensor):
                self.numel = max(self.numel, t.numel())
        return out


def largest_in_row_blocks(monkeypatch, encoding, reads_input=True, n=1024, H=4, d=16):
    """(the most elements one tensor held while `encoding`'s layer 0 attended over n tokens in
    blocks of 64 query rows, the elements of one block's scores): the blockwise path and the
    evaluation fast paths of posbench/attention/lag_bias.py alike."""
    block = H * n * 64
    monkeypatch.setattr(attention, "BLOCK_ELEMENTS", block)
    monkeypatch.setattr(lag_bias, "ROWS", 64)
    q, k, v = (torch.randn(1, H, n, d) for _ in range(3))
    x = torch.randn(1, n, 64) if reads_input else None
    with LargestTensor() as largest, torch.no_grad():
        attend(q, k, v, torch.arange(n).expand(1, n), encoding, 0, x)
    return largest.numel, block


@pytest.mark.parametrize("train", [False, True], ids=["eval", "train"])
@pytest.mark.parametrize("additive", [False, True], ids=["dense-scores", "sdpa-mask"])
@pytest.mark.parametrize("name", ["t5", "transformer_xl"])
def test_blockwise_memory_grows_with_length_not_its_square(name, additive, train, monkeypatch):
    """Blocks of 64 query rows at T = 1024: no tensor holds more than a block's scores (1/16 of
    the full H x T x T), and in training the graph keeps only the blocks' inputs (checkpoint).
    Transformer-XL's lag terms are per query row and lag, T^2 unless built block by block."""
    n = 1024
    block = H * n * 64
    monkeypatch.setattr(attention, "BLOCK_ELEMENTS", block)
    q, k, v = (torch.randn(1, H, n, D, requires_grad=train) for _ in range(3))
    enc = encoding(name).float()
    saved = {}  # storages kept for backward (views of q, k, v share theirs)

    def keep(t):
        saved[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    with LargestTensor() as largest, torch.set_grad_enabled(train):
        with torch.autograd.graph.saved_tensors_hooks(keep, lambda t: t):
            fn = enc.score_mod(q, k, torch.arange(n).expand(1, n), 0)  # its tables count too
            out = blockwise_attention(q, k, v, fn, additive=additive)
        if train:
            out.sum().backward()
    assert largest.numel <= block
    assert sum(saved.values()) <= block * 4  # fp32 bytes
