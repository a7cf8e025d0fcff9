"""ComRoPE (docs/encodings.md#group-family). The oracle places each learned block's generator
P_i - P_i^T at its coordinates of a dense d x d matrix (explicit loops over the documented
layout) and exponentiates it with scipy's expm in float64, independently of comrope.py."""
import dataclasses

import pytest
import scipy.linalg
import torch

import posbench
from posbench.encodings import Dims, registry
from posbench.encodings.comrope import ComRoPE

from helpers import assert_shift_invariant

F64 = torch.float64
L = 64


def build(name, *extra, seed=0):
    cfg = posbench.compose([f"encoding={name}", "model.n_layer=2", "model.d_model=64",
                            "model.n_head=4", f"train.seq_len={L}", *extra])
    torch.manual_seed(seed)
    return posbench.build_model(cfg, vocab_size=64).eval()


def module(n_head=2, d=8, **changes):
    cfg = dataclasses.replace(registry()["comrope"].config, **changes)
    return ComRoPE(cfg, Dims(n_layer=1, n_head=n_head, d_model=n_head * d, train_len=L,
                             max_len=4096)).double()


def randomize(enc, std=0.5, seed=0):
    with torch.no_grad():
        enc.generator.add_(torch.randn(enc.generator.shape, dtype=enc.generator.dtype,
                                       generator=torch.Generator().manual_seed(seed)) * std)


def dense_generator(P, d):
    """The d x d generator per unit of position: block i of size b acts on the half-split
    coordinates of pairs i*b/2 .. (i+1)*b/2 - 1, first coordinates p, then p + d/2."""
    m, b, _ = P.shape
    A = torch.zeros(d, d, dtype=F64)
    for i in range(m):
        coords = [i * b // 2 + r for r in range(b // 2)] + [d // 2 + i * b // 2 + r
                                                              for r in range(b // 2)]
        block = P[i].double() - P[i].double().T
        for a in range(b):
            for c in range(b):
                A[coords[a], coords[c]] = block[a, c]
    return A / L


def query_map(enc, t):
    """G(t) per head, (H, d, d), from the module's rotate (columns: images of the unit vectors)."""
    d, H = enc.dims.head_dim, enc.dims.n_head
    eye = torch.eye(d, dtype=F64).view(d, 1, 1, d).expand(d, H, 1, d)
    q, k = enc.rotate(eye, eye, torch.full((d, 1), t, dtype=torch.long), 0)
    assert torch.equal(q, k)  # orthogonal: queries and keys turn alike
    return q[:, :, 0].permute(1, 2, 0)


@pytest.mark.parametrize("block_size", [2, 4, 8])
def test_maps_are_exp_of_the_block_diagonal_generator(block_size):
    enc = module(block_size=block_size)
    randomize(enc)
    for h in range(2):
        A = dense_generator(enc.generator[0, h].detach(), 8)
        for t in (0, 1, 7, 1000, 10**4):
            expected = torch.from_numpy(scipy.linalg.expm(t * A.numpy()))
            err = (query_map(enc, t)[h] - expected).abs().max().item()
            assert err < 1e-9, (block_size, h, t, err)


def test_blocks_commute_and_the_relative_law_holds_at_offsets_up_to_10k():
    enc = module(block_size=4)
    randomize(enc)
    A = dense_generator(enc.generator[0, 1].detach(), 8)
    parts = []
    for i in range(2):  # the generator restricted to each block
        part = torch.zeros_like(A)
        coords = [2 * i, 2 * i + 1, 4 + 2 * i, 5 + 2 * i]
        part[[[c] for c in coords], coords] = A[[[c] for c in coords], coords]
        parts.append(part)
    torch.testing.assert_close(parts[0] + parts[1], A, rtol=0, atol=0)  # nothing off the blocks
    torch.testing.assert_close(parts[0] @ parts[1], parts[1] @ parts[0], rtol=0, atol=1e-15)
    G = {t: query_map(enc, t) for t in (0, 3, 997, 1000, 10**4, 10**4 + 997)}
    eye = torch.eye(8, dtype=F64).expand(2, 8, 8)
    torch.testing.assert_close(G[0], eye, rtol=0, atol=1e-14)
    torch.testing.assert_close(G[10**4].transpose(-1, -2) @ G[10**4], eye, rtol=0, atol=1e-10)
    torch.testing.assert_close(G[3] @ G[997], G[1000], rtol=0, atol=1e-10)
    torch.testing.assert_close(G[1000].transpose(-1, -2) @ G[10**4 + 997],
                               G[3].transpose(-1, -2) @ G[10**4], rtol=0, atol=1e-10)


@pytest.mark.parametrize("block_size", [2, 4])
def test_logits_are_q_exp_of_the_lag_k(block_size):
    enc = module(n_head=1, d=16, block_size=block_size)
    randomize(enc, std=2.0)
    g = torch.Generator().manual_seed(0)
    q, k = torch.randn(2, 1, 1, 30, 16, dtype=F64, generator=g)
    pos = (torch.arange(30) * 37 + 5).view(1, 30)
    qt, kt = enc.rotate(q, k, pos, 0)
    got = qt[0, 0] @ kt[0, 0].T
    A = dense_generator(enc.generator[0, 0].detach(), 16).numpy()
    for i in range(0, 30, 7):
        for j in range(30):
            lag = int(pos[0, j] - pos[0, i])
            expected = q[0, 0, i] @ torch.from_numpy(scipy.linalg.expm(lag * A)) @ k[0, 0, j]
            assert abs(got[i, j].item() - expected.item()) < 1e-9, (i, j)


@pytest.mark.parametrize("block_size", [2, 4])
def test_untrained_comrope_is_rope(block_size):
    """A starts at RoPE's generator in block form, so the untrained model's logits are rope's
    (to rounding: matrix exponentials against cos and sin)."""
    com = build("comrope", f"encoding.block_size={block_size}", seed=1)
    rope = build("rope", seed=2)
    com.load_state_dict(rope.state_dict(), strict=False)
    idx = torch.randint(0, 64, (2, 50), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        for pos in (None, torch.arange(50) + 12345):
            err = (com(idx, pos=pos) - rope(idx, pos=pos)).abs().max().item()
            assert err < 1e-5, err
        randomize(com.encoding, std=1.0)
        assert (com(idx) - rope(idx)).abs().max() > 1e-3  # a learned generator moves them


def test_speeds_are_per_unit_of_the_training_length():
    """The fastest pair of RoPE turns 1 radian per token: its generator entry is L."""
    enc = module(block_size=2)
    P = enc.generator[0, 0, 0].detach()
    assert (P - P.T)[1, 0].item() == pytest.approx(L, rel=1e-7)
    G = query_map(enc, 1)[0]
    assert G[4, 0].item() == pytest.approx(torch.sin(torch.tensor(1.0, dtype=F64)).item(),
                                           abs=1e-7)  # pair 0: coordinates 0 and d/2 = 4


def test_shift_invariance_of_the_whole_model_up_to_10k():
    model = build("comrope", "encoding.block_size=4")
    randomize(model.encoding, std=1.0)
    with torch.no_grad():
        for block in model.blocks:
            block.attn.qkv.weight[: 2 * 64] *= 10
    idx = torch.randint(0, 64, (2, 40), generator=torch.Generator().manual_seed(0))
    base = assert_shift_invariant(model, idx, offsets=(1, 17, 1000, 10**4), per_sequence=True)
    with torch.no_grad():
        assert (model(idx, pos=2 * torch.arange(40)) - base).abs().max() > 1e-3


def test_one_generator_per_layer_and_head_and_every_entry_learns():
    model = build("comrope", "encoding.block_size=4")
    assert model.encoding.generator.shape == (2, 4, 4, 4, 4)  # layers, heads, d/b, b, b
    model.train()
    idx = torch.randint(0, 64, (2, 40), generator=torch.Generator().manual_seed(0))
    model(idx).logsumexp(-1).mean().backward()
    grad = model.encoding.generator.grad
    off_diagonal = ~torch.eye(4, dtype=torch.bool)  # a skew generator has no diagonal
    assert grad is not None and (grad - grad.transpose(-1, -2))[..., off_diagonal].abs().min() > 0


@pytest.mark.parametrize("overrides,key", [
    (["encoding.block_size=3"], "encoding.block_size=3"),
    (["encoding.block_size=0"], "encoding.block_size=0"),
    (["encoding.block_size=32", "model.d_model=64", "model.n_head=4"],
     "model.d_model/model.n_head=16"),
    (["encoding.base=1"], "encoding.base=1.0"),
    # a larger block's matrix exponential costs what the learned generator asks: no FLOP budget
    (["encoding.block_size=4", "train.budget=flops"], "encoding.block_size=4"),
])
def test_out_of_range_values_are_rejected_in_one_line(overrides, key):
    with pytest.raises(posbench.ConfigError) as err:
        posbench.compose(["encoding=comrope", *overrides])
    message = str(err.value)
    assert message.startswith(key + " is not accepted; expected") and "\n" not in message
