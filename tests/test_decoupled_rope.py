"""model.decoupled_rope, MLA's decoupled RoPE (DeepSeek-V2, arXiv 2405.04434 §2.1.3), against an
oracle written here from the definition in float64:

    q_i = [q^C_i; RoPE(q^R_i, p_i)],  k_j = [k^C_j; RoPE(k^R_j, p_j)],  k^R one for every head,
    logit = q_i . k_j / sqrt(d + d^R),

the content parts q^C, k^C the layer's own projections, unrotated, and q^R (per head) and k^R
(shared) projected from the layer's input. RoPE is built here as d^R x d^R rotations with Python
floats (helpers.plane_rotations), posbench's half-split layout inside the rotary part."""
import math

import pytest
import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.utils.flop_counter import FlopCounterMode

import posbench
import posbench.attention.paths as attention
from posbench.encodings import Dims
from posbench.encodings.p_rope import PRoPE
from posbench.encodings.rope import RoPE
from posbench.runs.estimate import step_flops
from posbench.runs.run import train

from helpers import assert_shift_invariant, finite_at_16l, plane_rotations, tiny_model
from test_budget import COUNTS

MLA = ["model.decoupled_rope=true", "train.seq_len=32", "eval.lengths=[64]"]


def mla_model(*extra, name="rope"):
    return tiny_model(*MLA, *extra, name=name).double()


def oracle(attn, x, pos, base=10000.0):
    """The layer's output from its weights (B = 1 sequence of positions pos[0])."""
    B, T, D = x.shape
    H, r = attn.n_head, attn.decoupled.width
    d = D // H
    q_c, k_c, v = (t.view(B, T, H, d).transpose(1, 2)
                   for t in (x @ attn.qkv.weight.T).split(D, dim=-1))
    parts = (x @ attn.decoupled.proj.weight.T).view(B, T, H + 1, r)
    q_r, k_r = parts[:, :, :H].transpose(1, 2), parts[:, :, H]  # (B, H, T, r), (B, T, r)
    planes = [(j, j + r // 2, base ** (-2 * j / r)) for j in range(r // 2)]
    turn = plane_rotations(r, planes, pos[0].tolist())  # (T, r, r)
    q_r = torch.einsum("tij,bhtj->bhti", turn, q_r)
    k_r = torch.einsum("tij,btj->bti", turn, k_r)
    logits = (q_c @ k_c.transpose(-2, -1) + q_r @ k_r[:, None].transpose(-2, -1)) / math.sqrt(d + r)
    future = torch.ones(T, T, dtype=torch.bool).triu(1)
    out = torch.softmax(logits.masked_fill(future, -math.inf), -1) @ v
    return out.transpose(1, 2).reshape(B, T, D) @ attn.proj.weight.T


@pytest.mark.parametrize("offset", [0, 5000])
@pytest.mark.parametrize("extra", [(), ("model.n_head=2", "model.decoupled_rope_dim=4")])
def test_the_layer_is_the_definition_forward_and_gradients(offset, extra):
    model = mla_model(*extra)
    attn = model.blocks[1].attn
    x = torch.randn(1, 40, 64, dtype=torch.float64, generator=torch.Generator().manual_seed(0))
    pos = torch.arange(40).unsqueeze(0) + offset
    with torch.no_grad():
        torch.testing.assert_close(attn(x, pos, model.encoding), oracle(attn, x, pos),
                                   rtol=1e-10, atol=1e-10)
    model.train()
    x.requires_grad_(True)
    wrt = [x, attn.qkv.weight, attn.decoupled.proj.weight, attn.proj.weight]
    got, expected = attn(x, pos, model.encoding), oracle(attn, x, pos)
    torch.testing.assert_close(got, expected, rtol=1e-10, atol=1e-10)
    g = torch.randn_like(got)
    for a, b in zip(torch.autograd.grad((got * g).sum(), wrt),
                    torch.autograd.grad((expected * g).sum(), wrt), strict=True):
        torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-10)


def test_default_width_is_half_the_head_and_the_rotary_key_is_shared_by_the_heads():
    model = mla_model()  # d = 64 / 4 = 16: d^R = 8, DeepSeek-V2's 64 of 128
    attn = model.blocks[0].attn
    assert attn.decoupled.proj.weight.shape == (5 * 8, 64) and model.encoding.dims.head_dim == 8
    x = torch.randn(2, 20, 64, dtype=torch.float64)
    q, k, v = attn.heads(x, torch.arange(20).expand(2, 20), model.encoding)
    assert q.shape == k.shape == (2, 4, 20, 24) and v.shape == (2, 4, 20, 16)
    assert all(torch.equal(k[:, h, :, 16:], k[:, 0, :, 16:]) for h in range(4))
    assert not torch.equal(q[:, 1, :, 16:], q[:, 0, :, 16:])
    # the content parts are the layer's own projections, untouched by the encoding
    q_c, k_c, _ = (x @ attn.qkv.weight.T).split(64, -1)
    torch.testing.assert_close(q[..., :16], q_c.view(2, 20, 4, 16).transpose(1, 2))
    torch.testing.assert_close(k[..., :16], k_c.view(2, 20, 4, 16).transpose(1, 2))


def test_the_rotary_part_is_shift_invariant_and_the_model_too():
    model = mla_model()
    attn = model.blocks[0].attn
    x = torch.randn(1, 30, 64, dtype=torch.float64)
    logits = []
    for c in (0, 1, 977, 65536):
        q, k, _ = attn.heads(x, torch.arange(30).unsqueeze(0) + c, model.encoding)
        logits.append(q[..., 16:] @ k[..., 16:].transpose(-2, -1))
    for other in logits[1:]:
        torch.testing.assert_close(other, logits[0], rtol=1e-9, atol=1e-9)
    idx = torch.randint(0, 64, (2, 64), generator=torch.Generator().manual_seed(0))
    assert_shift_invariant(model, idx, tol=1e-8)


def test_with_one_head_it_is_gpt_neox_partial_rotary_up_to_a_permutation():
    """One head: the shared rotary key is the head's own, so [q^C; q^R] is a head of d + d^R whose
    last d^R dims turn as a RoPE of dimension d^R: p_rope's `partial` at p = d^R / (d + d^R), once
    the dims are permuted into its layout (its pairs (j, j + (d + d^R)/2), j < d^R/2)."""
    model = mla_model("model.n_head=1", "model.d_model=32")  # d = 32, d^R = 16
    attn = model.blocks[0].attn
    x = torch.randn(1, 50, 32, dtype=torch.float64)
    pos = torch.arange(50).unsqueeze(0) + 300
    d, r = 32, 16
    half = (d + r) // 2
    target = torch.empty(d + r, dtype=torch.long)  # MLA dim -> p_rope dim
    target[d:d + r // 2] = torch.arange(r // 2)  # the rotary part's first halves of its pairs
    target[d + r // 2:] = half + torch.arange(r // 2)  # and their partners
    target[:d] = torch.tensor([i for i in range(d + r) if i % half >= r // 2])
    assert sorted(target.tolist()) == list(range(d + r))

    def permute(t):
        out = torch.empty_like(t)
        out[..., target] = t
        return out

    with torch.no_grad():
        rotated_q, rotated_k, _ = attn.heads(x, pos, model.encoding)
        q_c, k_c, _ = (x @ attn.qkv.weight.T).split(32, -1)
        parts = x @ attn.decoupled.proj.weight.T
        plain_q = torch.cat((q_c, parts[..., :r]), -1).unsqueeze(1)
        plain_k = torch.cat((k_c, parts[..., r:]), -1).unsqueeze(1)
        partial = PRoPE(PRoPE.Config(name="p_rope", p=r / (d + r), variant="partial"),
                        Dims(1, 1, d + r, 32, 64))
        q, k = partial.rotate(permute(plain_q), permute(plain_k), pos, 0)
    torch.testing.assert_close(q, permute(rotated_q), rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(k, permute(rotated_k), rtol=1e-12, atol=1e-12)


def test_the_rope_family_combines_with_it():
    # p_rope at the rotary part: R = floor(0.75 * 8 / 2) = 3 of its 4 pairs turn
    model = mla_model(name="p_rope")
    assert int((model.encoding.inv_freq > 0).sum()) == 3
    for name in ("hope", "rope_id", "xpos", "irope"):
        assert finite_at_16l(f"encoding={name}", "model.decoupled_rope=true")


def test_declared_rotation_flops_match_the_counted_ones_at_the_rotary_width():
    dims = Dims(2, 4, 64, 128, 256, rotary_dim=8)
    rope = RoPE(RoPE.Config(name="rope"), dims).double()
    q, k = (torch.randn(2, 4, 128, 8, dtype=torch.float64) for _ in range(2))
    with FlopCounterMode(display=False, custom_mapping=COUNTS) as counted:
        for layer in range(2):
            rope.rotate(q, k, torch.arange(128).expand(2, 128), layer)
    measured = counted.get_total_flops()
    assert abs(rope.flops(2, 128, 128 * 128) - measured) <= 0.1 * measured


@pytest.mark.parametrize("extra", [(), ("model.decoupled_rope=true",)])
def test_a_steps_flops_are_those_counted(extra, monkeypatch):
    """The estimate's FLOPs of a training step, the rotary parts' weights and the wider q.k
    included, against FlopCounterMode's count of a forward and backward: the weights' matmuls
    as counted, the attention's batched ones (SDPA's math path, every one of the T^2 pairs) at
    half, the causal pairs the estimate counts. v is left unpadded (the fused path pads it to
    q's width for its kernel), so p.v counts over v's own width, as the definition does."""
    monkeypatch.setattr(attention, "causal_sdpa", lambda q, k, v: F.scaled_dot_product_attention(
        q, k, v, is_causal=True))
    cfg = posbench.compose(["encoding=rope", *extra, "model.n_layer=2", "train.batch_size=2",
                            "train.seq_len=512"])
    model = posbench.build_model(cfg, vocab_size=256)
    x = torch.randint(0, 256, (2, 512))
    with sdpa_kernel(SDPBackend.MATH), FlopCounterMode(display=False) as counter:
        model(x, targets=x).mean().backward()
    counts = {str(op): n for op, n in counter.get_flop_counts()["Global"].items()}
    assert set(counts) == {"aten.mm", "aten.bmm"}
    own = model.encoding.flops(2, 512, 512 * 513 // 2)  # not counted: elementwise
    assert step_flops(cfg, model) - 3 * own == pytest.approx(
        counts["aten.mm"] + counts["aten.bmm"] / 2, rel=1e-2)


def test_trains_and_evaluates_at_8x_the_training_length(tmp_path):
    cfg = posbench.compose(["encoding=rope", "model.decoupled_rope=true", "model.n_layer=1",
                            "model.d_model=32", "model.n_head=2", "train.steps=4",
                            "train.batch_size=2", "train.seq_len=32", "train.warmup_steps=1",
                            "eval.lengths=[32,256]", "eval.tokens=512", "device=cpu",
                            "eval.rope_scaling=yarn"])
    record = train(cfg, tmp_path, group="test", name="mla")
    assert record["status"] == "ok" and record["model"]["params"] > 0
    assert all(math.isfinite(p["loss"]) for p in record["eval"]["curve"])


@pytest.mark.parametrize("overrides, line", [
    (["encoding=alibi", "model.decoupled_rope=true"],
     "model.decoupled_rope=True is not accepted; expected false for encoding=alibi, which does "
     "not rotate q and k (those that do: "),
    (["model.decoupled_rope=true", "model.decoupled_rope_dim=5"],
     "model.decoupled_rope_dim=5 is not accepted; expected an even width >= 2"),
    (["model.decoupled_rope=true", "model.d_model=24", "model.n_head=4"],
     "model.decoupled_rope_dim (null: half of model.d_model/model.n_head)=3 is not accepted; "
     "expected an even width >= 2"),
    (["model.decoupled_rope_dim=8"],
     "model.decoupled_rope_dim=8 is not accepted; expected null unless model.decoupled_rope=true"),
    (["model.decoupled_rope=true", "eval.rope_scaling=rerope"],
     "eval.rope_scaling='rerope' is not accepted; expected a scaling of the frequencies with "
     "model.decoupled_rope=true (a distance remap rotates the whole q and k)"),
])
def test_what_it_cannot_combine_with_is_refused_in_one_line(overrides, line):
    with pytest.raises(posbench.ConfigError) as err:
        posbench.config.check(posbench.compose(["encoding=rope", *overrides]))
    assert str(err.value).startswith(line) and "\n" not in str(err.value)
