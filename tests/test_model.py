import torch
import torch.nn.functional as F

import posbench

from helpers import assert_matches_reference


def tiny(encoding="rope", *extra):
    cfg = posbench.compose([f"encoding={encoding}", "model.n_layer=2", "model.d_model=64",
                            "model.n_head=4", *extra])
    torch.manual_seed(0)
    return posbench.build_model(cfg).eval()


def test_logits_shape_and_weight_tying():
    model = tiny()
    idx = torch.randint(0, 256, (3, 40))
    assert model(idx).shape == (3, 40, 256)
    assert model.head.weight.data_ptr() == model.tok_emb.weight.data_ptr()


def test_pos_1d_and_2d_agree_with_default():
    model = tiny("alibi")
    idx = torch.randint(0, 256, (2, 24))
    default = model(idx)
    assert torch.equal(default, model(idx, pos=torch.arange(24)))
    assert torch.equal(default, model(idx, pos=torch.arange(24).expand(2, 24)))


def test_token_losses_match_cross_entropy_in_any_chunking():
    model = tiny()
    idx = torch.randint(0, 256, (2, 50))
    tgt = torch.randint(0, 256, (2, 50))
    full = F.cross_entropy(model(idx).transpose(1, 2), tgt, reduction="none")
    for chunk in (7, 50, 4096):
        torch.testing.assert_close(model.token_losses(idx, tgt, chunk=chunk), full)


def test_blockwise_path_matches_dense_float64_reference_forward_and_backward():
    from posbench.attention.paths import blockwise_attention
    import posbench.attention.paths as attention

    torch.manual_seed(0)
    B, H, T, d = 2, 3, 70, 8
    q, k, v = (torch.randn(B, H, T, d, dtype=torch.float64, requires_grad=True) for _ in range(3))
    slopes = torch.tensor([0.5, 0.25, 0.125], dtype=torch.float64)

    def bias(score, b, h, q_idx, kv_idx):
        return score - slopes[h] * (q_idx - kv_idx)

    def dense(q, k, v):
        i = torch.arange(T).view(T, 1)
        j = torch.arange(T).view(1, T)
        s = q @ k.transpose(-1, -2) / d ** 0.5 - slopes.view(1, H, 1, 1) * (i - j)
        return torch.softmax(s.masked_fill(j > i, float("-inf")), -1) @ v

    old = attention.BLOCK_ELEMENTS
    attention.BLOCK_ELEMENTS = B * H * T * 16  # force several blocks and checkpointing
    try:
        out = blockwise_attention(q, k, v, bias)
    finally:
        attention.BLOCK_ELEMENTS = old
    ref = dense(q, k, v)
    assert_matches_reference(out, ref, (q, k, v), rtol=1e-10, atol=1e-10, grad_rtol=1e-9,
                             grad_atol=1e-9)


def test_sdpa_path_matches_dense_reference():
    from posbench.attention.paths import attend

    torch.manual_seed(1)
    q, k, v = (torch.randn(1, 2, 33, 8) for _ in range(3))
    enc = tiny("nope").encoding
    pos = torch.arange(33).expand(1, 33)
    s = (q @ k.transpose(-1, -2)) / 8 ** 0.5
    s = s.masked_fill(torch.ones(33, 33, dtype=torch.bool).triu(1), float("-inf"))
    torch.testing.assert_close(attend(q, k, v, pos, enc, 0), torch.softmax(s, -1) @ v,
                               rtol=1e-5, atol=1e-5)


def test_gpt_init_leaves_the_encodings_own_modules_alone():
    from posbench.encodings import Dims, PositionalEncoding
    from posbench.model.transformer import GPT

    class ZeroLinear(PositionalEncoding):
        def __init__(self):
            super().__init__(None, Dims(1, 2, 32, 16, 16))
            self.proj = torch.nn.Linear(32, 32)
            torch.nn.init.zeros_(self.proj.weight)

    model = GPT(256, 1, 2, 32, 4, ZeroLinear())
    assert torch.count_nonzero(model.encoding.proj.weight) == 0
    assert torch.count_nonzero(model.blocks[0].attn.qkv.weight) > 0
